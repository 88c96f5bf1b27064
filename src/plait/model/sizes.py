"""Size formulas: parameters, FLOPs and model-state bytes, in one place.

The trainer's MFU, ``plait info``, the simulator and the planner all read these; tests
check them against the parameters the runtime actually builds.

FLOP convention (model FLOPs, as in Narayanan et al. 2021 and the PaLM paper's MFU):
every matrix multiply counts 2 FLOPs per multiply-add; a training step is forward (1x)
plus backward (2x), so each weight costs 6 FLOPs per token; attention scores and their
application to the values add 12 * layers * seq_len * heads * head_dim per token (that is
the hidden size unless ``head_dim`` sets its own; the full square, not halved for the
causal mask nor cut to a sliding window, as Megatron-LM counts it). Recomputation is *not*
counted: that is hardware FLOPs (HFU), see ``hardware_flops_per_token``. Norms, softmax,
activations and the optimizer are ignored. For GPT with h = hidden, l = layers,
s = seq_len, V = vocab this is 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token, the
formula of Narayanan et al. 2021 without its recomputation term.

Mixtures of experts (``cfg.moe``): a MoE block's MLP holds E routed experts, S shared
ones and a router (E x h); a token goes through K routed and the S shared. Parameters
count every expert (``num_params``: what memory holds); FLOPs count the active ones
(``active_params``: the router, K + S experts), as MFU does for Mixtral / DeepSeek.
"""

from __future__ import annotations

from plait.model.config import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one block that take part in matrix multiplies (no biases, no norms)."""
    h = cfg.hidden
    attn = 2 * h * cfg.q_dim + 2 * h * cfg.kv_dim  # q and o; k and v
    mlp = (2 if cfg.arch == "gpt2" else 3) * h * cfg.ffn_hidden
    return attn + mlp


def expert_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one expert MLP (GELU: 2 h F, SwiGLU: 3 h F; F = ``moe_ffn_hidden``)."""
    return (2 if cfg.arch == "gpt2" else 3) * cfg.hidden * cfg.moe_ffn_hidden


def moe_mlp_matmul_params(cfg: ModelConfig, *, active: bool = False) -> int:
    """Matmul weights of a MoE block's MLP: the router and every expert (``active``: the
    K routed experts a token goes through) plus the shared ones."""
    routed = cfg.moe_top_k if active else cfg.moe_experts
    return (routed + cfg.moe_shared_experts) * expert_matmul_params(
        cfg
    ) + cfg.moe_experts * cfg.hidden


def _moe_mlp_biases(cfg: ModelConfig, *, active: bool = False) -> int:
    if not cfg.biases:
        return 0
    routed = cfg.moe_top_k if active else cfg.moe_experts
    shared = (
        cfg.moe_shared_experts * cfg.moe_ffn_hidden + cfg.hidden if cfg.moe_shared_experts else 0
    )
    return routed * (cfg.moe_ffn_hidden + cfg.hidden) + shared


def dense_mlp_matmul_params(cfg: ModelConfig) -> int:
    """Weights of the dense MLP (GELU: 2 h f, SwiGLU: 3 h f)."""
    return (2 if cfg.arch == "gpt2" else 3) * cfg.hidden * cfg.ffn_hidden


def _moe_extra(cfg: ModelConfig, *, active: bool, matmul_only: bool) -> int:
    """What the MoE blocks add over dense blocks, in all (``n_moe_layers`` of them)."""
    if not cfg.moe:
        return 0
    extra = moe_mlp_matmul_params(cfg, active=active) - dense_mlp_matmul_params(cfg)
    if not matmul_only and cfg.biases:
        extra += _moe_mlp_biases(cfg, active=active) - (cfg.ffn_hidden + cfg.hidden)
    return cfg.n_moe_layers * extra


def blocks_matmul_params(cfg: ModelConfig, *, active: bool = True) -> int:
    """Matmul weights of all the blocks (``active``: those a token goes through)."""
    return cfg.n_layers * layer_matmul_params(cfg) + _moe_extra(
        cfg, active=active, matmul_only=True
    )


def layer_params(cfg: ModelConfig) -> int:
    """All parameters of one transformer block."""
    h = cfg.hidden
    n = layer_matmul_params(cfg)
    if cfg.biases:
        n += h + 2 * cfg.kv_dim + h  # q, k, v, o biases
        n += cfg.ffn_hidden + h  # MLP biases
        n += 2 * 2 * h  # two LayerNorms, weight and bias
    else:
        n += 2 * h  # two RMSNorm weights
    if cfg.qkv_bias:
        n += cfg.q_dim + 2 * cfg.kv_dim
    if cfg.qk_norm:
        n += 2 * cfg.head_dim  # one RMSNorm weight for every query head, one for every key head
    return n


def kv_width_per_rank(cfg: ModelConfig, tp: int) -> float:
    """Width of a tp rank's k (or v): max(K / t, 1) heads of ``head_dim`` -- a kv head is
    replicated where there are fewer than t (``Attention``)."""
    return cfg.head_dim * max(cfg.n_kv_heads / tp, 1.0)


def layer_params_per_rank(cfg: ModelConfig, tp: int) -> float:
    """Parameters of one block a tp rank holds: q, o and the MLP's weights split t ways,
    with the biases inside the column-parallel layers (q, k, v, the MLP's first); k and v
    by heads, max(K / t, 1) of them (replicated where there are fewer than t); the norms and
    the biases added after a tp reduction (o's, the MLP's last) whole. ``layer_params`` at
    t = 1."""
    h, t = cfg.hidden, tp
    kv = kv_width_per_rank(cfg, t)
    c = 2 if cfg.arch == "gpt2" else 3
    n = 2 * h * cfg.q_dim / t + 2 * h * kv + c * h * cfg.ffn_hidden / t
    if cfg.biases:
        n += h / t + 2 * kv + h  # q, k, v biases split as their weights; o's whole
        n += cfg.ffn_hidden / t + h  # the MLP's first bias split, its last whole
        n += 2 * 2 * h  # two LayerNorms, weight and bias
    else:
        n += 2 * h  # two RMSNorm weights
    if cfg.qkv_bias:
        n += cfg.q_dim / t + 2 * kv
    if cfg.qk_norm:
        n += 2 * cfg.head_dim
    return n


def layer_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors of one block as plait builds it (separate q, k, v)."""
    if cfg.biases:
        return 16  # 6 linears and 2 LayerNorms, each with a weight and a bias
    return 9 + (3 if cfg.qkv_bias else 0) + (2 if cfg.qk_norm else 0)  # 7 linears, 2 norms


def embedding_params(cfg: ModelConfig) -> int:
    """Token embedding, learned positions (gpt2) and, when untied, the output head."""
    n = cfg.vocab_size * cfg.hidden
    if cfg.arch == "gpt2":
        n += cfg.seq_len * cfg.hidden
    if not cfg.tied_embeddings:
        n += cfg.vocab_size * cfg.hidden
    return n


def final_norm_params(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden if cfg.biases else cfg.hidden


def num_params(cfg: ModelConfig) -> int:
    """Total parameter count (tied embeddings counted once; every expert)."""
    blocks = cfg.n_layers * layer_params(cfg) + _moe_extra(cfg, active=False, matmul_only=False)
    return blocks + embedding_params(cfg) + final_norm_params(cfg)


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token goes through: ``num_params`` with K routed experts of E."""
    blocks = cfg.n_layers * layer_params(cfg) + _moe_extra(cfg, active=True, matmul_only=False)
    return blocks + embedding_params(cfg) + final_norm_params(cfg)


def model_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token, model-FLOPs convention (module doc)."""
    s = cfg.seq_len if seq_len is None else seq_len
    dense = blocks_matmul_params(cfg) + cfg.vocab_size * cfg.hidden  # active, + logits
    attention = 12 * cfg.n_layers * s * cfg.q_dim
    return 6.0 * dense + attention


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """One forward pass: a third of ``model_flops_per_token``."""
    return model_flops_per_token(cfg, seq_len) / 3.0


def hardware_flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, recompute: str = "none",
    recomputed_share: float = 1.0,
) -> float:  # fmt: skip
    """FLOPs actually executed: model FLOPs plus what recomputation repeats.

    ``full`` reruns every block's forward (4 passes instead of 3 for the blocks, the
    96 B s l h^2 of Narayanan et al.), or ``recomputed_share`` of the blocks' forwards
    (``--recompute-layers``); ``selective`` reruns only the attention core (scores,
    softmax, weighted values), as in Korthikanti et al. 2022.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    flops = model_flops_per_token(cfg, s)
    if recompute == "full":
        flops += recomputed_share * (2.0 * blocks_matmul_params(cfg)
                                     + 4 * cfg.n_layers * s * cfg.q_dim)  # fmt: skip
    elif recompute == "selective":
        flops += 4.0 * cfg.n_layers * s * cfg.q_dim
    elif recompute != "none":
        raise ValueError(f"--recompute {recompute!r}: choose none, selective or full")
    return flops


def model_state_breakdown(
    n_params: float,
    *,
    dp: int = 1,
    zero: int = 0,
    offload_optimizer: bool = False,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optim_bytes: int = 8,
    frozen_params: float = 0,
) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state one data-parallel rank holds for
    ``n_params`` parameters: ``params``, ``grads``, ``optim`` on the device, their sum
    ``device``, and ``host``. The one ZeRO formula: the runtime's memory report, the
    simulator and the planner all read it.

    As in Rajbhandari et al. 2020 (ZeRO), over ``dp`` ranks (``--zero-shard-group`` when
    hybrid sharding, else ``--dp``): stage 0 keeps everything; stage 1 shards the
    optimizer state; stage 2 also the gradients; stage 3 also the parameters. Defaults
    are plait's: fp32 weights and gradients (kept in fp32 also under bf16/fp16 autocast)
    and AdamW's two fp32 moments, 16 bytes per parameter in all. With
    ``offload_optimizer`` (ZeRO-Offload) the optimizer state leaves the device for host
    memory, together with an fp32 master copy of the rank's parameter shard that the CPU
    update works on.

    ``frozen_params`` (a LoRA run's base; ``n_params`` then counts the adapters): held as
    weights -- sharded under stage 3, as the runtime does -- with no gradient and no
    optimizer state.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    if offload_optimizer and zero == 0:
        raise ValueError("--offload-optimizer needs --zero 1, 2 or 3")
    shard = n_params / dp
    out = {
        "params": param_bytes * (shard if zero >= 3 else n_params)
        + param_bytes * (frozen_params / dp if zero >= 3 else frozen_params),
        "grads": grad_bytes * (shard if zero >= 2 else n_params),
        "optim": 0.0 if offload_optimizer else optim_bytes * (shard if zero >= 1 else n_params),
    }
    out["device"] = out["params"] + out["grads"] + out["optim"]
    out["host"] = (optim_bytes + 4) * shard if offload_optimizer else 0.0
    return out


def model_state_bytes(n_params: float, **kw) -> float:
    """The device bytes of ``model_state_breakdown`` (same keywords)."""
    return model_state_breakdown(n_params, **kw)["device"]


def activation_bytes_per_layer(
    cfg: ModelConfig,
    *,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    flash_attention: bool = False,
    residual_bytes: int | None = None,
) -> float:
    """Bytes one transformer block keeps for its backward, per tensor-parallel rank.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", section 4), generalised to grouped-query attention, SwiGLU, any activation
    dtype and fused attention. For GPT (f = 4h, a heads), 2-byte activations and dropout
    (1-byte masks) it is their
        s b h (10 + 24/t + 5 a s / (h t))     tensor parallel
        s b h (34 + 5 a s / h) / t            tensor + sequence parallel
        s b h (10 + 24/t) or 34 s b h / t     selective recomputation (no s^2 term)
        2 s b h  (/ t with sequence parallelism)   full recomputation (the block input)
    Parts: the QKV and FC1 inputs and two norm inputs (4 h elements per token, split by
    t only under sequence parallelism) and two dropout masks (2 h bytes); inside the
    tensor-parallel region Q, K, V and the attention output (2 q + 2 kv, q = heads x
    head size, h unless ``head_dim`` is set) and the MLP
    (GELU: its input and output, 2 f; SwiGLU: gate, up and their product, 3 f); the
    attention core keeps the softmax output (a s per token), with dropout also its
    mask and output (5 a s bytes in all at 2 bytes). Fused attention keeps no s x s
    matrix, only a 4-byte log-sum-exp per head and token.

    ``residual_bytes`` (default ``act_bytes``): bytes per element of the residual stream,
    which the two norm inputs (and under full recomputation the block input) are -- 4
    with Megatron's ``--fp32-residual-connection`` (plait's ``--fp32-residual``).

    Qwen 3's per-head norms of q and k (``qk_norm``) keep their inputs -- views of the
    fused QKV product, whose whole storage (q + 2 kv elements, v's slice too) they hold --
    and a 4-byte reciprocal RMS per head and token (``plait rehearse`` of Qwen 3 0.6B: its
    activations were 1.09 of the model's without them, 1.021 with q + kv).
    """
    s = cfg.seq_len if seq_len is None else seq_len
    tokens = micro_batch_size * s
    # k and v: a tp rank's width (``kv_width_per_rank``), times t as the sum below divides
    h, kv, e = cfg.hidden, kv_width_per_rank(cfg, tp) * tp, act_bytes
    r = act_bytes if residual_bytes is None else residual_bytes
    masks = cfg.dropout > 0
    split_all = tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * h * r / split_all
    if recompute not in ("none", "selective"):
        raise ValueError(f"--recompute {recompute!r}: choose none, selective or full")
    replicated = 2 * h * e + 2 * h * r + (2 * h if masks else 0)
    mlp = (2 if cfg.arch == "gpt2" else 3) * cfg.ffn_hidden
    split = (2 * cfg.q_dim + 2 * kv + mlp) * e
    if cfg.qk_norm:
        heads = cfg.n_heads + kv / cfg.head_dim
        split += (cfg.q_dim + 2 * kv) * e + 4 * heads
    if flash_attention:
        core = 4 * cfg.n_heads
    elif recompute == "selective":
        core = 0
    else:
        core = cfg.n_heads * s * (2 * e + 1 if masks else e)
    return tokens * (replicated / split_all + (split + core) / tp)
