"""The decoder-only transformer, written once from tensor-parallel-aware layers.

Shape letters: B batch (sequences in a micro-batch), T tokens per sequence, C hidden size,
H attention heads (on this tp rank), K key/value heads (on this tp rank), D head size,
V vocabulary (on this tp rank), F FFN width (on this tp rank).

A ``Transformer`` may hold the whole model or one pipeline chunk of it: ``layers`` names the
global block indices it owns, ``pre`` adds the embedding and ``post`` the final norm, head
and loss. Parameter names carry global block indices (``blocks.7.attn.q.weight``) so every
layout names -- and therefore initialises -- every weight identically.

Context parallelism (``topo.cp`` > 1): the model sees this cp rank's shard of every sequence
(its two head-tail chunks, ``parallel/context.py``), T = s / cp tokens. Positions (learned
or rotary) are the global positions of those tokens, and attention runs over the whole
sequence through the cp ring (``context_attention``); everything else is per token and
unchanged. Document masking: ``forward``'s ``documents`` (B, s), the document id of every
token of the whole sequences, restricts attention to a token's own document.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.layout import check_tp_split
from plait.model.config import ModelConfig
from plait.model.kernels import rehearsing_gpu, rehearsing_gpu_kernels  # noqa: F401 (re-export)
from plait.model.moe import MoE
from plait.model.ops import SwiGLU as _SwiGLU
from plait.parallel.context import ContextLayout, context_attention, shard
from plait.parallel.flat import resize_storage
from plait.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TPDropout,
    VocabParallelEmbedding,
    column_linears,
    compute_input,
    enter_tp,
    full_shape,
    keeping_shard,
    mark_sequence_parallel,
    mark_tp_partial,
    sequence_shard,
    shard_spec,
    tp_shard,
    tp_shard_rng,
    vocab_linear,
    vocab_parallel_cross_entropy,
    vocab_spec,
)
from plait.topology import Axis, Topology

_FUSED_RMS = hasattr(torch.ops.aten, "_fused_rms_norm_backward")  # torch >= 2.8


def _fused_rms(x: torch.Tensor) -> bool:
    """PyTorch's RMSNorm kernels serve ``x``: its backward has a CUDA kernel only, and a
    meta one, which a rehearsal's fake tensors run (``rehearsing_gpu_kernels``);
    elsewhere the few operations below."""
    return _FUSED_RMS and (x.device.type == "cuda" or rehearsing_gpu())


class _LowPrecisionNorm(torch.autograd.Function):
    """LayerNorm (``bias`` not None) or RMSNorm of a bf16 / fp16 ``x`` (N..., C) as
    Megatron's fused norms run it: the statistics and the affine map in fp32, the output
    in ``x``'s dtype, and for the backward only ``x`` itself, the fp32 per-token mean and
    1/std (N..., 1), and the weights -- no fp32 copy of the activation (what autocast's
    fp32 ``layer_norm`` and the unfused RMSNorm keep, 2 extra bytes per element).

    Both directions run PyTorch's own norm kernels (``native_layer_norm``,
    ``_fused_rms_norm`` on CUDA, and their backwards) on an fp32 copy of ``x``, made here
    and dropped on return: a handful of operations each way rather than the twenty a
    composite spelled them in -- on a GPU every operation is a launch the host pays for
    (``benchmarks/single_gpu.py``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        xf, shape = x.float(), [x.shape[-1]]
        mean = None
        if bias is not None:
            out, mean, rstd = torch.native_layer_norm(xf, shape, weight, bias, eps)
        elif _fused_rms(x) and rehearsing_gpu():
            # CUDA's kernel makes its two outputs and nothing else; on fake tensors the op
            # decomposes into its composite, which would hold x * rstd as well
            out, rstd = torch.empty_like(xf), xf.new_empty((*x.shape[:-1], 1))
        elif _fused_rms(x):
            out, rstd = torch.ops.aten._fused_rms_norm(xf, shape, weight, eps)
        else:
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
            out = (xf.mul(rstd) if xf is x else xf.mul_(rstd)).mul_(weight)  # x: fp32
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        xf, g, shape = x.float(), grad.float(), [x.shape[-1]]
        want_w = ctx.needs_input_grad[1]
        dbias = None
        if bias is not None:
            mask = [True, want_w, ctx.needs_input_grad[2]]
            dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
                g, xf, shape, mean, rstd, weight, bias, mask
            )
        elif _fused_rms(x):
            dx, dweight = torch.ops.aten._fused_rms_norm_backward(
                g, xf, shape, rstd, weight, [True, want_w]
            )
        else:
            xhat = xf * rstd
            gw = g * weight
            dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd
            rows = tuple(range(g.dim() - 1))
            dweight = (g * xhat).sum(rows) if want_w else None
        dweight = dweight.to(weight.dtype) if want_w else None
        dbias = dbias.to(bias.dtype) if dbias is not None else None
        return dx.to(x.dtype), dweight, dbias, None


def _low_precision(x: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16)


class RMSNorm(nn.Module):
    """RMSNorm in fp32 whatever the input's dtype; the output has the input's. It keeps
    only its input and the per-token 1/rms for the backward (``_LowPrecisionNorm``): a
    bf16 / fp16 input (the residual stream under ``--dtype bf16|fp16``, or a head's
    queries and keys) no fp32 copy, an fp32 one no normalised copy."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        # an fp32 input too (``--fp32-residual``, ``--dtype fp32``): autograd's composite
        # kept the normalised x (fp32, h a token) beside x itself -- two more bytes per
        # element a norm than the model's count (``sizes.activation_bytes_per_layer``)
        return _LowPrecisionNorm.apply(x, self.weight, None, self.eps)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same fp32 result) that takes a bf16 / fp16 input
    as Megatron's fused LayerNorm does: statistics in fp32, output in the input's dtype,
    no fp32 copy of the input kept (``_LowPrecisionNorm``), where autocast would run
    ``layer_norm`` in fp32 on an fp32 copy and return fp32."""

    def forward(self, x):
        if _low_precision(x):
            return _LowPrecisionNorm.apply(x, self.weight, self.bias, self.eps)
        return super().forward(x)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt2":
        return LayerNorm(cfg.hidden, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden, cfg.norm_eps)


def rotary_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """The D/2 rotary frequencies theta^(-2i/D); under ``rope_scaling`` (Llama 3.1) the long
    wavelengths are divided by its factor and the band between its two cut-offs is
    interpolated smoothly (``RopeScaling``)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_cut = sc.original_seq_len / sc.low_freq_factor  # longer wavelengths: divided
    high_cut = sc.original_seq_len / sc.high_freq_factor  # shorter ones: kept
    smooth = (sc.original_seq_len / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    scaled = torch.where(wavelen > low_cut, inv_freq / sc.factor, inv_freq)
    between = (wavelen >= high_cut) & (wavelen <= low_cut)
    return torch.where(between, (1 - smooth) * scaled / sc.factor + smooth * scaled, scaled)


def rotary_tables(cfg: ModelConfig, seq_len: int, device,
                  positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos and sin (T, D/2) of positions 0 .. seq_len - 1, or of ``positions`` (T,)."""
    inv_freq = rotary_frequencies(cfg, device)
    pos = torch.arange(seq_len, device=device) if positions is None else positions
    angles = torch.outer(pos.float(), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) True where a query may attend to a key: causal and in its document."""
    T = documents.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 seq_dim: int = -2) -> torch.Tensor:  # fmt: skip
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) -- the Hugging Face LLaMA convention. ``x``
    is (..., T, D), or (B, T, H, D) with ``seq_dim`` 1; the result is contiguous in that
    order, in ``x``'s dtype, computed in the wider of it and the tables' (fp32): fp32 under
    bf16, fp16 and fp32, float64 for a float64 ``x``."""
    T = x.shape[seq_dim]
    cos, sin = cos[:T], sin[:T]
    if seq_dim == 1:  # (T, 1, D/2): every head alike
        cos, sin = cos[:, None], sin[:, None]
    if torch.compiler.is_compiling():  # inductor fuses the composite into one kernel a way;
        # ``_Rotary``'s writes into halves of its output would break the block's graph
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return _Rotary.apply(x, cos, sin)


class _Rotary(torch.autograd.Function):
    """The rotation by the positions' angles, and its backward the rotation back: the
    gradient of y = R x is R^T g. Each half of the output is two kernels that read ``x`` in
    its own dtype and compute in fp32 -- x1 cos, then that minus x2 sin written straight
    into the output (``addcmul``) -- where autograd's composite cast x to fp32, multiplied
    the halves four times, added them, concatenated and cast back, and its backward did as
    much again: 14 bytes a rotary element each way under bf16 instead of 48 and 52
    (``tests/test_stream_bytes.py``). Saves only the tables."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """(x1 cos - s x2 sin, x2 cos + s x1 sin), s = ``sign``, contiguous in ``x``'s dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.addcmul(torch.mul(x1, cos), x2, sin, value=-sign, out=o1)
    torch.addcmul(torch.mul(x2, cos), x1, sin, value=sign, out=o2)
    return out


def sliding_window_attention(q, k, v, window: int, **sdpa) -> torch.Tensor:
    """Causal attention in which the query at position p sees keys p - window + 1 .. p
    (Mistral's sliding window, Hugging Face's convention), without a T x T mask.

    The queries are cut into chunks of ``window``. The first chunk is plain causal
    attention; every later chunk c attends to key chunks c - 1 and c, the only ones in
    reach, under one (window, 2 window) band mask that all chunks, sequences and heads
    share. Work and memory are O(T window), not O(T^2): at a 4k window the mask is 32 MiB
    whatever T, where a full one is 1 GiB at T = 32k. ``sdpa``: keywords of
    ``F.scaled_dot_product_attention`` (dropout_p, enable_gqa).
    """
    B, H, T, D = q.shape
    w = window
    C = -(-T // w)  # chunks
    pad = C * w - T  # padded queries are dropped; padded keys lie in every real query's future
    first = F.scaled_dot_product_attention(q[:, :, :w], k[:, :, :w], v[:, :, :w],
                                           is_causal=True, **sdpa)  # fmt: skip
    q = F.pad(q[:, :, w:], (0, 0, 0, pad)).view(B, H, C - 1, w, D).transpose(1, 2)
    # key chunks c - 1 and c side by side for chunk c: (B, C-1, K, 2w, D)
    k, v = (F.pad(x, (0, 0, 0, pad)).unfold(2, 2 * w, w).permute(0, 2, 1, 4, 3) for x in (k, v))
    i = torch.arange(w, device=q.device)[:, None]
    j = torch.arange(2 * w, device=q.device)[None, :]
    band = (j > i) & (j <= i + w)  # query i of a chunk sees key j of its pair iff i < j <= i + w
    rest = F.scaled_dot_product_attention(q, k, v, attn_mask=band, **sdpa)  # (B, C-1, H, w, D)
    rest = rest.transpose(1, 2).reshape(B, H, (C - 1) * w, D)
    return torch.cat([first, rest], dim=2)[:, :, :T]


class Attention(nn.Module):
    """Heads split over tp: q, k, v column-parallel (by heads, their biases with them), the
    output projection row-parallel. Under sequence parallelism x is (B, T/tp, C) and so is
    the output. qwen3's q/k norms act on each head's vector, so every tp rank applies the
    same (replicated) weights to its own heads: their gradients are partial sums over tp
    (``mark_tp_partial``), completed by ``TPGradSync``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        topo: Topology,
        selective_recompute: bool,
        sequence_parallel: bool = False,
        cp_mode: str = "ring",
    ):
        super().__init__()
        tp = topo.tp
        self.cfg, self.topo, self.selective_recompute = cfg, topo, selective_recompute
        self.cp_mode = cp_mode
        self.n_heads = cfg.n_heads // tp
        # Fewer key/value heads than tp ranks: each kv head is replicated on tp/K ranks
        # (their weight gradients are summed by TPGradSync).
        kv_replicas = max(1, tp // cfg.n_kv_heads)
        self.n_kv_heads = max(1, cfg.n_kv_heads // tp)
        kv_spec = ShardSpec(dim=0, replicas=kv_replicas)
        col = dict(topo=topo, bias=cfg.biases or cfg.qkv_bias, sequence_parallel=sequence_parallel)
        self.q = ColumnParallelLinear(cfg.hidden, cfg.q_dim, **col)
        self.k = ColumnParallelLinear(cfg.hidden, cfg.kv_dim, spec=kv_spec, **col)
        self.v = ColumnParallelLinear(cfg.hidden, cfg.kv_dim, spec=kv_spec, **col)
        self.o = RowParallelLinear(
            cfg.q_dim, cfg.hidden, topo=topo, bias=cfg.biases, sequence_parallel=sequence_parallel
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            if tp > 1:
                mark_tp_partial(self.q_norm.weight)
                mark_tp_partial(self.k_norm.weight)

    def _core(self, q, k, v, span=None):
        dropout = self.cfg.dropout if self.training else 0.0
        gqa = self.n_kv_heads != self.n_heads
        window = self.cfg.sliding_window
        if span is not None and span.layout is not None:  # the cp ring: whole sequences
            with torch.autocast(q.device.type, enabled=False):  # fp32 inside (context.py)
                return context_attention(q, k, v, layout=span.layout, topo=self.topo,
                                         axis=Axis.CP, mode=self.cp_mode)[0]  # fmt: skip
        if span is not None:  # documents, one rank: a causal, per-document mask
            with tp_shard_rng(self.topo) if dropout else contextlib.nullcontext():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=span.mask, dropout_p=dropout, enable_gqa=gqa
                )
        # attention probabilities of this rank's heads: a tp region, per-shard stream
        with tp_shard_rng(self.topo) if dropout else contextlib.nullcontext():
            if window is not None and q.shape[-2] > window:
                return sliding_window_attention(q, k, v, window, dropout_p=dropout, enable_gqa=gqa)
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa
            )

    def forward(self, x, rope=None, span=None):  # (B, T, C) -> (B, T, C)
        full = self.q.enter(x)  # one f (or all-gather) for q, k and v together
        with self.q.keeping(x, full) as kept:  # sequence parallelism: they save the shard
            q, k, v = column_linears((self.q, self.k, self.v), full)  # one GEMM where it can
        B, T, D = q.shape[0], q.shape[1], self.cfg.head_dim
        del full  # (sequence parallelism: the backward gathers it again)
        if rope is not None or self.cfg.qk_norm:
            # q and k go on as new tensors (rotary, norms) and the attention saves those:
            # v, a view of the fused product, would keep all of it -- q's and k's dead rows
            # too, 2 GiB more activations rehearsed for llama2-7b at 4,096 tokens -- so v
            # takes its own storage (a no-op where the layers ran apart)
            v = v.contiguous()
        q = q.view(B, T, self.n_heads, D)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv_heads, D)  # (B, T, K, D)
        v = v.view(B, T, self.n_kv_heads, D)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # rotated in (B, T, H, D) order, as the products lie
            q, k = apply_rotary(q, *rope, seq_dim=1), apply_rotary(k, *rope, seq_dim=1)
        # (B, H, T, D) views of the (B, T, H, D) tensors: the attention's output comes back
        # in that order, and the heads merge below without a copy (rotating after the
        # transpose made q contiguous as (B, H, T, D), the output too, and the merge
        # copied it: one more (T, H D) tensor a block, kept for the o projection)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.selective_recompute and self.training:
            y = checkpoint(_Recomputed(self._core), q, k, v, span, use_reentrant=False)
        else:
            y = self._core(q, k, v, span)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * D)  # (B, T, H*D), this rank's heads
        return self.o(y, prefetch=kept)  # (the backward re-gathers q/k/v's input under o's)


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama); first GEMM(s) column-split, last row-split."""

    def __init__(self, cfg: ModelConfig, *, topo: Topology, sequence_parallel: bool = False):
        super().__init__()
        self.arch = cfg.arch
        h, f = cfg.hidden, cfg.ffn_hidden
        sp = dict(topo=topo, sequence_parallel=sequence_parallel)
        if cfg.arch == "gpt2":
            self.fc = ColumnParallelLinear(h, f, bias=True, **sp)
            self.proj = RowParallelLinear(f, h, bias=True, **sp)
        else:
            self.gate = ColumnParallelLinear(h, f, bias=False, **sp)
            self.up = ColumnParallelLinear(h, f, bias=False, **sp)
            self.down = RowParallelLinear(f, h, bias=False, **sp)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        if self.arch == "gpt2":
            full = self.fc.enter(x)
            with self.fc.keeping(x, full) as kept:
                h = self.fc(compute_input(full), entered=True)
            del full
            return self.proj(F.gelu(h, approximate="tanh"), prefetch=kept)
        full = self.gate.enter(x)  # one f (or all-gather) for both GEMMs
        with self.gate.keeping(x, full) as kept:
            gate, up = column_linears((self.gate, self.up), full)
        del full
        # (the backward re-gathers the input under the down projection's)
        return self.down(_SwiGLU.apply(gate, up), prefetch=kept)


class Block(nn.Module):
    """Attention then MLP, each on a pre-norm residual branch. Block ``layer`` of a mixture
    of experts (``cfg.is_moe_layer``) has a ``MoE`` as its MLP (``ep``: its expert-parallel
    group, ``model/moe.py``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        topo: Topology,
        recompute: str,
        sequence_parallel: bool = False,
        cp_mode: str = "ring",
        layer: int = 0,
        ep=None,
    ):
        super().__init__()
        self.recompute_full = recompute == "full"
        self.ln1 = make_norm(cfg)
        self.attn = Attention(
            cfg,
            topo=topo,
            selective_recompute=recompute == "selective",
            sequence_parallel=sequence_parallel,
            cp_mode=cp_mode,
        )
        self.ln2 = make_norm(cfg)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, topo=topo, sequence_parallel=sequence_parallel, ep=ep)
        else:
            self.mlp = MLP(cfg, topo=topo, sequence_parallel=sequence_parallel)
        # the residual stream: replicated over tp, or a sequence shard (per-shard masks)
        self.drop = TPDropout(cfg.dropout, topo=topo, sharded=sequence_parallel)

    def _forward(self, x, rope, span=None):
        # A branch may come out fp32 (a row-parallel bias is added in the fp32 it is held
        # in): the sum is then rounded once to the residual stream's dtype (a no-op for an
        # fp32 stream), so a bf16 / fp16 stream stays in the compute dtype.
        x = (x + self.drop(self.attn(self.ln1(x), rope, span))).to(x.dtype)
        return (x + self.drop(self.mlp(self.ln2(x)))).to(x.dtype)

    def forward(self, x, rope=None, span=None):
        if self.recompute_full and self.training:
            return checkpoint(_Recomputed(self._forward), x, rope, span, use_reentrant=False)
        return self._forward(x, rope, span)


class _Recomputed(nn.Module):
    """A function as a module call of its own (no state; not a child of anything): what
    activation checkpointing runs, so that module hooks see a recomputed forward begin and
    end as one -- its residual sums included, which run between the submodules' calls
    (``plait rehearse`` files what a recomputation makes as activations by those hooks)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class Span(NamedTuple):
    """What attention needs beyond q, k and v (None when it is plain causal attention over
    the tokens at hand): with cp, the ring's ``layout`` (its documents included); without,
    the causal per-document ``mask`` (B, 1, T, T)."""

    layout: ContextLayout | None = None
    mask: torch.Tensor | None = None


def residual_dtype(device: torch.device, fp32_residual: bool) -> torch.dtype | None:
    """The residual stream's dtype where the embedding must cast to it: autocast's compute
    dtype (bf16 / fp16) unless ``fp32_residual``; None (leave it fp32) otherwise."""
    if fp32_residual or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


class Embedding(nn.Module):
    """Token embedding (vocabulary-parallel) plus learned positions (gpt2); under sequence
    parallelism the output is this rank's sequence shard (B, T/tp, C).

    Under autocast (``--dtype bf16|fp16``) the output -- the residual stream from here to
    the final norm, and what the pipeline sends between stages -- is in the compute dtype,
    as Megatron-LM's by default: the token rows are rounded once, the positions added in
    fp32 and the sum rounded. ``fp32_residual`` (Megatron's ``--fp32-residual-connection``)
    keeps it fp32: autocast then runs the norms in fp32 on it and the residual adds stay
    fp32."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        topo: Topology,
        positions: bool,
        sequence_parallel: bool = False,
        fp32_residual: bool = False,
    ):
        super().__init__()
        self.topo, self.sequence_parallel = topo, sequence_parallel
        self.fp32_residual = fp32_residual
        self.tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden, topo=topo, sequence_parallel=sequence_parallel
        )
        self.positions = nn.Embedding(cfg.seq_len, cfg.hidden) if positions else None
        self.drop = TPDropout(cfg.dropout, topo=topo, sharded=sequence_parallel)

    def forward(self, ids, positions=None):  # (B, T) -> (B, T, C) or (B, T/tp, C)
        dtype = residual_dtype(ids.device, self.fp32_residual)
        x = self.tokens(ids, dtype)
        if self.positions is not None:
            if positions is None:
                positions = torch.arange(ids.shape[1], device=ids.device)
            pos = self.positions(positions)[None]  # (1, T, C)
            x = x + (sequence_shard(pos, self.topo) if self.sequence_parallel else pos)
            if dtype is not None:
                x = x.to(dtype)  # (the add promoted it to fp32)
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
        recompute_layers: int | None = None,
        sequence_parallel: bool = False,
        cp_mode: str = "ring",
        ep=None,
        fp32_residual: bool = False,
    ):
        super().__init__()
        topo = topo or Topology.single()
        check_tp_split(cfg, topo.tp)
        sp = sequence_parallel and topo.tp > 1
        self.cfg, self.topo, self.pre, self.post = cfg, topo, pre, post
        self.sequence_parallel = sp
        layers = range(cfg.n_layers) if layers is None else layers
        if pre or (post and cfg.tied_embeddings):
            # The last pipeline stage of a tied model keeps its own copy of the token
            # embedding under the same name; the pipeline keeps the copies in sync.
            self.embed = Embedding(
                cfg, topo=topo, positions=pre and cfg.arch == "gpt2", sequence_parallel=sp,
                fp32_residual=fp32_residual,
            )  # fmt: skip
        # --recompute-layers N: the chunk's first N blocks recompute in full, the rest keep
        # their activations (``Layout.recomputed_blocks``)
        full = len(layers) if recompute_layers is None else recompute_layers
        self.blocks = nn.ModuleDict(
            {
                str(i): Block(
                    cfg,
                    topo=topo,
                    recompute=recompute if recompute != "full" or k < full else "none",
                    sequence_parallel=sp,
                    cp_mode=cp_mode,
                    layer=i,
                    ep=ep,
                )
                for k, i in enumerate(layers)
            }
        )
        if post:
            self.norm = make_norm(cfg)
            if not cfg.tied_embeddings:
                self.head = ColumnParallelLinear(
                    cfg.hidden,
                    cfg.vocab_size,
                    topo=topo,
                    bias=False,
                    spec=vocab_spec(cfg.vocab_size),
                    sequence_parallel=sp,
                )
        if sp:
            # Every tp-replicated parameter (norms, row-parallel biases, positions) now sees
            # only this rank's sequence shard: TPGradSync sums its gradient over tp.
            for p in self.parameters():
                if shard_spec(p).dim is None:
                    mark_sequence_parallel(p)
        self._rope_cache: dict = {}

    def _rope(self, T: int, device, positions=None):
        """Rotary tables of the T tokens held (positions 0 .. T-1, or ``positions``)."""
        if not self.cfg.rotary:
            return None
        key = (T, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rotary_tables(self.cfg, T, device, positions)
        return self._rope_cache[key]

    def _positions(self, s: int, device) -> torch.Tensor | None:
        """Global positions of the tokens this cp rank holds (None without cp)."""
        cp = self.topo.cp
        if cp == 1:
            return None
        return shard(torch.arange(s, device=device), cp=cp, index=self.topo.cp_rank, dim=0)

    def logits(self, x):  # (B, T, C) or (B, T/tp, C) -> (B, T, V/tp)
        """This rank's vocabulary slice of the logits; where tp does not divide the
        vocabulary, the last slice ends in padded columns (zero weights)."""
        x = self.norm(x)
        if not self.cfg.tied_embeddings:
            return self.head(x)
        full = enter_tp(x, self.topo, self.sequence_parallel)
        with keeping_shard(x, full, self.topo, self.sequence_parallel):
            return vocab_linear(compute_input(full), self.embed.tokens.weight)

    def forward(self, x, targets=None, documents=None):
        """ids (B, T) if ``pre`` else hidden (B, T, C) -- (B, T/tp, C), this rank's sequence
        shard, under sequence parallelism. Returns hidden in the same form unless ``post``;
        then the per-token loss (B*T,) if targets are given, else the logits (B, T, V/tp).
        With cp, T is this rank's s / cp tokens of each sequence (module docstring);
        ``documents`` (B, s): document ids of the whole sequences, or None (no mask)."""
        held = x.shape[1] * (self.topo.tp if self.sequence_parallel and not self.pre else 1)
        s = held * self.topo.cp  # tokens per whole sequence
        positions = self._positions(s, x.device)
        if self.pre:
            if x.shape[1] > self.cfg.seq_len:
                raise ValueError(
                    f"sequence of {x.shape[1]} tokens is longer than the model's "
                    f"--seq-len {self.cfg.seq_len}"
                )
            if self.sequence_parallel and x.shape[1] % self.topo.tp:
                raise ValueError(
                    f"--sequence-parallel needs the sequence length ({x.shape[1]}) divisible "
                    f"by --tp {self.topo.tp}"
                )
            x = self.embed(x, positions)
        rope = self._rope(held, x.device, positions)
        span = None
        if self.topo.cp > 1:
            span = Span(layout=ContextLayout(cp=self.topo.cp, seq_len=s, documents=documents))
        elif documents is not None:
            span = Span(mask=document_mask(documents))
        for block in self.blocks.values():
            x = block(x, rope, span)
        if not self.post:
            return x
        logits = self.logits(x)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), topo=self.topo, valid_vocab=self.cfg.vocab_size
        )


# --- deterministic initialisation ---------------------------------------------------------


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: depends only on
    (seed, config, name), never on the layout.

    GPT-2 scheme: normal(0, init_std) for weights, residual output projections scaled by
    1/sqrt(2 * layers), zero biases, unit norm weights. Stacked experts (E, ...) are one
    tensor: an expert-parallel rank's share is a slice of it (``init_weights``).
    """
    leaf = name.rsplit(".", 2)
    if name.endswith((".bias", ".b_fc", ".b_proj")):  # (the last two: stacked experts')
        return torch.zeros(shape)
    if len(leaf) >= 2 and leaf[-2] in ("ln1", "ln2", "norm", "q_norm", "k_norm"):
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("attn.o.weight", "mlp.proj.weight", "mlp.down.weight", ".w_proj",
                      ".w_down")):  # fmt: skip
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    g = torch.Generator().manual_seed(_param_seed(seed, name))
    return torch.randn(shape, generator=g) * std


def whole_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    """The shape of the whole tensor that parameter ``p`` holds a part of: its tp shard
    widened, and under expert parallelism all E experts (``expert_shard``: (E, first
    held))."""
    shape = full_shape(p.shape, shard_spec(p), tp)
    experts = getattr(p, "expert_shard", None)
    return (experts[0], *shape[1:]) if experts is not None else tuple(shape)


def rank_part(full: torch.Tensor, p: torch.Tensor, topo: Topology) -> torch.Tensor:
    """This rank's part of ``full`` (of ``whole_shape``) as parameter ``p`` holds it: its
    experts' rows under expert parallelism, its tp shard. What a seeded initial value, a
    Hugging Face weight and a LoRA factor alike go through on their way into a rank."""
    experts = getattr(p, "expert_shard", None)
    if experts is not None:
        full = full.narrow(0, experts[1], p.shape[0])
    return tp_shard(full, shard_spec(p), tp_rank=topo.tp_rank, tp=topo.tp)


def _initial_shard(cfg: ModelConfig, name: str, p: torch.Tensor, topo: Topology, seed: int):
    """This rank's part of parameter ``name``'s initial value (``init_value``)."""
    return rank_part(init_value(cfg, name, whole_shape(p, topo.tp), seed), p, topo)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    for name, p in model.named_parameters():
        p.copy_(_initial_shard(model.cfg, name, p, model.topo, seed))


def defer_init(model: Transformer, seed: int) -> None:
    """Give each parameter of a model built on meta an ``init_value()`` that makes its
    initial value (what ``init_weights`` would copy in) when called: ZeRO-3 calls it one
    parameter at a time as it fills this rank's shards (``zero_units.initial_value``), so
    the model is never held whole."""
    for name, p in model.named_parameters():
        p.init_value = functools.partial(_initial_shard, model.cfg, name, p, model.topo, seed)


def hollow(model: nn.Module, device: torch.device | str) -> None:
    """Replace each parameter of a model built on meta by one on ``device`` that holds no
    storage (allocated and released one at a time: at most one parameter's bytes at once),
    keeping its attributes (tp shard spec, ``init_value``). What a ZeRO-3 engine then points
    into its unit buffers (``zero_units``); nothing may hold a meta parameter before this.
    Buffers -- built whole on the CPU, the MoE layers' routing state (``moe.py``; a few
    numbers per expert) -- move to ``device``."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None:
                assert not b.is_meta, f"buffer {name} built on meta: it would hold no value"
                module._buffers[name] = b.to(device)
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                # the parameter's storage freed, not the tensor's it was made from: under
                # FakeTensorMode (``plait rehearse``) the Parameter gets a storage of its
                # own, which kept the whole model counted through the build (7B: 24.9 GiB)
                q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                 requires_grad=p.requires_grad)  # fmt: skip
                resize_storage(q, 0)
                for key, value in p.__dict__.items():  # (a fake tensor's own stay)
                    q.__dict__.setdefault(key, value)
                new[id(p)] = q
            module._parameters[name] = new[id(p)]


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` the computation of every transformer block in ``model``, as
    torchtitan compiles per block: blocks share one code path, so one compiled graph serves
    them all and compile time does not grow with depth. Hooks on a block (ZeRO-3's
    parameter gathers) stay outside the compiled region; the tensor-parallel collectives
    inside it break the graph there and run eagerly, in the same order."""
    for module in model.modules():
        if isinstance(module, Block):
            module._forward = torch.compile(module._forward)


def build_model(
    cfg: ModelConfig, *, seed: int = 0, device: str | torch.device = "cpu", **chunk
) -> Transformer:
    """Build (a chunk of) the model with its deterministic initial weights. ``chunk``:
    ``Transformer``'s keywords (``topo``, ``layers``, ``pre``, ``post``, ``recompute``,
    ``recompute_layers`` (the chunk's first N blocks recompute under ``full``),
    ``sequence_parallel``, ``cp_mode``, ``fp32_residual``, ``ep``: the (topo, axis) of the MoE layers' expert-parallel
    group). On the ``meta`` device nothing is allocated or initialised: for sizes and
    memory of large presets, and for ZeRO-3, which initialises each parameter's shard from
    its ``init_value()`` (``defer_init``).

    ``sequence_parallel`` (with tp > 1): activations between the tp regions are sequence
    shards; the gradients of the tp-replicated parameters then need ``TPGradSync``.
    ``fp32_residual``: under autocast, keep the residual stream fp32 (``Embedding``)."""
    with torch.device(device):
        model = Transformer(cfg, **chunk)
    if str(device) != "meta":
        init_weights(model, seed)
    else:
        defer_init(model, seed)
    return model
