"""Context parallelism in the performance model: what a cp ring of N ranks moves, holds and
hides per attention layer (the exchanges themselves: ``parallel/context.py``).

Letters as ``costs.py``, per tp rank and micro-batch of b sequences of s tokens: N = cp,
H query heads and K key/value heads of the tp rank (K replicated up to 1 when fewer than
tp), D head size, h = H D, k = K D, e bytes per activation element; each cp rank holds
s / N tokens of every sequence (two head-tail chunks of c = s / 2N).

Bytes per layer (``layer_bytes``), the formulas of ``parallel/context.py``'s docstring;
"counted" as ``comm.py`` counts a call (a collective's larger buffer; a p2p batch's send
and receive both), "sent" what one rank puts on the wire (the K/V gradients travel in
fp32, 4 bytes):

    ring       fwd sent (N-1) 2 b s k e / N                 counted twice that
               bwd sent (N-1) 2 b s k e / N + 2 b s k 4     counted twice that
    allgather  fwd counted 2 b s k e                        sent (N-1)/N of it
               bwd counted 2 b s k e + 2 b s k 4            sent (N-1)/N of it
    a2a        fwd counted b s ((h + 2k) e + h e + 4 H) / N  sent (N-1)/N of it
               bwd counted b s (h e + (h + 2k) e) / N        sent (N-1)/N of it

The a2a backward has no log-sum-exp gradient to send: the model uses the output only
(``context_attention(...)[0]``), so autograd hands the layer no dLSE.

Time (``layer_comm``), on the cp ring's link (``link``: the cp ranks of a tp rank are tp
apart in the rank order, so the ring stays in one node while tp x cp <= devices per node):

- ``ring``: the forward is N-1 steps, each a K/V block of 2 b (s/N) k e to the next rank
  while this rank attends to the block it holds; the backward N-1 steps that carry the K/V
  block and its fp32 dK/dV accumulator together, and a last hop of the accumulator home.
  Assumed: a step's message hides behind that step's attention block (1/N of the layer's
  attention core, which head-tail makes equal on every rank), and nothing else -- the
  exchange lives inside the attention function, and the next GEMM needs its output; so
  exposed = (N-1) max(0, message - block) forward, (N-1) max(0, messages - block) + the
  last hop backward. The runtime posts each batch before the block and waits after it
  (``ring_program``), which is what lets them overlap on NCCL's separate stream; on gloo
  the CPU does both at once and the model still charges only what outlasts the block.
- ``allgather``: the all-gather must end before any query attends, the reduce-scatter
  starts after the last block: nothing hidden. Forward one all-gather; backward the
  all-gather again and the reduce-scatter.
- ``a2a``: all-to-alls before and after the attention, nothing hidden; an all-to-all of
  X counted bytes takes (N-1) latency + (N-1)/N X / bandwidth (``all_to_all_time``).

Attention work per rank (``score_blocks``): fused kernels (``math_attention`` False:
Transformer Engine, and plait's ``context.attend`` on CUDA's flash / efficient kernels)
skip the masked half, so every rank does 1/N of the causal work (head-tail balances it).
Math attention in fp32 (plait's document-masked blocks, ``Runtime.cp_document_math``, or a
runtime with ``cp_math_attention``) materialises the scores of the chunks it computes: ring and allgather (2N+1) c x c blocks per head (a query chunk
against the chunks before it and its own, ``context.attention_work``); a2a the whole
s x s for H / N heads (no chunk is skipped).

Memory (``buffer_bytes``): the activations kept for the backward are those of s / N tokens
(the cp functions save Q, K, V, out and the fp32 log-sum-exp, never scores; memory.py
uses ``sizes.activation_bytes_per_layer`` at s / N with fused attention's accounting).
While one layer runs, each mode also holds (transient, the largest of forward and
backward): ring the K/V block arriving beside the one attended to, 2 x 2 b (s/N) k e,
and in the backward also the fp32 dK/dV accumulator arriving beside the one added to,
2 x 2 b (s/N) k 4; allgather the whole sequence's K/V, 2 b s k e, and in the backward its
fp32 gradient before the reduce-scatter, 2 b s k 4; a2a the head-sharded Q/K/V and output
(b s (h + 2k + h) e / N) and their gradients in fp32 (x 4 / e). Without fused attention
also the fp32 scores, probabilities and score gradient of the largest block (3 x 4 bytes
per element): ring and allgather compute one query chunk at a time.

Checked: ``layer_bytes`` equals what ``comm.py`` counts and sends for every mode at cp 4
under gloo (tests/test_sim_context.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.sim.collectives import (
    all_gather_time,
    group_link,
    hidden_behind,
    p2p_time,
    reduce_scatter_time,
)
from plait.sim.hardware import Hardware, Link

FP32 = 4


def act_bytes(layout: Layout) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}[layout.dtype]


def local_seq(cfg: ModelConfig, layout: Layout) -> int:
    """Tokens of each sequence one cp rank holds: s / cp."""
    return cfg.seq_len // layout.cp


def widths(cfg: ModelConfig, layout: Layout) -> tuple[float, float, float]:
    """(H, h, k) of one tp rank: query heads, their width, the key/value width."""
    H = cfg.n_heads / layout.tp
    K = max(cfg.n_kv_heads / layout.tp, 1.0)
    return H, H * cfg.head_dim, K * cfg.head_dim


@dataclass(frozen=True)
class LayerBytes:
    """One attention layer and micro-batch on one rank (module docstring)."""

    fwd_counted: float = 0.0
    bwd_counted: float = 0.0
    fwd_sent: float = 0.0
    bwd_sent: float = 0.0

    @property
    def counted(self) -> float:
        return self.fwd_counted + self.bwd_counted

    @property
    def sent(self) -> float:
        return self.fwd_sent + self.bwd_sent


def layer_bytes(cfg: ModelConfig, layout: Layout) -> LayerBytes:
    """Bytes of the cp exchanges of one layer and micro-batch (module docstring)."""
    N = layout.cp
    if N == 1:
        return LayerBytes()
    b, s, e = layout.micro_batch_size, cfg.seq_len, act_bytes(layout)
    H, h, k = widths(cfg, layout)
    frac = (N - 1) / N
    if layout.cp_mode == "ring":
        kv = frac * 2 * b * s * k * e
        bwd = kv + 2 * b * s * k * FP32
        return LayerBytes(2 * kv, 2 * bwd, kv, bwd)  # send and receive both counted
    if layout.cp_mode == "allgather":
        kv = 2 * b * s * k * e
        bwd = kv + 2 * b * s * k * FP32
        return LayerBytes(kv, bwd, frac * kv, frac * bwd)
    fwd = b * s * ((h + 2 * k) * e + h * e + H * FP32) / N  # a2a: Q/K/V, out, LSE
    bwd = b * s * (h * e + (h + 2 * k) * e) / N  # dO, then dQ/dK/dV
    return LayerBytes(fwd, bwd, frac * fwd, frac * bwd)


def link(hw: Hardware, layout: Layout) -> Link | None:
    """The cp ring's link: N ranks, tp apart (cp sits between dp and tp)."""
    return group_link(hw, layout.cp, layout.tp)


def all_to_all_time(nbytes: float, n: int, lk: Link | None) -> float:
    """An all-to-all of ``nbytes`` counted bytes per rank: (n-1)/n of them leave, n-1
    messages (pairwise exchange)."""
    if n == 1 or lk is None:
        return 0.0
    return (n - 1) * lk.latency + (n - 1) / n * nbytes / lk.bandwidth


def layer_comm(
    cfg: ModelConfig, layout: Layout, hw: Hardware, attn_fwd: float, attn_bwd: float
) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one layer's cp exchanges, given the layer's
    attention-core seconds on this rank (the ring hides behind them; module docstring)."""
    N = layout.cp
    if N == 1:
        return 0.0, 0.0
    lk = link(hw, layout)
    b, s, e = layout.micro_batch_size, cfg.seq_len, act_bytes(layout)
    _, _, k = widths(cfg, layout)
    if layout.cp_mode == "ring":
        kv = p2p_time(2 * b * s / N * k * e, lk)
        dkv = p2p_time(2 * b * s / N * k * FP32, lk)
        fwd = (N - 1) * hidden_behind(kv, attn_fwd / N, hw)
        bwd = (N - 1) * hidden_behind(kv + dkv, attn_bwd / N, hw) + dkv
        return fwd, bwd
    nb = layer_bytes(cfg, layout)
    if layout.cp_mode == "allgather":
        kv = 2 * b * s * k * e
        ag = all_gather_time(kv, N, lk)
        return ag, ag + reduce_scatter_time(2 * b * s * k * FP32, N, lk)
    return all_to_all_time(nb.fwd_counted, N, lk), all_to_all_time(nb.bwd_counted, N, lk)


def math_attention(layout: Layout, runtime) -> bool:
    """Whether the cp attention blocks of ``layout`` run as math attention under
    ``runtime`` (a ``sim.runtime.Runtime``) rather than as fused kernels."""
    if layout.cp <= 1:
        return False
    docs = layout.document_mask and runtime.cp_document_math
    return runtime.cp_math_attention or not runtime.flash_attention or docs


def score_blocks(cfg: ModelConfig, layout: Layout) -> tuple[float, float, float]:
    """(rows, columns, count) of the score blocks one rank's math attention computes per
    layer and micro-batch, heads included (module docstring)."""
    N, b, s = layout.cp, layout.micro_batch_size, cfg.seq_len
    H = cfg.n_heads / layout.tp
    if N == 1:
        return s, s, b * H
    if layout.cp_mode == "a2a":
        return s, s, b * H / N
    c = s / (2 * N)
    return c, c, b * H * (2 * N + 1)


def buffer_bytes(cfg: ModelConfig, layout: Layout, flash_attention: bool) -> float:
    """Transient bytes one layer's cp attention holds while it runs (module docstring)."""
    N = layout.cp
    if N == 1:
        return 0.0
    b, s, e = layout.micro_batch_size, cfg.seq_len, act_bytes(layout)
    H, h, k = widths(cfg, layout)
    if layout.cp_mode == "ring":
        held = 2 * 2 * b * s / N * k * (e + FP32)
        block = b * H * (s / (2 * N)) * (s / N)  # a query chunk against a block of two
    elif layout.cp_mode == "allgather":
        held = 2 * b * s * k * (e + FP32)
        block = b * H * (s / (2 * N)) * s  # the last chunk against the whole sequence
    else:
        held = b * s * (2 * h + 2 * k) / N * (e + FP32)
        block = b * H / N * s * s
    return held + (0.0 if flash_attention else 3 * FP32 * block)


def backward_buffer_bytes(cfg: ModelConfig, layout: Layout, flash_attention: bool) -> float:
    """Transient bytes one layer's cp attention holds at its backward's fullest, the fused
    kernels' path. Ring (``parallel/context.py``'s ``_RingAttention.backward``): the
    incoming output gradient (T x h, the activation dtype) and the fp32 query gradient;
    the K/V block held (and the next one arriving, from a ring of three on) and three
    fp32 dK/dV pairs (this step's, the accumulator and the one arriving); and within it the
    largest kernel call, a query chunk of T / 2 against a block of T keys: its query,
    output gradient and output copied (T / 2 x h each), fp32 gradients of its queries and,
    at the queries' heads, of its keys and values, the kernel's three outputs, and the
    K/V repeated to the queries' heads where heads are grouped, and the fp32 dK and dV
    summed back over those heads. T = b s / N, h and k the
    query and key widths of a tp rank. ``plait rehearse`` of a llama layer (h 2048, 16
    heads, s 2048, cp 2) held 13.6 x T h fp32 there against this 13. Allgather
    (``_AllGatherAttention.backward``): the output gradient, the fp32 query gradient, every
    rank's K/V gathered and their fp32 gradient, and the last query chunk's call against
    all N T keys -- its query, output gradient and output copied, fp32 gradients of its
    queries and, at the queries' heads, of every key and value, the kernel's outputs for
    the keys before the diagonal and for the diagonal's, whose K/V are copied out (or, if
    more, the reduce-scatter's pieces of the fp32 K/V gradient); 0.129 GiB rehearsed there
    against this 0.123 at h 2048, cp 2. All-to-all keeps ``buffer_bytes`` (the forward's)."""
    N = layout.cp
    if N == 1 or layout.cp_mode not in ("ring", "allgather") or not flash_attention:
        return buffer_bytes(cfg, layout, flash_attention)
    b, e = layout.micro_batch_size, act_bytes(layout)
    T = b * cfg.seq_len / N
    H, h, k = widths(cfg, layout)
    if layout.cp_mode == "allgather":
        Tk, c = N * T, T / 2  # every key; the queries of a chunk
        kr = h if k < h else k  # the keys' width as the kernel takes them (heads repeated)
        base = T * h * (e + FP32) + 2 * Tk * k * (e + FP32)
        call = (c * h * (7 * e + FP32) + Tk * h * (2 * FP32 + 2 * e) - 2 * c * h * e
                + 2 * c * kr * e + (2 * Tk * h * e if k < h else 0.0))  # fmt: skip
        pieces = T * h * (e + FP32) + 3 * 2 * Tk * k * FP32
        return max(base + call, pieces, buffer_bytes(cfg, layout, flash_attention))
    pairs = 1 if N == 2 else 2
    ring = T * (h * (e + FP32) + k * (pairs * 2 * e + 3 * 2 * FP32))
    # grouped heads: the K/V repeated to the queries' heads, and the fp32 dK, dV summed
    # back over them (both held as the second sum is made: ``_attend_backward_fused``)
    grouped = 2 * T * h * e + 2 * T * k * FP32 if k < h else 0.0
    call = T * h * (e / 2 + e + FP32 / 2 + 2 * FP32 + e / 2 + 2 * e) + grouped
    return max(ring + call, buffer_bytes(cfg, layout, flash_attention))
