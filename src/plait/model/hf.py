"""Hugging Face weights in and out: plait's model is the Hugging Face GPT-2
(``GPT2LMHeadModel``), LLaMA (``LlamaForCausalLM``: Llama 1 to 3.2), Qwen2 / Qwen2.5,
Qwen3 and Mistral architectures, so a model moves between them by renaming tensors (and,
for GPT-2, transposing its ``Conv1D`` weights and splitting the fused q/k/v projection).

    full = hf.to_hf(state, cfg)           # plait names -> Hugging Face names
    state = hf.from_hf(full, cfg)         # and back (exactly)
    hf.save(folder, state, cfg)           # config.json + model.safetensors (from_pretrained)
    hf.save_parts(folder, parts, cfg)     # ... or sharded, one part (a block) at a time
    cfg, state = hf.load(folder)          # a folder written by save_pretrained, or by save
    weights = hf.HFWeights(folder)        # ... each tensor read when asked for: weights[name]
    hf.load_into(model, weights, topo)    # a rank's parameters filled one at a time
    hf.defer_into(model, weights, topo)   # ... or, built on meta (ZeRO-3), when filled

The ``config.json``'s ``model_type`` picks plait's ``arch`` (gpt2, llama, qwen2, qwen3,
mistral); its fields map onto ``ModelConfig``'s: ``head_dim``, ``tie_word_embeddings``,
``rope_scaling`` / ``rope_parameters`` of ``rope_type`` llama3 (Llama 3.1 / 3.2),
Mistral's ``sliding_window``. Tensors are whole (unsharded, the unpadded vocabulary), as
``train.checkpoint`` stores them; ``load_into`` cuts them for a tensor-parallel or pipeline
rank. What does not map is refused in one line naming the field: another architecture,
biases plait's block does not have (LLaMA's ``attention_bias``, which includes o_proj), a
rotary scaling other than llama3, Qwen's sliding-window layers, GPT-2 options plait's
block does not have.

Name map (block i; gpt2 on the left of each pair is Hugging Face's):
    transformer.wte / wpe                  embed.tokens / embed.positions
    transformer.h.i.ln_1 / ln_2            blocks.i.ln1 / ln2
    transformer.h.i.attn.c_attn  (C, 3C)   blocks.i.attn.q | k | v  (transposed, split)
    transformer.h.i.attn.c_proj            blocks.i.attn.o          (transposed)
    transformer.h.i.mlp.c_fc / c_proj      blocks.i.mlp.fc / proj   (transposed)
    transformer.ln_f                       norm                     (lm_head tied to wte)
and for llama, qwen2, qwen3 and mistral alike:
    model.embed_tokens, model.norm, lm_head            embed.tokens, norm, head (absent
                                                       when tied)
    model.layers.i.input_layernorm / post_attention_layernorm    blocks.i.ln1 / ln2
    model.layers.i.self_attn.{q,k,v,o}_proj            blocks.i.attn.{q,k,v,o}
    model.layers.i.self_attn.{q,k,v}_proj.bias         blocks.i.attn.{q,k,v}.bias  (qwen2)
    model.layers.i.self_attn.{q,k}_norm                blocks.i.attn.{q,k}_norm    (qwen3)
    model.layers.i.mlp.{gate,up,down}_proj             blocks.i.mlp.{gate,up,down}

Mixtures of experts: ``MixtralForCausalLM`` (plait's llama, or mistral with a window, with
``moe_experts``) and ``Qwen3MoeForCausalLM`` (qwen3 with experts; ``decoder_sparse_step``
is ``moe_every``, its dense blocks keep ``intermediate_size``). Their published files hold
one tensor per expert; plait stacks them (E, ...). In an MoE block i:
    Mixtral: model.layers.i.block_sparse_moe.gate                blocks.i.mlp.router
             ...block_sparse_moe.experts.j.{w1,w3,w2}             blocks.i.mlp.experts.
                                                                 {w_gate,w_up,w_down}[j]
    Qwen3-MoE: model.layers.i.mlp.gate                           blocks.i.mlp.router
             ...mlp.experts.j.{gate,up,down}_proj                 the same stacks
Routing maps as it is: softmax scores, top-k, Mixtral's weights renormalised
(``moe_norm_topk``), Qwen3-MoE's as ``norm_topk_prob`` says; ``router_aux_loss_coef`` is
``moe_aux_loss_coef``. Shared experts, a sigmoid router, Qwen's ``mlp_only_layers`` and
MoE blocks of other families are refused in one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from plait.model.config import ModelConfig, RopeScaling

WEIGHTS = "model.safetensors"

# plait arch (= Hugging Face model_type) -> the class its config.json names
FAMILIES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


# Hugging Face model_type of a mixture of experts -> (plait arch, class)
MOE_FAMILIES = {"mixtral": ("llama", "MixtralForCausalLM"),
                "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM")}  # fmt: skip


class HFError(ValueError):
    """A Hugging Face folder or config plait cannot map (one line, names the file)."""


# -- configs --------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig) -> dict:
    """The ``config.json`` of the equivalent Hugging Face model."""
    if cfg.arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.hidden,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_hidden,
            "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "initializer_range": cfg.init_std, "tie_word_embeddings": True,
            "scale_attn_weights": True, "torch_dtype": "float32",
            "bos_token_id": None, "eos_token_id": None,  # plait's tokenizers have their own
        }  # fmt: skip
    # rope_theta and rope_scaling at the top level, as the published configs have them
    # (transformers 4 reads them there; 5 folds them into rope_parameters itself)
    out = {
        "architectures": [FAMILIES[cfg.arch]], "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.seq_len,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "attention_dropout": cfg.dropout, "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tied_embeddings, "torch_dtype": "float32",
    }  # fmt: skip
    if cfg.rope_scaling is not None:
        sc = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": sc.factor, "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_seq_len,
        }  # fmt: skip
    if cfg.arch in ("llama", "qwen3"):
        out["attention_bias"] = False
    if cfg.arch == "llama":
        out["mlp_bias"] = False
    if cfg.arch in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    if cfg.arch == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if cfg.moe:
        out.update(_moe_hf_config(cfg))
    return out


def moe_family(cfg: ModelConfig) -> str:
    """The Hugging Face model_type of an MoE config (``HFError``: none holds it)."""
    family = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}.get(cfg.arch)
    if family is None:
        raise HFError(f"a mixture of experts of --arch {cfg.arch} has no Hugging Face family "
                      "plait maps; use llama or mistral (Mixtral) or qwen3 (Qwen3-MoE)")  # fmt: skip
    why = None
    if cfg.moe_shared_experts:
        why = "--moe-shared-experts"
    elif cfg.moe_router != "softmax":
        why = "--moe-router sigmoid"
    elif family == "mixtral" and cfg.moe_every != 1:
        why = "--moe-every (Mixtral's blocks are all MoE)"
    elif family == "mixtral" and not cfg.moe_norm_topk:
        why = "--no-moe-norm-topk (Mixtral renormalises its top-k weights)"
    elif family == "mixtral" and cfg.moe_ffn_hidden != cfg.ffn_hidden:
        why = "--moe-ffn-hidden other than --ffn-hidden"
    if why:
        raise HFError(f"{why}: Hugging Face's {family} has no such option")
    return family


def _moe_hf_config(cfg: ModelConfig) -> dict:
    family = moe_family(cfg)
    out = {"architectures": [MOE_FAMILIES[family][1]], "model_type": family,
           "num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_aux_loss_coef,
           "output_router_logits": False}  # fmt: skip
    if family == "mixtral":
        out.update(num_local_experts=cfg.moe_experts, router_jitter_noise=0.0)
        out["sliding_window"] = cfg.sliding_window
        out.pop("mlp_bias", None)
    else:
        out.update(num_experts=cfg.moe_experts, moe_intermediate_size=cfg.moe_ffn_hidden,
                   decoder_sparse_step=cfg.moe_every, norm_topk_prob=cfg.moe_norm_topk,
                   mlp_only_layers=[])  # fmt: skip
    return out


def model_config(d: dict, *, source: str = "config.json") -> ModelConfig:
    """plait's ``ModelConfig`` for a Hugging Face ``config.json``; ``HFError`` (one line
    naming the field) for what plait cannot represent."""
    kind = d.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt2_config(d, source)
        if kind in FAMILIES:
            return _rotary_config(d, kind, source)
        if kind in MOE_FAMILIES:
            return _moe_config(d, kind, source)
    except KeyError as e:
        raise HFError(f"{source}: no {e.args[0]!r}") from None
    except HFError:
        raise
    except (ValueError, TypeError) as e:  # ModelConfig's own checks, in its words
        raise HFError(f"{source}: {str(e).splitlines()[0]}") from None
    raise HFError(f"{source}: model_type {kind!r}; plait maps "
                  f"{', '.join([*FAMILIES, *MOE_FAMILIES])}")  # fmt: skip


def _gpt2_config(d: dict, source: str) -> ModelConfig:
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFError(f"{source}: activation_function {act!r}; plait's GPT-2 uses "
                      "tanh GELU (gelu_new)")  # fmt: skip
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if d.get(key):
            raise HFError(f"{source}: {key} is not supported by plait's GPT-2 block")
    return ModelConfig(
        arch="gpt2", n_layers=d["n_layer"], hidden=d["n_embd"], n_heads=d["n_head"],
        ffn_hidden=d.get("n_inner") or 4 * d["n_embd"], vocab_size=d["vocab_size"],
        seq_len=d["n_positions"], norm_eps=d.get("layer_norm_epsilon", 1e-5),
        dropout=d.get("resid_pdrop", 0.0), init_std=d.get("initializer_range", 0.02),
    )  # fmt: skip


def _rotary_config(d: dict, kind: str, source: str) -> ModelConfig:
    """llama, qwen2, qwen3, mistral: one block, told apart by ``arch`` (model/config.py)."""
    refuse = {  # field -> why, when the config sets it (truthy)
        "attention_bias": "biases on q, k, v and o",
        "mlp_bias": "biases in the MLP",
        "use_sliding_window": "sliding-window layers (plait's window is mistral's, on all layers)",
    }
    if kind == "qwen2":
        refuse.pop("attention_bias")  # Qwen2 has q/k/v biases whatever this says
    for key, what in refuse.items():
        if d.get(key):
            raise HFError(f"{source}: {key} {d[key]!r}: plait's {kind} block has no {what}")
    if d.get("pretraining_tp", 1) != 1:
        raise HFError(f"{source}: pretraining_tp {d['pretraining_tp']} is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise HFError(f"{source}: hidden_act {d['hidden_act']!r}; plait's {kind} uses silu")
    kinds = set(d.get("layer_types") or ["full_attention"])
    if kind != "mistral" and kinds != {"full_attention"}:
        raise HFError(f"{source}: layer_types {sorted(kinds)}; plait attends fully on every layer")
    heads = d["num_attention_heads"]
    window = d.get("sliding_window") if kind == "mistral" else None
    return ModelConfig(
        arch=kind, n_layers=d["num_hidden_layers"], hidden=d["hidden_size"], n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim"),
        ffn_hidden=d["intermediate_size"], vocab_size=d["vocab_size"],
        seq_len=d["max_position_embeddings"], norm_eps=d.get("rms_norm_eps", 1e-6),
        **_rope(d, source), sliding_window=window,
        tied_embeddings=bool(d.get("tie_word_embeddings", False)),
        dropout=d.get("attention_dropout", 0.0), init_std=d.get("initializer_range", 0.02),
    )  # fmt: skip


def _moe_config(d: dict, kind: str, source: str) -> ModelConfig:
    """Mixtral (llama, or mistral when it has a window) and Qwen3-MoE (qwen3 + experts)."""
    arch = MOE_FAMILIES[kind][0]
    if kind == "mixtral" and d.get("sliding_window"):
        arch = "mistral"
    base = _rotary_config({**d, "model_type": arch}, arch, source)
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise HFError(f"{source}: no 'num_experts' / 'num_local_experts'")
    if d.get("mlp_only_layers"):
        raise HFError(f"{source}: mlp_only_layers {d['mlp_only_layers']}: plait's dense "
                      "blocks are every block but each decoder_sparse_step-th")  # fmt: skip
    moe = dict(moe_experts=experts, moe_top_k=d["num_experts_per_tok"],
               moe_aux_loss_coef=d.get("router_aux_loss_coef", 0.01))  # fmt: skip
    if kind == "qwen3_moe":
        moe.update(moe_ffn_hidden=d["moe_intermediate_size"], moe_every=d.get("decoder_sparse_step", 1),
                   moe_norm_topk=bool(d.get("norm_topk_prob", False)))  # fmt: skip
    return base.replace(**moe)


def _rope(d: dict, source: str) -> dict:
    """``rope_theta`` and ``rope_scaling`` from a config of transformers 4 (top-level
    ``rope_theta``, ``rope_scaling``) or 5 (``rope_parameters``); only the default
    rotation and Llama 3.1's llama3 scaling are plait's."""
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError(f"{source}: partial_rotary_factor is not supported; plait rotates the "
                      "whole head")  # fmt: skip
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise HFError(f"{source}: rope_scaling / rope_type {kind!r} is not supported; plait "
                      "has plain rotary positions and Llama 3.1's llama3 scaling")  # fmt: skip
    try:
        scaling = RopeScaling(
            factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_seq_len=rope["original_max_position_embeddings"],
        )  # fmt: skip
    except KeyError as e:
        raise HFError(f"{source}: rope_scaling of rope_type 'llama3' lacks {e.args[0]!r}") from None
    return {"rope_theta": theta, "rope_scaling": scaling}


# -- tensors -------------------------------------------------------------------------------

_LLAMA = {  # plait suffix in block i -> Hugging Face suffix in layer i
    "ln1.weight": "input_layernorm.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {f"attn.{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_QK_NORM = {f"attn.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
_GPT2 = {  # transposed Conv1D weights, plain biases and norms
    "ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias",
    "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
    "attn.o.weight": "attn.c_proj.weight", "attn.o.bias": "attn.c_proj.bias",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias",
}  # fmt: skip


def _block_names(cfg: ModelConfig) -> dict[str, str]:
    """plait suffix -> Hugging Face suffix of every tensor of a rotary block."""
    return {**_LLAMA, **(_QKV_BIAS if cfg.qkv_bias else {}), **(_QK_NORM if cfg.qk_norm else {})}


_EXPERTS = {  # model_type -> (block prefix, router, {plait stack: per-expert name})
    "mixtral": ("block_sparse_moe.", "gate.weight",
                {"w_gate": "w1.weight", "w_up": "w3.weight", "w_down": "w2.weight"}),
    "qwen3_moe": ("mlp.", "gate.weight", {"w_gate": "gate_proj.weight",
                                          "w_up": "up_proj.weight", "w_down": "down_proj.weight"}),
}  # fmt: skip


def _moe_to_hf(i: str, ours: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of one plait tensor of MoE block ``i`` (a stack: E of them)."""
    prefix, router, stacks = _EXPERTS[moe_family(cfg)]
    base = f"model.layers.{i}.{prefix}"
    if ours == "mlp.router.weight":
        return {base + router: t}
    stack = ours.removeprefix("mlp.experts.")
    if stack not in stacks:
        raise HFError(f"blocks.{i}.{ours}: no Hugging Face {cfg.arch} tensor holds it")
    return {f"{base}experts.{j}.{stacks[stack]}": t[j] for j in range(t.shape[0])}


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for plait's full state dict (every name of the whole model);
    a tied model's ``lm_head`` is the token embedding, as ``save_pretrained`` has it."""
    _check_names(state, cfg)
    out = to_hf_part(state, cfg)
    if cfg.rotary and cfg.tied_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def to_hf_part(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for any part of plait's state dict that holds whole blocks (a
    block's q, k and v together: GPT-2 fuses them): ``export_groups``' parts, or all of it.
    A tied model's ``lm_head`` is left out (``save`` stores it once, as the embedding)."""
    out = {}
    if cfg.moe:
        moe_family(cfg)  # one line for what no Hugging Face family holds
    if cfg.rotary:
        top = {"embed.tokens.weight": "model.embed_tokens.weight",
               "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}  # fmt: skip
        block = _block_names(cfg)
    else:
        top = {"embed.tokens.weight": "transformer.wte.weight",
               "embed.positions.weight": "transformer.wpe.weight",
               "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}  # fmt: skip
        block = _GPT2
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
        elif name.startswith("blocks."):
            i, _, ours = name.removeprefix("blocks.").partition(".")
            if cfg.rotary and cfg.is_moe_layer(int(i)) and ours.startswith("mlp."):
                out.update(_moe_to_hf(i, ours, t, cfg))
            elif cfg.rotary and ours in block:
                out[f"model.layers.{i}.{block[ours]}"] = t
            elif cfg.rotary:
                raise HFError(f"{name}: no Hugging Face {cfg.arch} tensor holds it")
            elif ours in block:
                out[f"transformer.h.{i}.{block[ours]}"] = t.t() if t.dim() == 2 else t
            elif ours in ("attn.q.weight", "attn.q.bias"):  # q, k, v fused: at q's turn
                kind, b = ours.rpartition(".")[2], f"blocks.{i}."
                qkv = torch.cat([state[f"{b}attn.{x}.{kind}"] for x in "qkv"], dim=0)
                out[f"transformer.h.{i}.attn.c_attn.{kind}"] = qkv.t() if kind == "weight" else qkv
            elif ours not in ("attn.k.weight", "attn.k.bias", "attn.v.weight", "attn.v.bias"):
                raise HFError(f"{name}: no Hugging Face {cfg.arch} tensor holds it")
        else:
            raise HFError(f"{name}: no Hugging Face {cfg.arch} tensor holds it")
    return {k: v.contiguous() for k, v in out.items()}


def _one(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _conv1d(ts: list[torch.Tensor]) -> torch.Tensor:  # GPT-2's (in, out) Conv1D weights
    return ts[0].t() if ts[0].dim() == 2 else ts[0]


def _qkv(j: int, ts: list[torch.Tensor]) -> torch.Tensor:  # q, k or v of GPT-2's fused c_attn
    t = ts[0]
    return (t.t() if t.dim() == 2 else t).chunk(3, dim=0)[j]


def _recipes(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], object]]:
    """plait name -> (the Hugging Face tensors it is made of, how: a function of their
    list) for every tensor of the whole model: the name map above, one plait tensor at a
    time (``from_hf`` makes them all, ``HFWeights`` each when asked). The ``lm_head`` of a
    tied model and rotary / attention buffers are not read."""
    out: dict[str, tuple[tuple[str, ...], object]] = {}
    if cfg.rotary:
        out["embed.tokens.weight"] = (("model.embed_tokens.weight",), _one)
        out["norm.weight"] = (("model.norm.weight",), _one)
        if not cfg.tied_embeddings:
            out["head.weight"] = (("lm_head.weight",), _one)
        for i in range(cfg.n_layers):
            moe_block = cfg.is_moe_layer(i)
            for ours, theirs in _block_names(cfg).items():
                if not (moe_block and ours.startswith("mlp.")):
                    out[f"blocks.{i}.{ours}"] = ((f"model.layers.{i}.{theirs}",), _one)
            if moe_block:  # one tensor per expert, stacked (E, ...)
                prefix, router, stacks = _EXPERTS[moe_family(cfg)]
                base = f"model.layers.{i}.{prefix}"
                out[f"blocks.{i}.mlp.router.weight"] = ((base + router,), _one)
                for stack, theirs in stacks.items():
                    names = tuple(f"{base}experts.{j}.{theirs}" for j in range(cfg.moe_experts))
                    out[f"blocks.{i}.mlp.experts.{stack}"] = (names, torch.stack)
        return out
    out["embed.tokens.weight"] = (("transformer.wte.weight",), _one)
    out["embed.positions.weight"] = (("transformer.wpe.weight",), _one)
    out["norm.weight"] = (("transformer.ln_f.weight",), _one)
    out["norm.bias"] = (("transformer.ln_f.bias",), _one)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in _GPT2.items():
            out[b + ours] = ((h + theirs,), _conv1d)
        for j, x in enumerate("qkv"):
            for kind in ("weight", "bias"):
                out[f"{b}attn.{x}.{kind}"] = (
                    (f"{h}attn.c_attn.{kind}",),
                    functools.partial(_qkv, j),
                )
    return out


def _check_present(recipes: dict, have) -> None:
    """One line for the first Hugging Face tensor a recipe needs that ``have`` lacks."""
    for theirs, _ in recipes.values():
        missing = next((n for n in theirs if n not in have), None)
        if missing is not None:
            raise HFError(f"the Hugging Face weights lack {missing!r}")


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """plait's full state dict for Hugging Face tensors (the ``lm_head`` of a tied model
    and rotary/attention buffers are ignored)."""
    recipes = _recipes(cfg)
    _check_present(recipes, hf)
    out = {name: make([hf[n] for n in theirs]).contiguous()
           for name, (theirs, make) in recipes.items()}  # fmt: skip
    _check_names(out, cfg)
    return out


def _check_names(state: dict, cfg: ModelConfig) -> None:
    """The names and shapes of plait's whole model for ``cfg`` (built on the meta device)."""
    from plait.model.transformer import build_model
    from plait.topology import Topology

    want = {n: tuple(p.shape) for n, p in build_model(cfg, topo=Topology.single(),
                                                       device="meta").named_parameters()}  # fmt: skip
    missing = sorted(set(want) - set(state))
    if missing:
        raise HFError(f"weights lack {missing[0]!r} of the {cfg.arch} model")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise HFError(f"{name}: shape {tuple(state[name].shape)}, the model needs {shape}")


# -- folders -------------------------------------------------------------------------------


def save(folder: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (what ``from_pretrained`` reads)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_hf({k: v.detach().cpu() for k, v in state.items()}, cfg)
    if cfg.tied_embeddings:  # stored once, tied again on load
        tensors.pop("lm_head.weight", None)
    tmp = folder / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / WEIGHTS)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return folder


def export_groups(names: list[str]) -> list[list[str]]:
    """plait's parameter names in the parts ``save_parts`` writes one at a time: the
    embedding, each block, then the rest (final norm, head)."""
    embed = [n for n in names if n.startswith("embed.")]
    blocks: dict[int, list[str]] = {}
    for n in names:
        if n.startswith("blocks."):
            blocks.setdefault(int(n.split(".")[1]), []).append(n)
    rest = [n for n in names if not n.startswith(("embed.", "blocks."))]
    return [g for g in (embed, *(blocks[i] for i in sorted(blocks)), rest) if g]


def save_parts(folder: str | Path, parts, cfg: ModelConfig) -> Path:
    """Write ``config.json`` and the weights as Hugging Face's sharded safetensors
    (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, what
    ``from_pretrained`` reads), one file per part: ``parts`` yields plait state dicts
    (``export_groups``' parts), each converted, written and dropped before the next, so
    that one part is in memory at a time."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("model*.safetensors*"):  # a previous export's files
        old.unlink()
    written, weight_map, total = [], {}, 0
    for i, state in enumerate(parts):
        tensors = to_hf_part({k: v.detach().cpu() for k, v in state.items()}, cfg)
        name = f"model-{i + 1:05d}.safetensors"  # renamed once the count is known
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        written.append((name, list(tensors)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors, state
    n = len(written)
    for i, (name, keys) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (folder / name).replace(folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return folder


def save_tokenizer(folder: str | Path, tokenizer, cfg: ModelConfig, chat_template=None) -> bool:
    """Write a ``tokenizers`` tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``
    (``AutoTokenizer.from_pretrained`` and ``plait train --tokenizer FOLDER`` read it),
    with ``chat_template`` (the one the run's conversations were rendered with) if given.
    False for plait's byte tokenizer, which has no such file (its ids are UTF-8 bytes)."""
    from plait.data.tokenizer import HFTokenizer

    if not isinstance(tokenizer, HFTokenizer):
        return False
    folder = Path(folder)
    tokenizer.save(folder / "tokenizer.json")
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len}
    if tokenizer.eot_id is not None:
        conf["eos_token"] = tokenizer.decode([tokenizer.eot_id])
    if chat_template is not None:
        conf["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return True


def read_config(folder: str | Path) -> ModelConfig:
    """plait's ``ModelConfig`` of a Hugging Face model folder (its ``config.json``)."""
    folder = Path(folder)
    conf = folder / "config.json"
    if not conf.is_file():
        raise HFError(f"--init-hf {folder}: no config.json there (a Hugging Face model folder)")
    try:
        return model_config(json.loads(conf.read_text()), source=str(conf))
    except json.JSONDecodeError as e:
        raise HFError(f"{conf}: not valid JSON ({e})") from None


class HFWeights:
    """plait's whole tensors of a Hugging Face model folder, each read from its safetensors
    files only when asked for (``weights[name]``, fp32): a rank that fills its parameters
    one at a time (``load_into``, or ZeRO-3's ``defer_into``) never holds more than one of
    them beside its own share -- reading them all first held the whole model in fp32 on
    every rank (280 GB at 70B). Names and shapes are checked when it opens, from the
    files' headers, without reading a weight."""

    def __init__(self, folder: str | Path):
        from safetensors import SafetensorError, safe_open

        folder = Path(folder)
        self.cfg = read_config(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise HFError(f"--init-hf {folder}: no .safetensors weights there")
        self._file: dict[str, object] = {}  # Hugging Face name -> its open file
        self._shape: dict[str, tuple[int, ...]] = {}  # ... and its shape, from the header
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise HFError(f"--init-hf {f}: not a readable safetensors file ({e})") from None
            for key in handle.keys():
                self._file[key] = handle
                self._shape[key] = tuple(handle.get_slice(key).get_shape())
        self._recipes = _recipes(self.cfg)
        _check_present(self._recipes, self._file)
        # each recipe run on storage-less tensors of the headers' shapes
        shapes = {name: make([torch.empty(self._shape[n], device="meta") for n in theirs])
                  for name, (theirs, make) in self._recipes.items()}  # fmt: skip
        _check_names(shapes, self.cfg)

    def keys(self):
        return self._recipes.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._recipes

    def __getitem__(self, name: str) -> torch.Tensor:
        theirs, make = self._recipes[name]
        if _faking():  # ``plait rehearse``: sizes, not values (on the host, as a file's) -- no read
            return make([torch.empty(self._shape[n], device="cpu") for n in theirs]).contiguous()
        return make([self._file[n].get_tensor(n).float() for n in theirs]).contiguous()


def _faking() -> bool:
    """Whether a ``FakeTensorMode`` is active (a rehearsal: tensors of shapes and dtypes,
    no storage), where a tensor read from a file could not enter."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def load(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, plait's full state dict) from a Hugging Face model folder: ``config.json``
    and ``model.safetensors`` or its shards (``model-0000x-of-0000y.safetensors``). The
    whole model at once: a trainer reads ``HFWeights`` instead."""
    weights = HFWeights(folder)
    return weights.cfg, {name: weights[name] for name in weights.keys()}


def _rank_value(state, name: str, p: torch.Tensor, topo) -> torch.Tensor:
    """This rank's part of ``state[name]`` as parameter ``p`` holds it, in ``p``'s dtype."""
    from plait.model.transformer import rank_part, whole_shape

    if name not in state:
        raise HFError(f"weights lack {name!r}")
    full = state[name]
    if tuple(full.shape) != whole_shape(p, topo.tp):
        raise HFError(f"{name}: shape {tuple(full.shape)} does not fit this model")
    return rank_part(full.to(p.dtype), p, topo)


def load_into(model: torch.nn.Module, state, topo) -> None:
    """Copy whole tensors (a dict, or ``HFWeights`` read one at a time) into ``model``'s
    parameters, cut for this rank (tp shard, an ep rank's experts; a pipeline rank takes
    the names it holds)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_rank_value(state, name, p, topo))


def defer_into(model: torch.nn.Module, state, topo) -> None:
    """``load_into`` for a model built on meta (ZeRO-3): each parameter's ``init_value()``
    reads and cuts its tensor when the engine fills that parameter's shard, one at a time
    (``zero_units.initial_value``), so neither the model nor the file is held whole."""
    for name, p in model.named_parameters():
        if name not in state:
            raise HFError(f"weights lack {name!r}")
        p.init_value = functools.partial(_rank_value, state, name, p, topo)
