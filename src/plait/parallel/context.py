"""Context parallelism: one attention layer over a sequence split across the N ranks of a cp
ring (issue 27). This module is the attention itself, its sequence split and its
exchanges (tested alone and in training runs: tests/test_context.py); the model calls it
from its attention layer when ``topo.cp`` > 1 (``model/transformer.py``) and ``plait train
--cp N --cp-mode ring|allgather|a2a`` sets the ring up.

Communication (axis: the cp ring of N ranks; per attention layer and micro-batch of b
sequences of s tokens; h = query heads x head size, k = key/value heads x head size, e bytes
per activation element; "counted" as ``comm.py`` counts, "sent" the bytes one rank puts on
the wire; the K/V gradients travel in fp32, 4 bytes):

- ``ring``: forward N-1 batches, each [send this K/V block to the next rank, receive the
  previous rank's]: one message of 2 b (s/N) k e, sent (N-1) 2 b s k e / N in all, each
  batch in flight while the rank attends to the block it holds. Backward: N-1 such K/V
  batches again (each block is attended to again) and N batches that carry the block's
  fp32 dK/dV accumulator one rank on, the N-th back to the block's owner:
  sent (N-1) 2 b s k e / N + 2 b s k 4.
- ``allgather``: forward one all-gather of K/V (counted 2 b s k e, sent (N-1)/N of it);
  backward the same all-gather again (the whole sequence's K/V is not kept between forward
  and backward: at 128k tokens it would be 2 b s k e per layer, N times the shard) and one
  reduce-scatter of the fp32 dK/dV (counted 2 b s k 4, sent (N-1)/N of it). Holds the
  whole sequence's K/V while the layer runs: cheap with few key/value heads (GQA).
- ``a2a`` (Ulysses): forward an all-to-all of Q/K/V from sequence-sharded to head-sharded
  (counted b s (h + 2k) e / N), one of the output back (b s h e / N) and one of the
  log-sum-exp (b s H 4 / N, H query heads); backward the same three in the other direction
  (dO, dLSE, then dQ/dK/dV). Sent: (N-1)/N of each. Needs N to divide the query heads and
  the key/value heads.
- nothing with N == 1.

Why none can deadlock under NCCL's rules: ``allgather`` and ``a2a`` issue collectives on
the ring's group from the autograd thread, the same calls in the same order on every rank
(the layer's shapes are the same everywhere). ``ring`` runs a program that is data
(``ring_program``): every batch holds its send and its receive together (the messages
cross: rank i sends to i+1 while i-1 sends to i), every rank posts the same batches in the
same order, and tests/test_context.py resolves the programs of N = 2..8 ranks under
``nccl_p2p``'s model of NCCL (the one ``schedules.validate`` uses).

The sequence split (head-tail, or zig-zag): the sequence is cut into 2N chunks of
c = s / 2N tokens and cp rank r holds chunks r and 2N-1-r. Under the causal mask a rank
holding an early chunk also holds a late one, so every rank attends to the same number of
(query, key) pairs (``attention_work``). Worked example, s = 8, N = 2: chunks of 2 tokens;
rank 0 holds tokens 0 1 6 7, rank 1 holds 2 3 4 5. Tokens, positions (RoPE) and labels
are split the same way (``shard``); ``unshard`` puts shards back.

Masking: causal always, by global token position; with ``ContextLayout.documents`` (a
document id per token of the whole sequence, ``document_ids``) a token also attends only
within its document -- packed sequences stop at their end-of-text tokens.

Numerics: every block's scores, softmax and output are computed in fp32 (or the input's
wider type) by ``attend`` and merged by their log-sum-exp in fp32 (``merge``); the output
is cast back to the input type once. A block without document masks runs on one of
PyTorch's fused kernels that return their log-sum-exp and never hold the block's (B, H, Tq,
Tk) scores (``_attend_fused``: a causal block is cut into its visible keys and the causal
square; the backward is the kernel's, fed the merged output and LSE): the flash kernel for
CPUs (in fp32), and on CUDA the flash kernel (fp16/bf16: its partial outputs are rounded to
the input type once each, as single-GPU SDPA's output is) or the memory-efficient kernel,
as PyTorch's own eligibility checks allow. Document-masked blocks run math attention,
which materialises each block's scores. The CUDA glue is tested on CPU stand-ins that keep
the kernels' contracts, and on the real kernels by tests/test_cuda.py where a GPU is.

Shape letters: B batch, H query heads, K key/value heads, D head size, S tokens held by
this rank (s / N: two chunks of c), T tokens of a block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from plait import comm
from plait.model.kernels import rehearsing_gpu
from plait.nccl_p2p import RECV, SEND, Compute, Message, Post

MODES = ("ring", "allgather", "a2a")
NEG_INF = float("-inf")


# ---------------------------------------------------------------- the split (pure)


def chunk_ids(cp: int, index: int, *, split: str = "head-tail") -> tuple[int, int]:
    """The two of 2 x ``cp`` chunks that cp rank ``index`` holds: (index, 2cp-1-index)
    head-tail; (2 index, 2 index + 1) for the contiguous split (the imbalanced contrast)."""
    if not 0 <= index < cp:
        raise ValueError(f"cp rank {index} outside a ring of {cp}")
    if split == "head-tail":
        return index, 2 * cp - 1 - index
    if split == "contiguous":
        return 2 * index, 2 * index + 1
    raise ValueError(f"split {split!r} is unknown; choose head-tail or contiguous")


def shard(x: torch.Tensor, *, cp: int, index: int, dim: int = 1) -> torch.Tensor:
    """What cp rank ``index`` holds of ``x`` (the whole sequence along ``dim``): its two
    chunks, concatenated. ``shard(arange(8), cp=2, index=0, dim=0)`` is [0, 1, 6, 7]."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into 2 x {cp} chunks")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp, index)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard(shards: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's ``shard``, in cp rank order."""
    cp = len(shards)
    chunks: list = [None] * (2 * cp)
    for index, s in enumerate(shards):
        first, second = s.chunk(2, dim=dim)
        a, b = chunk_ids(cp, index)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def document_ids(tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """A document id per token of packed sequences (B, s): the number of end-of-text tokens
    before it, so an end-of-text token closes its own document. [5 9 0 7 0 3] with eot 0
    gives [0 0 0 1 1 2]."""
    ends = (tokens == eot).to(torch.int32)
    return ends.cumsum(-1) - ends


def visible(q_chunk: int, kv_chunks: tuple[int, ...]) -> list[int]:
    """The places in ``kv_chunks`` that query chunk ``q_chunk`` attends to under the causal
    mask: earlier chunks wholly, its own chunk causally, later ones not at all."""
    return [i for i, g in enumerate(kv_chunks) if g <= q_chunk]


def attention_work(cp: int, index: int, *, c: int, split: str = "head-tail") -> int:
    """(query, key) pairs that cp rank ``index`` computes under the causal mask, chunks of
    ``c`` tokens, counted from ``visible`` as the exchanges use it: c^2 per earlier chunk,
    c (c+1) / 2 for the diagonal. Head-tail: (2N - 1) c^2 + c (c+1) on every rank."""
    every = tuple(range(2 * cp))
    work = 0
    for q in chunk_ids(cp, index, split=split):
        work += sum(
            c * c if g < q else c * (c + 1) // 2 for g in (every[i] for i in visible(q, every))
        )
    return work


@dataclass(frozen=True, kw_only=True)
class ContextLayout:
    """One micro-batch's sequence as the cp ring holds it: ``cp`` ranks, ``seq_len`` tokens
    per sequence, and optionally ``documents``, the (B, seq_len) document ids of the whole
    sequences (``document_ids``; ``gather_documents`` rebuilds them from shards)."""

    cp: int
    seq_len: int
    documents: torch.Tensor | None = None

    def __post_init__(self):
        if self.cp < 1:
            raise ValueError(f"--cp {self.cp} must be at least 1")
        if self.seq_len % (2 * self.cp):
            raise ValueError(
                f"--seq-len {self.seq_len} must be a multiple of 2 x --cp = {2 * self.cp} "
                "(each cp rank holds two equal chunks)"
            )
        if self.documents is not None and self.documents.shape[-1] != self.seq_len:
            raise ValueError(
                f"document ids cover {self.documents.shape[-1]} tokens, not {self.seq_len}"
            )

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def positions(self, chunks: tuple[int, ...] | list[int], device=None) -> torch.Tensor:
        """Global token positions of ``chunks``, concatenated."""
        c = self.chunk
        return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in chunks])

    def docs(self, chunks) -> torch.Tensor | None:
        if self.documents is None:
            return None
        c = self.chunk
        return torch.cat([self.documents[:, g * c : (g + 1) * c] for g in chunks], dim=-1)


def gather_documents(local: torch.Tensor, *, topo, axis) -> torch.Tensor:
    """The whole sequences' document ids (B, s) from each cp rank's shard (B, S): one small
    all-gather per micro-batch (B s 4 bytes), shared by every layer."""
    n = len(topo.group_ranks[axis])
    if n == 1:
        return local
    gathered = comm.all_gather(local.contiguous(), topo=topo, axis=axis, dim=0)  # (N B, S)
    return unshard(list(gathered.chunk(n, dim=0)), dim=-1)


# ---------------------------------------------------------------- attention with its LSE


def _mask(q_pos, k_pos, q_doc, k_doc, causal) -> torch.Tensor | None:
    """(B or 1, 1, Tq, Tk) True where a query may attend to a key; None: everywhere.
    ``causal`` False: the caller knows every key precedes every query (from the chunk ids,
    without reading positions back from the device)."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if q_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _scores(q, k, scale, mask):
    """fp32 (at least) scores (B, H, Tq, Tk), masked with -inf; k (B, K, Tk, D) shared by
    H / K query heads each (GQA, as SDPA's ``enable_gqa``)."""
    dt = torch.promote_types(q.dtype, torch.float32)
    k = k.to(dt).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.to(dt) @ k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG_INF)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A row with nothing to attend to has LSE -inf; 0 in its place makes exp(s - lse)
    exp(-inf) = 0 instead of NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


# -- the fused kernels: no (B, H, Tq, Tk) scores held --------------------------------------
#
# Three PyTorch kernels return the log-sum-exp a merge needs (their schemas: aten's
# native_functions.yaml; their outputs: the kernels' sources):
#   cpu       _scaled_dot_product_flash_attention_for_cpu: fp32 in, out and lse (B, H, Tq);
#   flash     _scaled_dot_product_flash_attention (CUDA, fp16/bf16): out in the input type,
#             lse fp32 (B, H, Tq);
#   efficient _scaled_dot_product_efficient_attention (CUDA, fp32 too): out in the input
#             type, lse fp32 (B, H, Tq rounded up to a multiple of 32: the backward loads it in
#             blocks of 32 rows, so it must be handed a padded lse again).
# Each runs a block as its visible keys plus its causal square (``_diagonal_split``): the
# kernels' own causal flag then only ever sees square blocks, where its top-left and
# bottom-right alignments agree. Partial outputs are merged in fp32 (``merge``); on CUDA the
# flash kernel's bf16 partial output is rounded once, as single-GPU SDPA's output is.

EFFICIENT_LSE_ALIGN = 32


def _op(name: str):
    """aten's op ``name`` (one place, so a test can stand in for the CUDA kernels)."""
    return getattr(torch.ops.aten, name)


def _kernel(q, k, q_doc) -> str | None:
    """The fused kernel a block runs on ("cpu", "flash", "efficient"), or None for math
    attention: never with document masks (a (B, Tq, Tk) mask of its own, which can leave a
    row with no key; the math path defines that row). On CUDA, PyTorch's own eligibility
    checks (dtype, head size, GPU architecture) pick flash, then efficient."""
    if q_doc is not None:
        return None
    if rehearsing_gpu():  # a rehearsal's fake tensors size the GPU's kernels
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "efficient"
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda":
        return None
    from torch.backends import cuda as backend

    # eligibility of the calls ``_attend_fused`` makes: K/V repeated to q's heads (the
    # efficient kernel's checks refuse grouped heads: asked about k itself, an fp32 GQA block
    # would fall back to math attention; a broadcast view stands for the repeat, no copy),
    # and not causal: the kernels' causal flag only ever sees square parts
    # (``_diagonal_split``), while flash's check refuses causal with Tq != Tk -- asked about
    # the whole block, every ring block with keys before its queries lost flash
    kv = k[:, :1].expand(k.shape[0], q.shape[1], *k.shape[2:])
    params = backend.SDPAParams(q, kv, kv, None, 0.0, False, False)
    if q.dtype in (torch.float16, torch.bfloat16) and backend.can_use_flash_attention(params):
        return "flash"
    if backend.can_use_efficient_attention(params):
        return "efficient"
    return None


def _kernel_inputs(q, k, v, kernel: str):
    """q, k, v contiguous with K/V repeated to q's heads (GQA); fp32 (or wider) on the CPU
    kernel, the input type on CUDA (flash takes fp16/bf16 only)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(g, dim=1) if g > 1 else x for x in (k, v))
    dt = torch.promote_types(q.dtype, torch.float32) if kernel == "cpu" else q.dtype
    return (x.to(dt).contiguous() for x in (q, k, v))


def _diagonal_split(Tq: int, Tk: int, causal: bool) -> list[tuple[slice, bool]]:
    """The keys of a block as (slice, causal) parts the kernel's own causal flag covers: a
    causal block's queries are its last Tq keys (the query chunk closes every key set the
    exchanges build), so the keys before them are all visible and the last Tq are the
    top-left-aligned causal square."""
    if not causal:
        return [(slice(0, Tk), False)]
    parts = [(slice(0, Tk - Tq), False)] if Tk > Tq else []
    return parts + [(slice(Tk - Tq, Tk), True)]


def _kernel_forward(kernel: str, q, k, v, *, causal: bool, scale: float):
    """One kernel call: out (any float type) and lse (B, H, Tq) fp32."""
    Tq = q.shape[-2]
    if kernel == "cpu":
        return _op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, causal, scale=scale)
    if kernel == "flash":
        out, lse, *_ = _op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, False, scale=scale)  # fmt: skip
        return out, lse
    out, lse, *_ = _op("_scaled_dot_product_efficient_attention")(q, k, v, None, True, 0.0, causal, scale=scale)  # fmt: skip
    return out, lse[..., :Tq]


def _kernel_backward(kernel: str, dout, q, k, v, out, lse, *, causal: bool, scale: float):
    """The kernel's backward of one call given the *merged* out and lse of its queries (it
    recomputes P = exp(S - lse) and takes rowsum(dO * O) as delta): dq, dk, dv."""
    if kernel == "cpu":
        return _op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    # None (an undefined tensor) for what the forward returns undefined on dense inputs:
    # a defined cum_seq_q, even empty, selects the kernels' variable-length path, and a
    # defined attn_bias is read as a (B, H, Tq, Tk) bias. No dropout: no philox state.
    Tq, Tk = q.shape[-2], k.shape[-2]
    if kernel == "flash":
        return _op("_scaled_dot_product_flash_attention_backward")(
            dout, q, k, v, out, lse, None, None, Tq, Tk, 0.0, causal, None, None, scale=scale
        )
    B, H = lse.shape[:2]
    rows = -(-Tq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    padded = torch.zeros(B, H, rows, dtype=lse.dtype, device=lse.device)
    padded[..., :Tq] = lse
    dq, dk, dv, _ = _op("_scaled_dot_product_efficient_attention_backward")(
        dout, q, k, v, None, out, padded, None, None, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _attend_fused(kernel: str, q, k, v, *, causal, scale):
    q, k, v = _kernel_inputs(q, k, v, kernel)
    out = lse = None
    for keys, diag in _diagonal_split(q.shape[-2], k.shape[-2], causal):
        o, l_ = _kernel_forward(kernel, q, k[..., keys, :].contiguous(),
                                v[..., keys, :].contiguous(), causal=diag, scale=scale)  # fmt: skip
        o, l_ = (x.to(torch.promote_types(x.dtype, torch.float32)) for x in (o, l_))
        out, lse = (o, l_) if out is None else merge(out, lse, o, l_)
    return out, lse


def _attend_backward_fused(kernel: str, q, k, v, dout, out, lse, *, causal, scale):
    """The kernel's backward of one block given the *merged* out and lse of its queries
    (the ring flash-attention backward); fp32 (or wider) gradients, GQA heads summed."""
    B, K, Tk, D = k.shape
    qk, kk, vk = _kernel_inputs(q, k, v, kernel)
    dout, out = (x.to(qk.dtype).contiguous() for x in (dout, out))
    lse = lse.to(torch.promote_types(qk.dtype, torch.float32)).contiguous()
    acc = torch.promote_types(qk.dtype, torch.float32)
    dq = torch.zeros(qk.shape, dtype=acc, device=q.device)
    dk, dv = (torch.zeros(kk.shape, dtype=acc, device=q.device) for _ in range(2))
    for keys, diag in _diagonal_split(q.shape[-2], Tk, causal):
        a, b, c = _kernel_backward(kernel, dout, qk, kk[..., keys, :].contiguous(),
                                   vk[..., keys, :].contiguous(), out, lse, causal=diag,
                                   scale=scale)  # fmt: skip
        dq += a
        dk[..., keys, :] += b
        dv[..., keys, :] += c
    g = q.shape[1] // K
    if g == 1:  # no grouped heads to sum: no fp32 copy of each
        return dq, dk, dv
    return dq, dk.view(B, K, g, Tk, D).sum(2), dv.view(B, K, g, Tk, D).sum(2)


def attend(q, k, v, *, q_pos, k_pos, q_doc=None, k_doc=None, causal=True, scale: float):
    """Masked attention of one block with its log-sum-exp: q (B, H, Tq, D), k/v
    (B, K, Tk, D), global positions ``q_pos`` (Tq,) / ``k_pos`` (Tk,), document ids
    (B, Tq) / (B, Tk) or None (``causal`` False: no key follows any query). Returns out (B, H, Tq, D) and lse (B, H, Tq), both fp32 (or
    the input's wider type); a row that sees no key has out 0 and lse -inf."""
    kernel = _kernel(q, k, q_doc)
    if kernel is not None:
        return _attend_fused(kernel, q, k, v, causal=causal, scale=scale)
    s = _scores(q, k, scale, _mask(q_pos, k_pos, q_doc, k_doc, causal))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    v = v.to(s.dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return p @ v, lse


def attend_backward(q, k, v, dout, delta, lse, *, q_pos, k_pos, q_doc=None, k_doc=None,
                    causal=True, scale: float, out=None):  # fmt: skip
    """Gradients of one block given the *merged* ``lse`` of its queries and ``delta`` =
    rowsum(dO * O) - dLSE (B, H, Tq): P is recomputed as exp(S - lse), dS = P (dP - delta)
    (the flash-attention backward, blockwise). Returns fp32 dq (B, H, Tq, D), dk and dv
    (B, K, Tk, D) (summed over the query heads sharing each key/value head). ``out``: the
    merged output of these queries, given when no gradient reaches the LSE (delta is then
    rowsum(dO * O)): the fused kernel's backward, which takes it instead of delta."""
    kernel = _kernel(q, k, q_doc) if out is not None else None
    if kernel is not None:
        return _attend_backward_fused(kernel, q, k, v, dout, out, lse, causal=causal, scale=scale)
    s = _scores(q, k, scale, _mask(q_pos, k_pos, q_doc, k_doc, causal))
    p = torch.exp(s - _finite(lse)[..., None])  # (B, H, Tq, Tk)
    dt, g = s.dtype, q.shape[1] // k.shape[1]
    dout = dout.to(dt)
    kr = k.to(dt).repeat_interleave(g, dim=1)
    vr = v.to(dt).repeat_interleave(g, dim=1)
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ vr.transpose(-1, -2) - delta[..., None])
    dq = (ds @ kr) * scale
    dk = (ds.transpose(-1, -2) @ q.to(dt)) * scale
    B, K, T, D = k.shape
    return dq, dk.view(B, K, g, T, D).sum(2), dv.view(B, K, g, T, D).sum(2)


def merge(out, lse, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, merged by their
    log-sum-exp (fp32): weights exp(lse_i - lse), lse = log(exp(lse) + exp(lse_b))."""
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    out = out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return out, new


# ---------------------------------------------------------------- the ring's program (data)


class RingStep(NamedTuple):
    """One step of a rank's ring program. ``op``: "post" a batch (``what`` "kv": send the
    K/V block held at step ``t`` to the next rank and receive the next one from the
    previous rank; "dkv": the same for the block's dK/dV accumulator), "wait" for that
    batch, "attend" to the block held at step ``t`` (forward or backward), "accumulate"
    its dK/dV into the accumulator that arrived with it."""

    op: str
    what: str
    t: int


def ring_program(cp: int, *, backward: bool = False) -> list[RingStep]:
    """Every rank's program (the same on each; peers are relative: next and previous).

    Forward, 3 ranks: post kv0, attend 0, wait kv0, post kv1, attend 1, wait kv1,
    attend 2 -- each block's transfer in flight while the rank attends to the one it holds.
    Backward: the K/V blocks travel again, and an fp32 dK/dV accumulator travels one step
    behind its block: at step t a rank attends to block t (while block t+1 is in flight),
    adds the result to block t's accumulator (arrived with the previous dkv batch) and
    passes it on; after N dkv batches every accumulator is back with its block's owner.
    """
    steps = []
    for t in range(cp):
        last = t == cp - 1
        if not last:
            steps.append(RingStep("post", "kv", t))
        steps.append(RingStep("attend", "", t))
        if backward:
            if t > 0:
                steps.append(RingStep("wait", "dkv", t - 1))
            steps.append(RingStep("accumulate", "", t))
            if cp > 1:
                steps.append(RingStep("post", "dkv", t))
        if not last:
            steps.append(RingStep("wait", "kv", t))
    if backward and cp > 1:
        steps.append(RingStep("wait", "dkv", cp - 1))
    return steps


def ring_p2p(cp: int, *, backward: bool = False, program=None) -> list[list]:
    """Every rank's ``program`` (default ``ring_program``) as ``nccl_p2p`` items: a post is
    one batch [send to next, receive from previous], tagged with what it carries; a wait
    is a compute that waits for that batch; attend / accumulate compute."""
    program = ring_program(cp, backward=backward) if program is None else program
    ranks = []
    for r in range(cp):
        items, where = [], {}
        for step in program:
            if step.op == "post":
                tag = (step.what, step.t)
                where[tag] = len(items)
                items.append(
                    Post((Message(SEND, (r + 1) % cp, tag), Message(RECV, (r - 1) % cp, tag)))
                )
            elif step.op == "wait":
                items.append(Compute(where[(step.what, step.t)]))
            else:
                items.append(Compute(None))
        ranks.append(items)
    return ranks


# ---------------------------------------------------------------- the three exchanges


@dataclass(frozen=True)
class _Ring:
    """This rank's place on the cp ring: ``topo``'s ``axis`` group, in group order."""

    topo: object
    axis: object
    n: int
    index: int
    next: int  # global ranks
    prev: int

    @classmethod
    def of(cls, topo, axis) -> _Ring:
        ranks = list(topo.group_ranks[axis])
        i = ranks.index(topo.rank) if len(ranks) > 1 else 0
        return cls(topo, axis, len(ranks), i, ranks[(i + 1) % len(ranks)], ranks[i - 1])


def _slots(x, picks, c):
    """The chunks ``picks`` (places 0 / 1 of a rank's two) of x along its T dimension (-2)."""
    if list(picks) == [0, 1]:
        return x
    return torch.cat([x[..., p * c : (p + 1) * c, :] for p in picks], dim=-2)


def _block_args(layout, q_chunk, kv_chunks, picks, device):
    kv = [kv_chunks[p] for p in picks]
    return dict(
        q_pos=layout.positions([q_chunk], device),
        k_pos=layout.positions(kv, device),
        q_doc=layout.docs([q_chunk]),
        k_doc=layout.docs(kv),
        causal=q_chunk in kv,
    )


def _sequence_major(outs, dtype) -> torch.Tensor:
    """The output chunks (B, H, s, D), joined along the sequence into a (B, H, S, D) view
    of a (B, S, H, D) tensor: the caller's merge of the heads (``transformer.Attention``)
    is then a view of what the backward keeps, not a second copy of it."""
    return torch.cat([o.transpose(1, 2) for o in outs], dim=1).to(dtype).transpose(1, 2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, ring, scale):
        c, topo, axis = layout.chunk, ring.topo, ring.axis
        mine = chunk_ids(ring.n, ring.index)
        kv = torch.stack([k, v])  # (2, B, K, S, D): one message per block
        outs: list = [None, None]
        lses: list = [None, None]
        works, incoming = {}, None
        for step in ring_program(ring.n):
            if step.op == "post":
                incoming = torch.empty_like(kv)
                works[step.t] = comm.batch_p2p(
                    [("send", kv, ring.next), ("recv", incoming, ring.prev)], topo=topo, axis=axis
                )
            elif step.op == "wait":
                comm.wait(works.pop(step.t), topo=topo, what="ring K/V", axis=axis)
                kv = incoming
            else:  # attend to the block of the rank step.t places back
                held = chunk_ids(ring.n, (ring.index - step.t) % ring.n)
                for a in (0, 1):
                    picks = visible(mine[a], held)
                    if not picks:
                        continue
                    o, lse = attend(
                        q[..., a * c : (a + 1) * c, :], _slots(kv[0], picks, c),
                        _slots(kv[1], picks, c), scale=scale,
                        **_block_args(layout, mine[a], held, picks, q.device),
                    )  # fmt: skip
                    if outs[a] is None:
                        outs[a], lses[a] = o, lse
                    else:
                        outs[a], lses[a] = merge(outs[a], lses[a], o, lse)
        out, lse = _sequence_major(outs, q.dtype), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.ring, ctx.scale = layout, ring, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, ring, scale = ctx.layout, ctx.ring, ctx.scale
        c, topo, axis = layout.chunk, ring.topo, ring.axis
        mine = chunk_ids(ring.n, ring.index)
        dt = lse.dtype
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout.to(dt) * out.to(dt)).sum(-1)  # (B, H, S)
        if dlse is not None:
            delta = delta - dlse
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        kv = torch.stack([k, v])
        block = acc = None  # this step's dK/dV, and the accumulator it joins (fp32)
        works, incoming, incoming_acc = {}, None, None
        for step in ring_program(ring.n, backward=True):
            if step.op == "post" and step.what == "kv":
                incoming = torch.empty_like(kv)
                works[step] = comm.batch_p2p(
                    [("send", kv, ring.next), ("recv", incoming, ring.prev)], topo=topo, axis=axis
                )
            elif step.op == "post":
                incoming_acc = torch.empty_like(acc)
                works[step] = comm.batch_p2p(
                    [("send", acc, ring.next), ("recv", incoming_acc, ring.prev)],
                    topo=topo, axis=axis,
                )  # fmt: skip
            elif step.op == "wait":
                comm.wait(works.pop(RingStep("post", step.what, step.t)), topo=topo,
                          what="ring dK/dV" if step.what == "dkv" else "ring K/V", axis=axis)  # fmt: skip
                if step.what == "kv":
                    kv = incoming
                else:
                    acc = incoming_acc
            elif step.op == "attend":
                held = chunk_ids(ring.n, (ring.index - step.t) % ring.n)
                block = torch.zeros(kv.shape, dtype=dt, device=kv.device)
                for a in (0, 1):
                    picks = visible(mine[a], held)
                    if not picks:
                        continue
                    rows = slice(a * c, (a + 1) * c)
                    dqa, dk, dv = attend_backward(
                        q[..., rows, :], _slots(kv[0], picks, c), _slots(kv[1], picks, c),
                        dout[..., rows, :], delta[..., rows], lse[..., rows], scale=scale,
                        out=None if dlse is not None else out[..., rows, :],
                        **_block_args(layout, mine[a], held, picks, q.device),
                    )  # fmt: skip
                    dq[..., rows, :] += dqa
                    for i, p in enumerate(picks):
                        block[0][..., p * c : (p + 1) * c, :] += dk[..., i * c : (i + 1) * c, :]
                        block[1][..., p * c : (p + 1) * c, :] += dv[..., i * c : (i + 1) * c, :]
                    del dqa, dk, dv  # joined: not held through the next block's kernels
            else:  # accumulate: step 0 starts the accumulator of this rank's own block
                acc = block if step.t == 0 else acc + block
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None


def _gather_kv(k, v, ring: _Ring) -> torch.Tensor:
    """Every rank's K/V block, one all-gather: (2, B, K, s, D) in global token order."""
    kv = torch.stack([k, v])  # (2, B, K, S, D)
    gathered = torch.empty((ring.n, *kv.shape), dtype=kv.dtype, device=kv.device)
    comm.all_gather_into(gathered, kv, topo=ring.topo, axis=ring.axis)
    return unshard(list(gathered.unbind(0)), dim=-2)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, ring, scale):
        n, c = ring.n, layout.chunk
        full = _gather_kv(k, v, ring)
        outs, lses = [], []
        for a, g in enumerate(chunk_ids(n, ring.index)):
            keys = tuple(range(g + 1))
            o, lse = attend(
                q[..., a * c : (a + 1) * c, :], full[0][..., : (g + 1) * c, :],
                full[1][..., : (g + 1) * c, :], scale=scale,
                **_block_args(layout, g, keys, range(g + 1), q.device),
            )  # fmt: skip
            outs.append(o)
            lses.append(lse)
        out, lse = _sequence_major(outs, q.dtype), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)  # the shard only: gathered again backward
        ctx.layout, ctx.ring, ctx.scale = layout, ring, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, ring, scale = ctx.layout, ctx.ring, ctx.scale
        n, c, dt = ring.n, layout.chunk, lse.dtype
        full = _gather_kv(k, v, ring)
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout.to(dt) * out.to(dt)).sum(-1)
        if dlse is not None:
            delta = delta - dlse
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dfull = torch.zeros(full.shape, dtype=dt, device=full.device)
        for a, g in enumerate(chunk_ids(n, ring.index)):
            rows, upto = slice(a * c, (a + 1) * c), slice(0, (g + 1) * c)
            dq[..., rows, :], dk, dv = attend_backward(
                q[..., rows, :], full[0][..., upto, :], full[1][..., upto, :],
                dout[..., rows, :], delta[..., rows], lse[..., rows], scale=scale,
                out=None if dlse is not None else out[..., rows, :],
                **_block_args(layout, g, tuple(range(g + 1)), range(g + 1), q.device),
            )  # fmt: skip
            dfull[0][..., upto, :] += dk
            dfull[1][..., upto, :] += dv
            del dk, dv  # joined: not held through the next chunk's kernels
        del full
        pieces = torch.stack([shard(dfull, cp=n, index=j, dim=-2) for j in range(n)])
        del dfull
        dkv = torch.empty(pieces.shape[1:], dtype=dt, device=pieces.device)
        comm.reduce_scatter_into(dkv, pieces, topo=ring.topo, axis=ring.axis)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _to_heads(x: torch.Tensor, ring: _Ring, heads_dim: int = 1) -> torch.Tensor:
    """Sequence-sharded (B, X, S, ...) -> head-sharded (B, X/N, s, ...) in global token
    order: piece j (heads j X/N..) to cp rank j, one all-to-all."""
    n = ring.n
    send = torch.stack(x.chunk(n, dim=heads_dim))  # (N, B, X/N, S, ...)
    recv = torch.empty_like(send)
    comm.all_to_all_into(recv, send, topo=ring.topo, axis=ring.axis)
    return unshard(list(recv.unbind(0)), dim=2)


def _to_sequence(x: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """``_to_heads`` undone: head-sharded (B, X/N, s, ...) -> (B, X, S, ...)."""
    n = ring.n
    send = torch.stack([shard(x, cp=n, index=j, dim=2) for j in range(n)])
    recv = torch.empty_like(send)
    comm.all_to_all_into(recv, send, topo=ring.topo, axis=ring.axis)
    return torch.cat(recv.unbind(0), dim=1)


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, ring, scale):
        n, H, K = ring.n, q.shape[1], k.shape[1]
        # one all-to-all for q, k and v: each destination's heads of the three, side by side
        packed = torch.cat(
            [torch.cat([a, b, d], dim=1) for a, b, d in zip(q.chunk(n, 1), k.chunk(n, 1), v.chunk(n, 1))],
            dim=1,
        )  # fmt: skip
        qkv = _to_heads(packed, ring)  # (B, (H + 2K)/N, s, D)
        qh, kh, vh = qkv.split([H // n, K // n, K // n], dim=1)
        pos = torch.arange(layout.seq_len, device=q.device)
        docs = layout.documents
        o, lse = attend(qh, kh, vh, q_pos=pos, k_pos=pos, q_doc=docs, k_doc=docs, scale=scale)
        o = o.to(q.dtype)
        ctx.save_for_backward(qh, kh, vh, o, lse)
        ctx.layout, ctx.ring, ctx.scale, ctx.heads = layout, ring, scale, (H, K)
        ctx.set_materialize_grads(False)
        return _to_sequence(o, ring), _to_sequence(lse[..., None], ring)[..., 0]

    @staticmethod
    def backward(ctx, dout, dlse):
        qh, kh, vh, o, lse = ctx.saved_tensors
        layout, ring, scale = ctx.layout, ctx.ring, ctx.scale
        n, dt = ring.n, lse.dtype
        dout = torch.zeros_like(o) if dout is None else _to_heads(dout, ring)
        delta = (dout.to(dt) * o.to(dt)).sum(-1)
        if dlse is not None:
            delta = delta - _to_heads(dlse[..., None].contiguous(), ring)[..., 0]
        pos = torch.arange(layout.seq_len, device=qh.device)
        docs = layout.documents
        dq, dk, dv = attend_backward(qh, kh, vh, dout, delta, lse, q_pos=pos, k_pos=pos,
                                     q_doc=docs, k_doc=docs, scale=scale,
                                     out=None if dlse is not None else o)  # fmt: skip
        d = _to_sequence(torch.cat([dq, dk, dv], dim=1).to(qh.dtype), ring)  # (B, ..., S, D)
        H, K = ctx.heads
        per = (H + 2 * K) // n
        groups = [g.split([H // n, K // n, K // n], dim=1) for g in d.split(per, dim=1)]
        dq, dk, dv = (torch.cat([g[i] for g in groups], dim=1) for i in range(3))
        return dq, dk, dv, None, None, None


_FUNCTIONS = {"ring": _RingAttention, "allgather": _AllGatherAttention, "a2a": _UlyssesAttention}


def check_heads(mode: str, *, cp: int, n_heads: int, n_kv_heads: int) -> None:
    """One line (ValueError) when ``mode`` cannot split this attention over ``cp`` ranks."""
    if mode not in MODES:
        raise ValueError(f"--cp-mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
    if mode == "a2a" and (n_heads % cp or n_kv_heads % cp):
        raise ValueError(
            f"--cp-mode a2a splits heads over --cp {cp}, which must divide the {n_heads} "
            f"attention heads and the {n_kv_heads} key/value heads; use --cp-mode ring or "
            "allgather, or a --cp that divides both"
        )


def context_attention(q, k, v, *, layout: ContextLayout, topo, axis, mode: str = "ring",
                      scale: float | None = None):  # fmt: skip
    """Causal (and, with ``layout.documents``, document-masked) attention of this rank's
    shard of the sequence against the whole sequence, exchanged by ``mode`` over ``topo``'s
    ``axis`` group (the cp ring; until ``Topology`` has a cp axis, any axis whose group
    is the ring). q (B, H, S, D), k and v (B, K, S, D): this rank's ``shard`` of each
    sequence. Returns out (B, H, S, D) in q's type and lse (B, H, S) in fp32, both
    differentiable."""
    ring = _Ring.of(topo, axis)
    check_heads(mode, cp=ring.n, n_heads=q.shape[1], n_kv_heads=k.shape[1])
    if layout.cp != ring.n:
        raise ValueError(f"layout for --cp {layout.cp} on a ring of {ring.n} ranks")
    if q.shape[-2] * ring.n != layout.seq_len:
        raise ValueError(f"{q.shape[-2]} tokens per rank, expected {layout.seq_len // ring.n}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if ring.n == 1:
        mode = "ring"  # no exchange: the ring of one rank attends to its own block
    return _FUNCTIONS[mode].apply(q, k, v, layout, ring, scale)
