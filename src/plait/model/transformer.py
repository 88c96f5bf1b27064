"""The decoder-only transformer, written once from tensor-parallel-aware layers.

Shape letters: B batch (sequences in a micro-batch), T tokens per sequence, C hidden size,
H attention heads (on this tp rank), K key/value heads (on this tp rank), D head size,
V vocabulary (on this tp rank), F FFN width (on this tp rank).

A ``Transformer`` may hold the whole model or one pipeline chunk of it: ``layers`` names the
global block indices it owns, ``pre`` adds the embedding and ``post`` the final norm, head
and loss. Parameter names carry global block indices (``blocks.7.attn.q.weight``) so every
layout names -- and therefore initialises -- every weight identically.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.model.config import ModelConfig
from plait.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    copy_to_tp,
    full_shape,
    shard_spec,
    tp_shard,
    vocab_parallel_cross_entropy,
)
from plait.topology import Topology


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt2":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


def rotary_tables(cfg: ModelConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) -- the Hugging Face LLaMA convention."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, D/2) each
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, topo: Topology, selective_recompute: bool):
        super().__init__()
        tp = topo.tp
        self.cfg, self.selective_recompute = cfg, selective_recompute
        self.n_heads = cfg.n_heads // tp
        # Fewer key/value heads than tp ranks: each kv head is replicated on tp/K ranks.
        kv_replicas = max(1, tp // cfg.n_kv_heads)
        self.n_kv_heads = max(1, cfg.n_kv_heads // tp)
        kv_spec = ShardSpec(dim=0, replicas=kv_replicas)
        bias = cfg.biases
        self.q = ColumnParallelLinear(cfg.hidden, cfg.hidden, topo=topo, bias=bias)
        self.k = ColumnParallelLinear(cfg.hidden, cfg.kv_dim, topo=topo, bias=bias, spec=kv_spec)
        self.v = ColumnParallelLinear(cfg.hidden, cfg.kv_dim, topo=topo, bias=bias, spec=kv_spec)
        self.o = RowParallelLinear(cfg.hidden, cfg.hidden, topo=topo, bias=bias)

    def _core(self, q, k, v):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.cfg.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )

    def forward(self, x, rope=None):  # (B, T, C) -> (B, T, C)
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q = self.q(x).view(B, T, self.n_heads, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(B, T, self.n_kv_heads, D).transpose(1, 2)  # (B, K, T, D)
        v = self.v(x).view(B, T, self.n_kv_heads, D).transpose(1, 2)  # (B, K, T, D)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.selective_recompute and self.training:
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * D)  # (B, T, C/tp)
        return self.o(y)


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama); first GEMM(s) column-split, last row-split."""

    def __init__(self, cfg: ModelConfig, *, topo: Topology):
        super().__init__()
        self.arch = cfg.arch
        h, f = cfg.hidden, cfg.ffn_hidden
        if cfg.arch == "gpt2":
            self.fc = ColumnParallelLinear(h, f, topo=topo, bias=True)
            self.proj = RowParallelLinear(f, h, topo=topo, bias=True)
        else:
            self.gate = ColumnParallelLinear(h, f, topo=topo, bias=False)
            self.up = ColumnParallelLinear(h, f, topo=topo, bias=False)
            self.down = RowParallelLinear(f, h, topo=topo, bias=False)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        if self.arch == "gpt2":
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, topo: Topology, recompute: str):
        super().__init__()
        self.recompute_full = recompute == "full"
        self.ln1 = make_norm(cfg)
        self.attn = Attention(cfg, topo=topo, selective_recompute=recompute == "selective")
        self.ln2 = make_norm(cfg)
        self.mlp = MLP(cfg, topo=topo)
        self.drop = nn.Dropout(cfg.dropout)

    def _forward(self, x, rope):
        x = x + self.drop(self.attn(self.ln1(x), rope))
        return x + self.drop(self.mlp(self.ln2(x)))

    def forward(self, x, rope=None):
        if self.recompute_full and self.training:
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, *, topo: Topology, positions: bool):
        super().__init__()
        self.tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, topo=topo)
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden) if positions else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, ids):  # (B, T) -> (B, T, C)
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return self.drop(x)


class Transformer(nn.Module):
    """The whole model, or the pipeline chunk ``layers`` of it (see module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        topo: Topology | None = None,
        layers: Sequence[int] | None = None,
        pre: bool = True,
        post: bool = True,
        recompute: str = "none",
    ):
        super().__init__()
        topo = topo or Topology.single()
        self.cfg, self.topo, self.pre, self.post = cfg, topo, pre, post
        layers = range(cfg.n_layers) if layers is None else layers
        if pre or (post and cfg.tied_embeddings):
            # The last pipeline stage of a tied model keeps its own copy of the token
            # embedding under the same name; the pipeline keeps the copies in sync.
            self.embed = Embedding(cfg, topo=topo, positions=pre and cfg.arch == "gpt2")
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg, topo=topo, recompute=recompute) for i in layers}
        )
        if post:
            self.norm = make_norm(cfg)
            if not cfg.tied_embeddings:
                self.head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, topo=topo, bias=False)
        self._rope_cache: dict = {}

    def _rope(self, T: int, device):
        if self.cfg.arch != "llama":
            return None
        key = (T, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rotary_tables(self.cfg, T, device)
        return self._rope_cache[key]

    def logits(self, x):  # (B, T, C) -> (B, T, V/tp)
        x = self.norm(x)
        weight = self.embed.tokens.weight if self.cfg.tied_embeddings else self.head.weight
        return F.linear(copy_to_tp(x, self.topo), weight)

    def forward(self, x, targets=None):
        """ids (B, T) if ``pre`` else hidden (B, T, C). Returns hidden (B, T, C) unless
        ``post``; then the per-token loss (B*T,) if targets are given, else the logits."""
        if self.pre:
            if x.shape[1] > self.cfg.seq_len:
                raise ValueError(
                    f"sequence of {x.shape[1]} tokens is longer than the model's "
                    f"--seq-len {self.cfg.seq_len}"
                )
            x = self.embed(x)
        rope = self._rope(x.shape[1], x.device)
        for block in self.blocks.values():
            x = block(x, rope)
        if not self.post:
            return x
        logits = self.logits(x)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), topo=self.topo)


# --- deterministic initialisation ---------------------------------------------------------


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: depends only on
    (seed, config, name), never on the layout.

    GPT-2 scheme: normal(0, init_std) for weights, residual output projections scaled by
    1/sqrt(2 * layers), zero biases, unit norm weights.
    """
    leaf = name.rsplit(".", 2)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(leaf) >= 2 and leaf[-2] in ("ln1", "ln2", "norm"):
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("attn.o.weight", "mlp.proj.weight", "mlp.down.weight")):
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    g = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.randn(shape, generator=g) * std


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    topo = model.topo
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        full = init_value(model.cfg, name, full_shape(p.shape, spec, topo.tp), seed)
        p.copy_(tp_shard(full, spec, tp_rank=topo.tp_rank, tp=topo.tp))


def build_model(
    cfg: ModelConfig,
    *,
    seed: int = 0,
    topo: Topology | None = None,
    layers: Sequence[int] | None = None,
    pre: bool = True,
    post: bool = True,
    recompute: str = "none",
    device: str | torch.device = "cpu",
) -> Transformer:
    """Build (a chunk of) the model with its deterministic initial weights. On the ``meta``
    device nothing is allocated or initialised: for sizes and memory of large presets."""
    with torch.device(device):
        model = Transformer(cfg, topo=topo, layers=layers, pre=pre, post=post, recompute=recompute)
    if str(device) != "meta":
        init_weights(model, seed)
    return model
