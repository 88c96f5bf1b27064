"""Per-action costs: compute from FLOPs and bytes, communication from an alpha-beta model.

Everything here is a pure function of (model, layout, hardware, runtime) and returns
seconds for *one tensor-parallel rank* of one micro-batch of ``b`` sequences of ``s``
tokens (T = b s tokens). Letters: h hidden, a heads, k key/value heads, d = h / a head
size, f FFN width, V vocabulary, t = tp, e bytes per activation element.

Compute
    A GEMM (M x K) @ (K x N) of F = 2 M N K FLOPs takes
    ``max((F + F_half) / (peak * gemm_max), bytes / memory_bandwidth)``, bytes =
    e (M K + K N + M N) (``Efficiency``). Per layer and tp rank, forward: QKV (T, (a+2k)
    d / t, h), attention out (T, h, a d / t), MLP (T, f / t, h) and (T, h, f / t) (SwiGLU:
    (T, 2 f / t, h)). Backward: each GEMM twice, as its input-gradient (M, K, N) and its
    weight-gradient (N, K, M) product (the zero-bubble split times them apart).
    Attention core: with fused attention, 4 T s h / t FLOPs forward, halved by the causal
    mask, 2.5x that in backward, at ``efficiency.attention`` of peak (a long-sequence
    figure) times the key loop's saturation ``attention_key_saturation``; unfused, two batched
    GEMMs (b a / t of them, (s, s, d) and (s, d, s)) plus the softmax streaming the scores.
    Memory-bound operations stream their bytes at ``elementwise_bandwidth`` (on the GPU
    presets 0.625 of the HBM's peak, measured; the memory bandwidth where a hardware file
    leaves it out): a block's norms, residual adds, activation, rotary and casts as the
    runtime writes them (``stream_bytes``: fused kernels, eager PyTorch layers, or plait's
    own blocks, each counted from its code), plus plait's per-weight casts
    (``weight_stream_bytes``); unfused attention streams its scores too.

Per-kernel overhead
    Each kernel also costs ``hw.op_overhead`` seconds of host time (zero for GPUs, whose
    kernels are queued ahead). Counted per layer and micro-batch, forward:
    ``LAYER_KERNELS`` (the linears, norms, attention, activation, residual adds, and for
    llama the unfused RMSNorm and rotary); backward: as many again for the input
    gradients plus one weight-gradient kernel per linear. Embedding and head: see
    ``END_KERNELS``.

Recomputation
    ``full`` reruns each layer's forward (and its tensor-parallel collectives) inside the
    backward; ``selective`` reruns the attention core, which fused attention already does
    (so it costs nothing extra there).

Collectives: ``collectives.py`` (alpha-beta on the link the group spans).

Tensor parallelism (Megatron): per layer, forward 2 all-reduces of T h e bytes (with
sequence parallelism 2 all-gathers + 2 reduce-scatters of the same size), and the same
again in backward. Pipeline: one T h e message per stage boundary and direction, sent as
t slices of 1/t (scatter/gather) and all-gathered over NVLink on arrival (with sequence
parallelism the activations are already sliced). Data parallelism and ZeRO: see
``dp_comm_time`` and ``zero_layer_comm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plait.layout import Layout
from plait.model import sizes
from plait.model.config import ModelConfig
from plait.sim import context as cp_sim
from plait.sim import expert as ep_sim
from plait.sim.collectives import (
    all_gather_time,
    all_reduce_time,
    group_link,
    hidden_behind,
    p2p_time,
    reduce_scatter_time,
    ring_latency,
)
from plait.sim.hardware import Hardware, Link
from plait.sim.runtime import Runtime

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def residual_bytes(layout: Layout) -> int:
    """Bytes per element of the residual stream: the compute dtype's, or 4 under
    ``--fp32-residual`` (Megatron's ``--fp32-residual-connection``). What the norms keep for
    the backward, and what a tp region's entry (f: its backward all-reduce; with sequence
    parallelism its all-gather and reduce-scatter) and the embedding's reduction move:
    the norm's output is the stream's dtype (autocast runs the norm in fp32 on an fp32
    stream). Its exit (g) moves the compute dtype of the row-parallel GEMM's output."""
    return 4 if layout.fp32_residual else ACT_BYTES[layout.dtype]


def residual_note(layout: Layout) -> str:
    """What ``plait info`` prints beside the dtype: ", residual fp32" (``--fp32-residual``)
    or ", residual bf16" under bf16 / fp16; "" under fp32, where nothing differs."""
    if layout.dtype == "fp32":
        return ""
    return f", residual {'fp32' if layout.fp32_residual else layout.dtype}"


# Kernels one layer's forward launches in plait's model (views are free): gpt2: 6 linears
# (q, k, v, o, fc, proj), 2 LayerNorms, attention, the head merge copy, GELU, 2 adds;
# llama: 7 linears, 2 RMSNorms of 6 kernels, rotary on q and k (8 each), attention, the
# copy, SiLU, the gate product, 2 adds.
LAYER_KERNELS = {"gpt2": (13, 6), "llama": (41, 7)}  # (forward kernels, linears)
END_KERNELS = {"embedding": (3, 2), "head": (8, 8)}  # (forward, backward)
LAYER_TENSORS = {"gpt2": 16, "llama": 9}  # plait's blocks (sizes.layer_tensors adds qwen's)
# Megatron-style blocks: fused QKV and (llama) fused gate/up; gpt2 with biases:
# qkv, proj, fc1, fc2 (weight + bias each) and two LayerNorms (weight + bias)
FUSED_LAYER_TENSORS = {"gpt2": 12, "llama": 6}
FLASH_BLOCK = 128  # query/key tile of fused attention kernels (sets the causal saving)

# Memory-bound bytes per token of one block, forward and backward, by how the software
# writes its layers (``Runtime.layer_kernels``). Coefficients are bytes per token per
# element of (h: the hidden size, divided by t under sequence parallelism; f: the FFN
# width per tp rank; r: the rotary heads' elements per tp rank, (a + k) d / t), counted
# from each software's own code, run on fake tensors with every dispatched operator's
# inputs and outputs summed (views free, GEMMs and attention apart):
#
# - "eager": PyTorch modules with bf16 weights (FSDP's mixed precision), the layers of
#   torchtitan (commit 0413364349, the published runs' version: its Triton fused RMSNorm,
#   rotary in fp32 complex numbers, SiLU then a product, separate q / k / v and gate / up
#   linears whose input gradients autograd adds up) and llm-foundry's MPT (fused
#   LayerNorm, fused QKV, one GELU, no rotary). Forward: two norms 2 x 2, two residual
#   adds 2 x 3; SwiGLU 5 (SiLU 2 + product 3), GELU 2; rotary (2 e + 16) (cast to fp32,
#   the complex product, cast back). Backward: two norms 2 x 3, the residual gradients'
#   sums 2 x 3, llama's three shared-input sums (q + k + v, gate + up) 3 x 3, MPT's fused
#   QKV output split by views whose gradients are concatenated 6; SwiGLU 9, GELU 3; rotary
#   as forward. Grouped-query attention adds the key / value repeat.
#   Checked against torchtitan's own code: 9.14 GB counted, 9.13 priced for a llama2-13b
#   block at 2 x 4096 tokens; 14.27 and 14.30 for llama3-70b's (grouped-query) at 8192.
# - "plait": plait's own blocks (``benchmarks/stream_bytes.py`` counts them; tested in
#   ``tests/test_stream_bytes.py``): fp32 copies around bf16 norms, each norm output cast
#   per linear; rotary two kernels a half each way (``transformer._Rotary``: x1 cos, then
#   minus x2 sin into the output; 3 + 4 bytes an element of a half under bf16, 4 + 6 fp32:
#   14 and 20 an element, the tables' per-token reads aside; 48 / 52 and 36 / 40 with
#   autograd's composite of casts, four products, a sum and a concatenation, until
#   2026-11-28). Counted per dtype; fp16 as bf16. Under autocast q, k
#   and v (and llama's gate and up) run as one GEMM (``tensor.column_linears``): the
#   backward concatenates their output gradients (``plait_fused_bytes``, apart: it goes
#   with the heads, not h) and has no input-gradient sums to add; where q and k leave as
#   new tensors (rotary, q/k norms) v is copied out of the product (2 e a token per value
#   width), so that the product is not kept for the backward. Rotary runs on the
#   (B, T, H, D) products before the heads' transpose, so that the attention's output
#   merges its heads without a copy and q's and k's gradients need none either (until
#   2026-11-27: 2 e per output element forward, 2 e per rotary element backward more).
#   An fp32 RMSNorm runs the fused norm's kernels too (``transformer._LowPrecisionNorm``;
#   autograd's composite before: llama fp32 backward 252.5 h bytes a token, now 84.5).
#
# "fused" (Megatron, Transformer Engine: one kernel per operation, each reading its
# inputs and writing its output once) is the model's first count, in elements:
# forward 10 h + 2 f (GELU) or 3 f (SwiGLU) + 2 r, backward twice that.
EAGER_STREAM = {  # passes of e bytes per element of (h, f), forward then backward (rotary apart)
    "gpt2": ((10.0, 2.0), (18.0, 3.0)),
    "llama": ((10.0, 5.0), (21.0, 9.0)),
}
PLAIT_STREAM = {  # bytes (not elements) per token per (h, f, r), forward then backward
    ("gpt2", "bf16"): ((84.0, 4.0, 0.0), (122.0, 8.0, 0.0)),
    ("llama", "bf16"): ((92.5, 10.0, 14.0), (72.5, 22.0, 14.0)),
    ("gpt2", "fp32"): ((56.0, 8.0, 0.0), (92.0, 16.0, 0.0)),
    ("llama", "fp32"): ((80.5, 20.0, 20.0), (84.5, 44.0, 20.0)),
}


def stream_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime, *, moe: bool = False
                 ) -> tuple[float, float]:  # fmt: skip
    """Memory-bound bytes per token of one block on one tp rank, (forward, backward), as
    ``runtime.layer_kernels`` writes the block (table above). ``moe``: the MLP's part is
    left out (``expert.mlp_cost`` streams the routed MLP's own)."""
    t, e = layout.tp, ACT_BYTES[layout.dtype]
    h = cfg.hidden / (t if layout.sequence_parallel else 1)
    a_t, kv_t = _local_heads(cfg, t)
    f = 0.0 if moe else cfg.ffn_hidden / t
    r = (a_t + kv_t) * cfg.head_dim if cfg.rotary else 0.0
    if runtime.layer_kernels == "fused":
        fwd = e * (10 * h + (2 if cfg.block == "gpt2" else 3) * f + 2 * r)
        return fwd, 2 * fwd
    if runtime.layer_kernels == "eager":
        (fh, ff), (bh, bf) = EAGER_STREAM[cfg.block]
        rope = (2 * e + 16) * r
        fwd, bwd = e * (fh * h + ff * f) + rope, e * (bh * h + bf * f) + rope
        if kv_t < a_t and cfg.rotary:  # the key / value repeat and its sum
            fwd += 2 * e * (a_t + kv_t) * cfg.head_dim
            bwd += 2 * e * (a_t + kv_t) * cfg.head_dim
        return fwd, bwd
    key = (cfg.block, "fp32" if layout.dtype == "fp32" else "bf16")
    (fh, ff, fr), (bh, bf, br) = PLAIT_STREAM[key]
    fwd, bwd = fh * h + ff * f + fr * r, bh * h + bf * f + br * r
    if layout.dtype != "fp32":
        bwd += plait_fused_bytes(cfg, layout, moe=moe)
        if cfg.rotary or cfg.qk_norm:  # v copied out of the fused product (transformer.py)
            fwd += 2 * e * kv_t * cfg.head_dim
    return fwd, bwd


def plait_fused_bytes(cfg: ModelConfig, layout: Layout, *, moe: bool = False) -> float:
    """Backward bytes per token of plait's fused column GEMMs (``tensor.column_linears``,
    under autocast) on one tp rank: their output gradients -- q, k and v, and llama's gate
    and up -- read and written once more by the concatenation that feeds the GEMMs. The
    input-gradient sums of separate layers are gone (``PLAIT_STREAM``)."""
    e = ACT_BYTES[layout.dtype]
    a_t, kv_t = _local_heads(cfg, layout.tp)
    out = (a_t + 2 * kv_t) * cfg.head_dim
    if cfg.block != "gpt2" and not moe:
        out += 2 * cfg.ffn_hidden / layout.tp
    return 2 * e * out


def _reduced_every_microbatch(layout: Layout, runtime: Runtime) -> bool:
    """ZeRO-2/3 under a runtime that reduce-scatters every micro-batch's gradients."""
    return (layout.zero == 3 and runtime.zero3_reduce_per_microbatch) or (
        layout.zero == 2 and runtime.zero2_reduce_per_microbatch
    )


def weight_stream_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime, *,
                        moe: bool = False) -> float:  # fmt: skip
    """Bytes a micro-batch streams per block in proportion to its linear weights on one tp
    rank, not its tokens:

    - fp32 weights under bf16 / fp16 autocast (``weight_cast_per_step``: plait): each weight
      gradient is cast to fp32 (2 + 4 bytes) and, from a step's second micro-batch on,
      added to the fp32 gradient (12), and each weight is cast to the compute dtype once a
      step (4 + 2; not under ZeRO-3, which gathers in it). Where every micro-batch is
      reduce-scattered (plait's ZeRO-2 and 3) nothing whole is accumulated: ZeRO-3 packs
      each compute-dtype gradient into fp32 (2 + 4), ZeRO-2 casts it (2 + 4) and packs the
      fp32 gradient (4 + 4), and the micro-batches add up in the 1/d rows;
    - weights held in the compute dtype with gradients reduced in fp32 (FSDP's
      ``reduce_dtype``: no ``master_weights``, ``grad_reduce_fp32``): the backward leaves
      each weight gradient in the compute dtype and it is cast to fp32 for the reduction in
      every micro-batch (2 + 4 bytes: FSDP1's post-backward cast of the unsharded gradient,
      FSDP2's copy into its reduce-scatter input);
    - DeepSpeed's optimizers (``deepspeed_optimizer``): under bf16 each micro-batch's bf16
      gradient cast to fp32 and added to the fp32 gradient (2 + 4 + 4 + 4 + 4); under fp16
      autograd's accumulation of the fp16 gradient from the second micro-batch on (6);
    - FSDP1's division of each micro-batch's unsharded gradient before its reduce-scatter
      (``grad_predivide``: 4 + 4 bytes in fp32), in any dtype;
    - under ZeRO-3, each gathered weight copied out of the gather's buffer
      (``gather_copy_out``: read and write, at the forward's and the backward's gather);
    - nothing for Megatron, which accumulates in fp32 inside the weight-gradient GEMM.

    ``moe``: the experts' weights this rank holds in place of the dense MLP's
    (``expert.mlp_matmul_extra``): plait casts their stacked weights once a step too."""
    m, per = layout.num_microbatches, 0.0
    if layout.dtype != "fp32":  # the casts and copies of mixed precision
        if runtime.weight_cast_per_step and _reduced_every_microbatch(layout, runtime):
            # ZeRO-2/3 pack each micro-batch's gradient into fp32 for its reduce-scatter
            # and sum the rows: 1/d of a weight's bytes, left out
            per = 6.0 if layout.zero == 3 else 6 + 8 + 6 / m
        elif runtime.weight_cast_per_step:
            per = 6 + 12 * (m - 1) / m + (6 / m if layout.zero < 3 else 0.0)
        elif not runtime.master_weights and runtime.grad_reduce_fp32:
            per = 6.0
        elif runtime.deepspeed_optimizer:
            per = 18.0 if layout.dtype == "bf16" else 6 * (m - 1) / m
    if runtime.grad_predivide and layout.dp > 1:  # read and write, in the reduce dtype
        per += 2 * runtime.grad_comm_bytes(layout.dtype)
    if runtime.gather_copy_out and layout.zero >= 3 and layout.dp > 1:
        per += 2 * 2 * runtime.param_comm_bytes(layout.dtype)  # two gathers, read + write
    if per == 0.0:
        return 0.0
    n = sizes.layer_matmul_params(cfg) / layout.tp
    if moe:
        n += ep_sim.mlp_matmul_extra(cfg, layout)
    return n * per


# -- compute ------------------------------------------------------------------------------


def gemm_time(hw: Hardware, dtype: str, m: float, n: float, k: float, batch: float = 1) -> float:
    """Seconds for ``batch`` GEMMs (m x k) @ (k x n) issued as one kernel (module doc)."""
    flops = 2.0 * m * n * k * batch
    compute = flops / (hw.peak(dtype) * hw.efficiency.gemm(m, n, k, batch))
    memory = ACT_BYTES[dtype] * batch * (m * k + k * n + m * n) / hw.memory_bandwidth
    return max(compute, memory)


def linear_times(hw: Hardware, dtype: str, m: float, n: float, k: float) -> tuple[float, ...]:
    """(forward, input-gradient, weight-gradient) seconds of one linear layer."""
    return (
        gemm_time(hw, dtype, m, n, k),
        gemm_time(hw, dtype, m, k, n),
        gemm_time(hw, dtype, n, k, m),
    )


def stream_time(hw: Hardware, nbytes: float) -> float:
    """Seconds of a memory-bound framework kernel (elementwise, norm, loss, optimizer)."""
    return nbytes / hw.elementwise_bw


def attention_key_saturation(s: float, causal: float, half_k: float) -> float:
    """Fraction of its long-sequence rate a fused attention kernel reaches at sequence
    length ``s``. Each query tile loads its queries and zeroes its accumulators before
    the loop over key blocks and rescales and writes its output and log-sum-exp after it:
    the fixed cost of a GEMM output tile, amortised over a loop as long as the keys the
    tile visits (``causal`` x ``s`` on average under the causal mask) instead of the
    reduction length k. So the GEMM curve's ``gemm_half_k`` applies: keys / (keys +
    half_k). On an A100 (half_k 200) causal attention runs at 0.84 of its long-sequence
    rate at s = 2048 and 0.98 at s = 16384: the rise and flattening of FlashAttention-2's
    causal throughput with sequence length in Dao (2023)."""
    keys = causal * s
    return keys / (keys + half_k)


# -- one transformer layer ----------------------------------------------------------------


@dataclass(frozen=True)
class LayerCost:
    """Seconds for one layer and one micro-batch on one tp rank. ``*_tp`` are the exposed
    tensor-parallel collectives; the rest is compute (GEMMs, attention, memory-bound)."""

    fwd: float
    fwd_tp: float
    bwd_input: float  # input gradients, attention backward, memory-bound backward
    bwd_weight: float  # weight-gradient GEMMs
    bwd_tp: float
    recompute: float
    recompute_tp: float
    fwd_cp: float = 0.0  # exposed context-parallel exchanges (sim/context.py)
    bwd_cp: float = 0.0  # with full recomputation, the forward's exchanges again
    fwd_ep: float = 0.0  # a MoE layer's expert dispatch (sim/expert.py)
    bwd_ep: float = 0.0  # with full recomputation, the forward's dispatch again
    # the compute above (F + B + recomputation) by kind of kernel: (("gemm", s), ("attention",
    # s), ("memory", s), ("launch", s)) -- what ``plait train --profile`` sums by kernel name
    kinds: tuple[tuple[str, float], ...] = ()


def _local_heads(cfg: ModelConfig, tp: int) -> tuple[float, float]:
    """(query heads, key/value heads) per tp rank; kv heads are replicated when k < t."""
    return cfg.n_heads / tp, max(cfg.n_kv_heads / tp, 1.0)


def layer_cost(
    cfg: ModelConfig,
    layout: Layout,
    hw: Hardware,
    runtime: Runtime,
    seq_len: int | None = None,
    *,
    moe: bool = False,
) -> LayerCost:
    """One block; ``moe``: a MoE block, whose MLP is ``expert.mlp_cost``'s and whose
    dispatch is ``expert.layer_comm``'s, at ``runtime.moe_imbalance``."""
    s = cfg.seq_len if seq_len is None else seq_len
    b, t, dtype = layout.micro_batch_size, layout.tp, layout.dtype
    e = ACT_BYTES[dtype]
    T = b * s // layout.cp  # each cp rank holds s / cp tokens of every sequence
    h, d = cfg.hidden, cfg.head_dim
    a_t, kv_t = _local_heads(cfg, t)
    f_t = cfg.ffn_hidden / t
    sp = layout.sequence_parallel

    # GEMMs: (m, n, k) of each linear layer's forward
    qkv = (T, (a_t + 2 * kv_t) * d, h)
    proj = (T, h, a_t * d)
    if cfg.arch == "gpt2":
        up, down = (T, f_t, h), (T, h, f_t)
    else:
        up, down = (T, 2 * f_t, h), (T, h, f_t)
    lin = [linear_times(hw, dtype, *g) for g in (qkv, proj, up, down)]
    mc = None
    if moe:  # the routed MLP in place of the dense one (sim/expert.py)
        mc = ep_sim.mlp_cost(replace(cfg, seq_len=s), layout, hw, runtime.moe_imbalance,
                             gemm_time=gemm_time, linear_times=linear_times)  # fmt: skip
        lin[2:] = [mc.up, mc.down]
    fwd_gemm = sum(x[0] for x in lin)
    bwd_in_gemm = sum(x[1] for x in lin)
    bwd_w_gemm = sum(x[2] for x in lin)

    # Attention core
    heads = b * a_t
    cp_math = cp_sim.math_attention(layout, runtime)
    if runtime.flash_attention and not cp_math:
        n_blk = max(1, math.ceil(s / FLASH_BLOCK))
        causal = (n_blk + 1) / (2 * n_blk)
        flops = 4.0 * T * s * a_t * d * causal  # with cp: 1/cp of it (head-tail)
        rate = hw.peak(dtype) * hw.efficiency.attention_rate(runtime.attention_native)
        rate *= attention_key_saturation(s, causal, hw.efficiency.gemm_half_k)
        attn_fwd, attn_bwd, attn_re = flops / rate, 2.5 * flops / rate, 0.0
    elif cp_math:  # math attention in fp32 over the blocks it computes (sim/context.py)
        rows, cols, n = cp_sim.score_blocks(replace(cfg, seq_len=s), layout)
        scores = gemm_time(hw, "fp32", rows, cols, d, n)
        values = gemm_time(hw, "fp32", rows, d, cols, n)
        softmax = stream_time(hw, 2 * n * rows * cols * 4)
        attn_fwd = scores + values + softmax
        attn_bwd = 2 * (scores + values) + 2 * softmax + scores  # + the scores recomputed
        attn_re = attn_fwd
    else:
        scores = gemm_time(hw, dtype, s, s, d, heads)  # Q K^T
        values = gemm_time(hw, dtype, s, d, s, heads)  # P V
        softmax = stream_time(hw, 2 * heads * s * s * e)  # read and write the scores
        attn_fwd = scores + values + softmax
        attn_bwd = 2 * (gemm_time(hw, dtype, s, d, s, heads) + gemm_time(hw, dtype, s, s, d, heads))
        attn_bwd += 2 * softmax
        attn_re = attn_fwd

    # Memory-bound bytes (``stream_bytes``), the routed MLP's apart (backward: twice)
    per_fwd, per_bwd = stream_bytes(cfg, layout, runtime, moe=mc is not None)
    routed = mc.stream_bytes if mc else 0.0
    mem_fwd = stream_time(hw, per_fwd * T + routed)
    mem_bwd = stream_time(hw, per_bwd * T + 2 * routed)
    mem_w = stream_time(hw, weight_stream_bytes(cfg, layout, runtime, moe=mc is not None))

    kernels, linears = LAYER_KERNELS[cfg.block]
    if mc is not None:
        dense_k, dense_l = ep_sim.DENSE_MLP_KERNELS[cfg.block]
        kernels, linears = kernels - dense_k + mc.kernels, linears - dense_l + mc.linears
    ov = hw.op_overhead
    fwd = fwd_gemm + attn_fwd + mem_fwd + kernels * ov
    bwd_input = bwd_in_gemm + attn_bwd + mem_bwd + kernels * ov
    bwd_w_gemm += linears * ov + mem_w

    # Tensor-parallel collectives: 2 per direction (all-reduce, or all-gather +
    # reduce-scatter with sequence parallelism), each of T h bytes-per-element: the
    # entries (f) in the residual stream's dtype r, the exits (g) in e (``residual_bytes``).
    fwd_tp = bwd_tp = 0.0
    down_exit = 0.0  # of fwd_tp, the MLP's exit (after its down projection)
    if t > 1:
        link = group_link(hw, t, 1)
        nbytes, rbytes = T * h * e, T * h * residual_bytes(layout)
        if sp:
            ag, rs = all_gather_time(rbytes, t, link), reduce_scatter_time(nbytes, t, link)
            rs_in, ag_out = reduce_scatter_time(rbytes, t, link), all_gather_time(nbytes, t, link)
            down_exit = hidden_behind(rs, lin[3][0], hw) if runtime.overlap_tp_comm else rs
            if runtime.overlap_tp_comm:  # each hides behind the GEMM next to it
                fwd_tp = sum(
                    hidden_behind(c, g, hw)
                    for c, g in ((ag, lin[0][0]), (rs, lin[1][0]), (ag, lin[2][0]), (rs, lin[3][0]))
                )
                bwd_tp = sum(
                    hidden_behind(c, g, hw)
                    for c, g in ((rs_in, lin[0][1]), (ag_out, lin[1][1]), (rs_in, lin[2][1]),
                                 (ag_out, lin[3][1]))
                )  # fmt: skip
            elif runtime.overlap_tp_grad:  # the column-parallel linears' (qkv, up)
                fwd_tp = 2 * (ag + rs)
                bwd_tp = 2 * ag_out + sum(
                    hidden_behind(ag, lin[i][1], hw) + hidden_behind(rs_in, lin[i][2], hw)
                    for i in (0, 2)
                )
            else:  # and each column group's input gathered again (its ops kept the shard)
                fwd_tp, bwd_tp = 2 * (ag + rs), 2 * (rs_in + ag_out)
                if layout.recompute != "full":  # full: the recomputed forward gathers it
                    again = all_gather_time(nbytes, t, link)
                    if runtime.prefetch_sp_regather:  # behind the exit's GEMMs (and the core's)
                        bwd_tp += hidden_behind(again, lin[1][1] + lin[1][2] + attn_bwd, hw)
                        bwd_tp += hidden_behind(again, lin[3][1] + lin[3][2], hw)
                    else:
                        bwd_tp += 2 * again
        else:
            down_exit = all_reduce_time(nbytes, t, link)
            fwd_tp = 2 * down_exit
            ar = all_reduce_time(rbytes, t, link)  # a column-parallel linear's input gradient
            if runtime.overlap_tp_grad:  # beside that linear's weight-gradient GEMM
                bwd_tp = sum(hidden_behind(ar, lin[i][2], hw) for i in (0, 2))
            else:
                bwd_tp = 2 * ar

    fwd_cp, bwd_cp = cp_sim.layer_comm(replace(cfg, seq_len=s), layout, hw, attn_fwd, attn_bwd)
    fwd_ep = bwd_ep = 0.0
    if moe:
        fwd_ep, bwd_ep = ep_sim.layer_comm(replace(cfg, seq_len=s), layout, hw,
                                           runtime.moe_imbalance)  # fmt: skip
    gemm = fwd_gemm + bwd_in_gemm + bwd_w_gemm - linears * ov - mem_w
    attn, mem = attn_fwd + attn_bwd, mem_fwd + mem_bwd + mem_w
    launch = (2 * kernels + linears) * ov
    if layout.recompute == "full":
        # stopping at the last saved tensor (``Runtime.recompute_stops_early``) leaves out
        # what follows it, unless dropout after the MLP saves its mask last: the MLP's exit
        # and a dense block's down projection; a MoE block's routed experts all run again
        # (their combine saves their outputs) but not the shared experts' down, after it
        skip, skip_tp = 0.0, 0.0
        if runtime.recompute_stops_early and not cfg.dropout:
            skip = lin[3][0] if mc is None else mc.shared_down
            skip_tp = down_exit
        recompute, recompute_tp = fwd - skip, fwd_tp - skip_tp
        bwd_cp += fwd_cp  # the recomputed forward exchanges again
        bwd_ep += fwd_ep
        gemm, attn, mem, launch = (
            gemm + fwd_gemm - skip,
            attn + attn_fwd,
            mem + mem_fwd,
            launch + kernels * ov,
        )
    elif layout.recompute == "selective":
        recompute, recompute_tp = attn_re, 0.0
        bwd_cp += fwd_cp  # the attention core, cp exchange included, runs again
        attn += attn_re
    else:
        recompute, recompute_tp = 0.0, 0.0
    kinds = (("gemm", gemm), ("attention", attn), ("memory", mem), ("launch", launch))
    return LayerCost(fwd, fwd_tp, bwd_input, bwd_w_gemm, bwd_tp, recompute, recompute_tp,
                     fwd_cp, bwd_cp, fwd_ep, bwd_ep, kinds)  # fmt: skip


# -- embedding, head and loss --------------------------------------------------------------


@dataclass(frozen=True)
class EndCost:
    """Extra seconds of the first stage (embedding) or the last (final norm, head, loss)."""

    fwd: float = 0.0
    fwd_tp: float = 0.0
    bwd_input: float = 0.0
    bwd_weight: float = 0.0
    bwd_tp: float = 0.0
    kinds: tuple[tuple[str, float], ...] = ()  # as ``LayerCost.kinds``


def embedding_cost(cfg: ModelConfig, layout: Layout, hw: Hardware) -> EndCost:
    T, e, t = layout.micro_batch_size * cfg.seq_len // layout.cp, ACT_BYTES[layout.dtype], layout.tp
    h = cfg.hidden
    k_fwd, k_bwd = END_KERNELS["embedding"]
    fwd = stream_time(hw, 3 * T * h * e) + k_fwd * hw.op_overhead  # gather rows (+ positions)
    bwd = stream_time(hw, T * h * (e + 8)) + k_bwd * hw.op_overhead  # scatter-add, fp32 grad
    fwd_tp = 0.0
    if t > 1:  # vocab-parallel lookup: partial rows summed across tp, in the stream's dtype
        link, nbytes = group_link(hw, t, 1), T * h * residual_bytes(layout)
        if layout.sequence_parallel:
            fwd_tp = reduce_scatter_time(nbytes, t, link)
        else:
            fwd_tp = all_reduce_time(nbytes, t, link)
    launch = (k_fwd + k_bwd) * hw.op_overhead
    kinds = (("memory", fwd + bwd - launch), ("launch", launch))
    return EndCost(fwd=fwd, fwd_tp=fwd_tp, bwd_weight=bwd, kinds=kinds)


def loss_bytes_per_logit(e: int, unfused_fp32: bool, kernels: str = "fused",
                         tp: int = 1) -> tuple[int, int]:  # fmt: skip
    """(forward, backward) bytes the cross-entropy streams per logit of e bytes. Fused: read
    the logits, write fp32 log-probabilities and reduce them (e + 8); backward reads those
    and writes the logits' gradient (4 + e). ``unfused_fp32``, Megatron's
    ``vocab_parallel_cross_entropy`` on logits cast to fp32 first: the cast (e + 4), the
    max (4), subtracting it (8), exp in place (8), the sum (4), dividing by it in place
    (8) -- e + 36 -- and backward multiplying the saved softmax by the loss gradient in
    place (8) and casting back (4 + e): e + 12. 52 bytes a bf16 logit against 16: at a
    131,072 vocabulary and 4,096 tokens, 19 GB more a micro-batch. ``kernels`` "plait" and
    "eager" (``Runtime.layer_kernels``), PyTorch's ``cross_entropy`` as log-softmax then
    the negative log-likelihood on logits cast to fp32 (plait's code; llm-foundry's loss
    under autocast, torchtitan's ``.float()``; counted on fake tensors for the model of
    ``benchmarks/fsdp_step.py``, whose step a GPU profile timed): the cast (e + 4, none in
    fp32), log-softmax (8), and backward the negative log-likelihood's zeroed gradient
    (4), log-softmax's backward (12) and the cast back (4 + e). ``kernels`` "plait" with
    bf16 / fp16 logits, or over tp ranks: plait's own vocab-parallel loss
    (``tensor.vocab_parallel_cross_entropy``), Megatron's passes; on fp32 logits over tp
    without the cast and subtracting into a new buffer: 32 and 8."""
    if unfused_fp32 or (kernels == "plait" and e < 4):
        return e + 36, e + 12
    if kernels == "plait" and tp > 1:
        return 32, 8
    if kernels in ("plait", "eager"):
        cast = e + 4 if e < 4 else 0
        return cast + 8, 16 + cast
    return e + 8, 4 + e


def head_cost(
    cfg: ModelConfig, layout: Layout, hw: Hardware, runtime: Runtime | None = None
) -> EndCost:
    """The final norm, the head's GEMMs and the loss over T x V/t logits; ``runtime``
    says how the loss runs (``Runtime.unfused_fp32_loss``; None: one fused pass)."""
    T, e, t = layout.micro_batch_size * cfg.seq_len // layout.cp, ACT_BYTES[layout.dtype], layout.tp
    h, V_t = cfg.hidden, cfg.vocab_size / t
    dtype = layout.dtype
    f, bi, bw = linear_times(hw, dtype, T, V_t, h)
    norm = stream_time(hw, 2 * T * h * e)
    fwd_bytes, bwd_bytes = loss_bytes_per_logit(
        e,
        runtime is not None and runtime.unfused_fp32_loss,
        runtime.layer_kernels if runtime is not None else "fused",
        t,
    )
    loss_fwd = stream_time(hw, T * V_t * fwd_bytes)
    loss_bwd = stream_time(hw, T * V_t * bwd_bytes)
    fwd_tp = bwd_tp = 0.0
    if t > 1:  # the final norm's output (the stream's dtype) enters the head
        link, nbytes = group_link(hw, t, 1), T * h * residual_bytes(layout)
        # vocab-parallel cross-entropy: the max (T floats), then the sum of exponentials
        # and the target logit together (2 T floats)
        fwd_tp = all_reduce_time(4 * T, t, link) + all_reduce_time(8 * T, t, link)
        if layout.sequence_parallel:  # gathered forward, and again backward (the shard kept)
            fwd_tp += all_gather_time(nbytes, t, link)
            bwd_tp = reduce_scatter_time(nbytes, t, link)
            again = all_gather_time(T * h * e, t, link)
            if runtime is not None and (runtime.overlap_tp_grad or runtime.overlap_tp_comm):
                again = hidden_behind(again, bi, hw)  # beside the input gradient's GEMM
            bwd_tp += again
        else:
            bwd_tp = all_reduce_time(nbytes, t, link)
    k_fwd, k_bwd = END_KERNELS["head"]
    kinds = (("gemm", f + bi + bw), ("memory", 3 * norm + loss_fwd + loss_bwd),
             ("launch", (k_fwd + k_bwd) * hw.op_overhead))  # fmt: skip
    return EndCost(
        fwd=f + norm + loss_fwd + k_fwd * hw.op_overhead,
        fwd_tp=fwd_tp,
        bwd_input=bi + 2 * norm + loss_bwd + k_bwd * hw.op_overhead,
        bwd_weight=bw,
        bwd_tp=bwd_tp,
        kinds=kinds,
    )


# -- pipeline -----------------------------------------------------------------------------


def pp_message_time(cfg: ModelConfig, layout: Layout, hw: Hardware, link: Link | None) -> float:
    """One activation (or its gradient) between consecutive stages: each tp rank sends its
    1/t slice over ``link`` (per device) and, without sequence parallelism, the receiver
    all-gathers the slices over NVLink -- Megatron-LM's scatter / gather (Narayanan et al.
    2021), plait's, and DeepSpeed's pipeline engine's (Megatron-DeepSpeed: its
    ``PartitionedTensor`` over the tp group, ``is_pipe_partitioned`` on whenever tp > 1,
    ``runtime/pipe/engine.py`` at a773996d9, 2022-03)."""
    t = layout.tp
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    nbytes = tokens * cfg.hidden * ACT_BYTES[layout.dtype]
    time = p2p_time(nbytes / t, link)
    if t > 1 and not layout.sequence_parallel:
        time += all_gather_time(nbytes, t, group_link(hw, t, 1))
    return time


def pp_boundary_link(hw: Hardware, layout: Layout, rank: int, peer: int) -> Link | None:
    """Link between pipeline ranks ``rank`` and ``peer`` (rank order pp, dp, cp, tp)."""
    if rank == peer:
        return None
    block = layout.dp * layout.cp * layout.tp  # global ranks per pipeline rank
    lo, hi = min(rank, peer), max(rank, peer)
    dpn = hw.devices_per_node
    # every global rank from the first of pipeline rank lo to the last of hi in one node?
    if (lo * block) // dpn == ((hi + 1) * block - 1) // dpn:
        return hw.intra_node
    return hw.inter_node


# -- data parallelism, ZeRO, optimizer ------------------------------------------------------


def grad_ranks(layout: Layout, experts: bool = False) -> int:
    """Ranks a gradient is reduced over: dp x cp (the cp ranks of a dp rank hold the same
    weights and different tokens; ``Topology.grad_view``). cp sits right after dp in the
    rank order, so the group is one contiguous axis of stride tp. ``experts``: a routed
    expert's, over the edp = dp / ep ranks that hold it (``sim/expert.py``)."""
    if experts:
        return layout.dp // layout.ep * layout.cp
    return layout.dp * layout.cp


def grad_stride(layout: Layout, experts: bool = False) -> int:
    """Rank distance between members of the ``grad_ranks`` group: tp; ep cp tp for the
    experts' edp group (the ep ranks are consecutive dp ranks)."""
    return layout.tp * (layout.ep * layout.cp if experts else 1)


def dp_groups(layout: Layout, experts: bool = False) -> tuple[int, int]:
    """(shard group size, replicas across shard groups) of the dp x cp axis the
    data-parallel engines see (``grad_ranks``). Expert state shards over its whole edp
    group (``--zero-shard-group`` where it divides it)."""
    dp = grad_ranks(layout, experts)
    if experts:
        group = layout.zero_shard_group
        shard = (group if group and dp % group == 0 else dp) if layout.zero else 1
        return shard, dp // shard
    shard = layout.zero_shard_group or dp if layout.zero else 1
    return shard, dp // shard


def grad_buckets(params: float, layers: int, layout: Layout, runtime: Runtime) -> int:
    """The buckets an overlapped gradient reduction of ``params`` weights streams in: of
    the runtime's size (the layout's ``--bucket-mb`` under ``bucket_from_layout``), or
    one per layer of ``layers`` where the runtime has none."""
    bucket = layout.bucket_mb * 2**20 if runtime.bucket_from_layout else runtime.grad_bucket_bytes
    if not bucket:
        return layers
    return math.ceil(params * runtime.grad_comm_bytes(layout.dtype) / bucket)


def dp_comm_time(
    params: float, layout: Layout, hw: Hardware, runtime: Runtime, experts: bool = False
) -> dict:
    """Seconds of the once-per-step data-parallel communication of ``params`` weights.

    ZeRO 0: all-reduce the gradients. ZeRO 1/2: reduce-scatter them over the shard group
    (all-reduce the shard across replicas for HSDP; a ``zero1_grad_all_reduce`` runtime
    all-reduces them whole at stage 1), all-gather the updated weights after the step,
    with the copies that pack this rank's shards into the message and unpack the gathered
    row into the weights (streamed at the elementwise rate). ZeRO 3 does its
    communication per layer and micro-batch instead (``zero_layer_comm``); only the HSDP
    replica all-reduce is left here.
    With cp the data-parallel axis is dp x cp (``grad_ranks``); ``experts``: routed expert
    weights over their edp group.
    Returns {"grad": s, "param": s}.
    """
    dp, t = grad_ranks(layout, experts), grad_stride(layout, experts)
    if dp <= 1:
        return {"grad": 0.0, "param": 0.0}
    gbytes = params * runtime.grad_comm_bytes(layout.dtype)
    pbytes = params * runtime.state_bytes(layout.dtype)[0]  # stored weights (traffic.py)
    if layout.zero == 0:
        return {"grad": all_reduce_time(gbytes, dp, group_link(hw, dp, t)), "param": 0.0}
    shard, replicas = dp_groups(layout, experts)
    shard_link = group_link(hw, shard, t)
    replica_link = group_link(hw, replicas, t * shard)
    across = all_reduce_time(gbytes / shard, replicas, replica_link)
    if layout.zero == 3:
        return {"grad": across, "param": 0.0}
    if layout.zero == 1 and runtime.zero1_all_reduce(layout.dtype):
        grad = all_reduce_time(gbytes, dp, group_link(hw, dp, t))
    elif layout.zero == 2 and runtime.zero2_reduce_per_microbatch:  # in the layers' steps
        grad = across
    else:
        grad = reduce_scatter_time(gbytes, shard, shard_link) + across
    copies = stream_time(hw, 2 * pbytes * (1 + 1 / shard))  # pack the shards, unpack the row
    return {"grad": grad, "param": all_gather_time(pbytes, shard, shard_link) + copies}


def zero_layer_comm(
    cfg: ModelConfig,
    layer_params: float,
    layout: Layout,
    hw: Hardware,
    runtime: Runtime,
    experts: bool = False,
) -> tuple[float, float]:
    """(forward, backward) seconds of ZeRO's per-layer traffic in one micro-batch. ZeRO-3:
    gather the weights before the forward, again before the backward (and once more for a
    recomputed forward where the runtime re-gathers), reduce-scatter the gradients after
    it (every micro-batch, or only in the last where the runtime accumulates them
    unsharded: then 1/m of it per micro-batch), over the shard group. ZeRO-2 under
    ``zero2_reduce_per_microbatch``: that reduce-scatter alone (``dp_comm_time`` keeps the
    gather after the step); else nothing (``dp_comm_time`` has it all).

    A runtime that gathers per parameter tensor pays the ring latency once per tensor
    (``collectives.ring_latency``: milliseconds at thousands of ranks), and one that
    gathers into a list of per-rank outputs launches one copy kernel per rank
    (``Hardware.kernel_launch``). ``experts``: a MoE layer's routed experts, over their edp
    shard group."""
    per_microbatch = layout.zero == 2 and runtime.zero2_reduce_per_microbatch
    if (layout.zero != 3 and not per_microbatch) or layer_params <= 0:
        return 0.0, 0.0
    shard, _ = dp_groups(layout, experts)
    link = group_link(hw, shard, grad_stride(layout, experts))
    calls = layer_tensors(cfg, runtime) if runtime.zero3_gather_per_tensor else 1

    def collective(nbytes: float, op: str) -> float:
        t = all_gather_time(nbytes, shard, link, op) + (calls - 1) * ring_latency(shard, link, op)
        if runtime.gather_list_outputs and shard > 1:
            t += calls * shard * hw.launch_s
        return t

    rs = collective(layer_params * runtime.grad_comm_bytes(layout.dtype), "reduce_scatter")
    if per_microbatch:
        return 0.0, rs
    ag = collective(layer_params * runtime.param_comm_bytes(layout.dtype), "all_gather")
    if not runtime.zero3_reduce_per_microbatch:
        rs /= layout.num_microbatches
    regather = layout.recompute == "full" and runtime.zero3_regather_recompute
    return ag, ag * (2 if regather else 1) + rs


def layer_tensors(cfg: ModelConfig, runtime: Runtime) -> int:
    """Parameter tensors of one block: plait's model (``LAYER_TENSORS``, separate q, k, v)
    or the fused-QKV blocks of the other runtimes (``FUSED_LAYER_TENSORS``)."""
    if runtime.name == "plait":
        return sizes.layer_tensors(cfg)
    # qwen2: one fused q/k/v bias; qwen3: the q and k norms
    return FUSED_LAYER_TENSORS[cfg.block] + (1 if cfg.qkv_bias else 0) + (2 if cfg.qk_norm else 0)


def stage_tensors(
    cfg: ModelConfig, layers: int, first: bool, last: bool, moe_layers: int = 0
) -> int:
    """Parameter tensors one rank holds for a virtual stage of ``layers`` blocks (as
    ``memory.stage_params``: the first stage has the token (and gpt2 position) embedding,
    the last the final norm and the head or its tied copy). A MoE block adds its router
    and, with shared experts, their stack (the routed stack has the dense MLP's count)."""
    n = layers * sizes.layer_tensors(cfg)
    if moe_layers:
        stack = (4 if cfg.block == "gpt2" else 3) if cfg.moe_shared_experts else 0
        n += moe_layers * (1 + stack)
    if first:
        n += 2 if cfg.arch == "gpt2" else 1
    if last:
        n += 2 if cfg.arch == "gpt2" else 1
        if not cfg.tied_embeddings or not first:
            n += 1
    return n


def optimizer_time(
    params: float,
    layout: Layout,
    hw: Hardware,
    runtime: Runtime,
    tensors: int = 0,
    experts: float = 0.0,
) -> float:
    """AdamW over this rank's shard of ``params`` in ``tensors`` parameter tensors:
    memory-bound. Fused Adam reads weight, gradient and both moments (fp32) and writes
    weight and moments (28 bytes; ``Runtime.adamw_bytes`` for unfused ones), clipping
    reads the gradient once more and zeroing writes it; master-weight runtimes also write
    the low-precision copy. Each tensor adds ``hw.optimizer_tensor_overhead`` (every rank
    holds a shard of every tensor under ZeRO, so the count does not shrink with dp).
    Offloaded: gradients down and weights up over PCIe, Adam on the host at its share of
    host memory bandwidth. ``experts``: routed expert weights, sharded over their edp
    group."""
    w_bytes, g_bytes, _ = runtime.state_bytes(layout.dtype)
    shard, _ = dp_groups(layout)
    n = params / shard + (experts / dp_groups(layout, True)[0] if experts else 0.0)
    per_param = runtime.adamw_bytes + 2 * g_bytes + (w_bytes if w_bytes < 4 else 0)
    fixed = tensors * hw.optimizer_tensor_overhead
    if layout.offload_optimizer:
        pcie = n * (g_bytes + w_bytes) / hw.pcie_bandwidth
        host = n * per_param / (hw.host_memory_bandwidth / hw.devices_per_node)
        return pcie + host + fixed
    return stream_time(hw, n * per_param) + fixed


def flops_per_step(
    cfg: ModelConfig, layout: Layout, stage_layers: list[int] | None = None
) -> tuple[float, float]:
    """(model, hardware) FLOPs of one optimizer step over all devices (``sizes.py``);
    under ``--recompute-layers`` the blocks that recompute of virtual stages of
    ``stage_layers`` layers (``Layout.recomputed_share``)."""
    tokens = layout.global_batch_size * cfg.seq_len
    share = layout.recomputed_share(cfg.n_layers, stage_layers)
    return (
        tokens * sizes.model_flops_per_token(cfg),
        tokens
        * sizes.hardware_flops_per_token(
            cfg, recompute=layout.recompute, recomputed_share=share
        ),  # fmt: skip
    )
