"""Flat buffers: a list of tensors laid out in one buffer that a single collective moves,
and the one definition of a ZeRO shard (which rank holds which range of a tensor).

Communication: none. This module only says where each tensor sits in a flat buffer; the
modules that issue collectives on such buffers (``data_parallel.py``, ``zero.py``,
``tensor.py``'s ``TPGradSync``, ``resilience/engines.py``, ``dp_algos``) say which and
on which axis.

A ``FlatLayout`` over tensors of ``numels`` elements serves two shapes of buffer:

- ``n == 1`` (the default): the tensors one after another. ``FlatLayout([6, 2, 3])``:
  tensor 0 at [0, 6), tensor 1 at [6, 8), tensor 2 at [8, 11). What an all-reduce of
  several tensors at once needs: ``pack`` copies them in, ``views`` are each tensor's
  place in the buffer (a gradient can live there: no copy), ``unpack`` copies them out.
- ``n > 1``: rank-major rows for a tensor list sharded over n ranks (ZeRO's buckets and
  stage-3 units). Row r is rank r's shard of each tensor in turn, each shard padded to
  ``shard_size``, so one reduce-scatter of the buffer leaves every rank exactly its
  shards (``views`` of its row), and one all-gather of the rows (``pack_row``) rebuilds
  every tensor (``unpack``). ``FlatLayout([10, 3], n=4, rank=r)``: shards of 3 and 1,
  rows of 4; row 3 holds element 9 of the first tensor and nothing of the second, the
  rest padding.

The sharding of a tensor is defined once, by ``shard_range``: the tensor flattened, padded
to a multiple of n, cut into n equal shards; rank i holds shard i (its real part, without
the padding). It depends only on the tensor's size and n -- not on which other tensors
share its buffer -- so gradient buckets and stage-3 parameter units can group parameters
differently, pipeline stages' tied embedding copies shard alike, and the checkpoint code
cuts a full tensor with the same function (``zero_shard``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch

# --- the one sharding definition ----------------------------------------------------------


def resize_storage(t: torch.Tensor, nbytes: int) -> None:
    """Resize ``t``'s storage to ``nbytes`` (0 frees it; the tensor keeps its shape). A
    storage's resize_ does not pass through PyTorch's dispatcher; ``plait rehearse``'s
    memory tracker sees it all the same (``MemTracker`` wraps ``UntypedStorage.resize_``)."""
    t.untyped_storage().resize_(nbytes)


def shard_size(numel: int, n: int) -> int:
    """Elements in each of the n shards of a tensor (the last may be part padding)."""
    return math.ceil(numel / n)


def shard_range(numel: int, rank: int, n: int) -> tuple[int, int]:
    """[lo, hi) of the flattened tensor that rank ``rank`` of ``n`` holds.

    ``shard_range(10, r, 4)`` for r = 0..3: (0, 3) (3, 6) (6, 9) (9, 10) -- shards of 3, the
    last one 2 elements of padding. A rank past the end holds nothing: (numel, numel).
    """
    s = shard_size(numel, n)
    lo = min(rank * s, numel)
    return lo, min(lo + s, numel)


def zero_shard(full: torch.Tensor, *, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a flat view, no padding): the checkpoint loader
    and the engines cut every parameter and optimizer state with it."""
    lo, hi = shard_range(full.numel(), rank, n)
    return full.reshape(-1)[lo:hi]


# --- the layout -----------------------------------------------------------------------------


class FlatLayout:
    """Where each of a list of tensors sits in one flat buffer of ``n`` rows (module
    docstring): row r = [shard r of t0 | shard r of t1 | ...], each shard ``sizes[i]``
    elements at ``offsets[i]`` of the row; with n == 1 the row is the whole buffer and the
    shards are the tensors. ``rank`` is the row this rank holds (``views``, ``pack_row``)."""

    def __init__(self, numels: Sequence[int], *, n: int = 1, rank: int = 0):
        self.numels, self.n, self.rank = list(numels), n, rank
        self.sizes = [shard_size(k, n) for k in self.numels]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.row_numel = sum(self.sizes)
        self.numel = n * self.row_numel  # of the whole buffer
        self.ranges = [shard_range(k, rank, n) for k in self.numels]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], *, n: int = 1, rank: int = 0) -> FlatLayout:
        return cls([t.numel() for t in tensors], n=n, rank=rank)

    def views(self, row: torch.Tensor) -> list[torch.Tensor]:
        """This rank's (real) shard of each tensor, as flat views into its row (n == 1: each
        tensor whole, in the buffer)."""
        if row.numel() != self.row_numel:
            return [row[off : off + hi - lo] for off, (lo, hi) in zip(self.offsets, self.ranges)]
        parts = row.split(self.sizes)  # one operation, not one slice per tensor
        return [v if hi - lo == s else v[: hi - lo]
                for v, s, (lo, hi) in zip(parts, self.sizes, self.ranges)]  # fmt: skip

    def pack(self, tensors: Sequence[torch.Tensor | None], *, like: torch.Tensor | None = None,
             device: torch.device | None = None) -> torch.Tensor:  # fmt: skip
        """A new buffer, (n * row,), holding ``tensors`` (None: zeros) laid out rank-major;
        n == 1: one after another. Dtype and device of ``like``, else the dtype the
        tensors promote to (as ``torch.cat``) and ``device`` or the first tensor's."""
        dtype, device = _dtype_device(tensors, like, device)
        if (
            self.n == 1
            and tensors
            and all(t is not None and t.dtype == dtype and t.device == device for t in tensors)
        ):  # one copy kernel for the bucket (a gradient bucket every step)
            return torch.cat([t.reshape(-1) for t in tensors])
        out = torch.empty(self.n, self.row_numel, dtype=dtype, device=device)
        if self.n == 1:
            for t, view in zip(tensors, self.views(out[0])):
                view.zero_() if t is None else view.copy_(t.reshape(-1))
            return out.view(-1)
        rest = range(len(tensors))
        common = _common_dtype(tensors, dtype, device)
        if common is not None:
            # the shards of every tensor of the common dtype, padded, rank-major, in one
            # kernel (``_chunk_cat``'s layout; FSDP2 packs its reduce-scatter input with
            # it), casting bf16 to an fp32 buffer on the way: one strided copy per tensor
            # ran at 1.5 TB/s on an H200 (RESULTS.md, the sixth GPU session). A tensor of
            # another dtype (a block's fp32 norm weights beside its bf16 linears) holds its
            # place with an uninitialised stand-in and is copied in exactly after.
            rest = [i for i, t in enumerate(tensors) if t.dtype != common]
            parts = [t.reshape(-1) if t.dtype == common else t.new_empty(t.numel(), dtype=common)
                     for t in tensors]  # fmt: skip
            torch._chunk_cat(parts, 0, self.n, out=out)
        for i in rest:
            t, off, s, k = tensors[i], self.offsets[i], self.sizes[i], self.numels[i]
            dst = out[:, off : off + s]
            if t is None:
                dst.zero_()
                continue
            flat, full_rows = t.reshape(-1), k // s
            dst[:full_rows].copy_(flat[: full_rows * s].view(full_rows, s))
            if full_rows < self.n:
                rem = k - full_rows * s
                dst[full_rows, :rem].copy_(flat[full_rows * s :])
                dst[full_rows, rem:].zero_()
                dst[full_rows + 1 :].zero_()
        return out.view(-1)

    def unpack(self, flat: torch.Tensor, dests: Sequence[torch.Tensor]) -> None:
        """Inverse of ``pack``: copy every tensor out of a (n * row,) buffer into ``dests``
        (contiguous, shaped like the tensors)."""
        if self.n == 1:
            for dest, view in zip(dests, self.views(flat)):
                dest.view(-1).copy_(view)
            return
        rows = flat.view(self.n, self.row_numel)
        if (
            all(k == self.n * s for k, s in zip(self.numels, self.sizes))
            and all(d.is_contiguous() and d.device == flat.device for d in dests)
            and _few(_numels_by_dtype(dests), flat.dtype)
        ):  # no padding: each tensor's n shards are one column block of the rows, and
            # one kernel copies them all out (FSDP2's all-gather copy-out); a tensor of
            # another dtype than the rows' goes through a stand-in and is cast after
            outs = [d.view(self.n, s) if d.dtype == flat.dtype else
                    flat.new_empty(self.n, s) for d, s in zip(dests, self.sizes)]  # fmt: skip
            torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=outs)
            for d, o in zip(dests, outs):
                if d.dtype != flat.dtype:
                    d.view(o.shape).copy_(o)
            return
        for dest, off, s, k in zip(dests, self.offsets, self.sizes, self.numels):
            src, dst, full_rows = rows[:, off : off + s], dest.view(-1), k // s
            dst[: full_rows * s].view(full_rows, s).copy_(src[:full_rows])
            if full_rows < self.n:
                dst[full_rows * s :].copy_(src[full_rows, : k - full_rows * s])

    def pack_row(self, shards: Sequence[torch.Tensor], *, like: torch.Tensor) -> torch.Tensor:
        """This rank's row from its (real) shards, zero padded: what it all-gathers."""
        row = torch.zeros(self.row_numel, dtype=like.dtype, device=like.device)
        for view, shard in zip(self.views(row), shards):
            view.copy_(shard)
        return row


def _common_dtype(tensors, dtype: torch.dtype, device) -> torch.dtype | None:
    """The dtype of most of ``pack``'s elements, when one kernel can pack them into a
    ``dtype`` buffer: every tensor present, contiguous and on the buffer's device, that
    dtype ``dtype`` itself or bf16 into fp32 off the CPU (the cases with a CUDA kernel of
    their own; a CPU's ``_chunk_cat`` pads and casts in passes of its own, 12-22% slower
    than the strided copies on this project's 2-core machine), and the tensors of other
    dtypes within ``_few``; else None."""
    if not tensors or any(
        t is None or not t.is_contiguous() or t.device != device for t in tensors
    ):
        return None
    by_dtype = _numels_by_dtype(tensors)
    common = max(by_dtype, key=by_dtype.__getitem__)
    fast = common == dtype or (
        common == torch.bfloat16 and dtype == torch.float32 and device.type != "cpu"
    )
    return common if fast and _few(by_dtype, common) else None


def _numels_by_dtype(tensors) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for t in tensors:
        out[t.dtype] = out.get(t.dtype, 0) + t.numel()
    return out


def _few(by_dtype: dict, common: torch.dtype) -> bool:
    """Elements not of dtype ``common`` are at most an eighth of all: what goes through
    a stand-in (``pack``, ``unpack``) is a block's norm weights, not a unit's bulk."""
    total = sum(by_dtype.values())
    return 8 * (total - by_dtype.get(common, 0)) <= total


def _dtype_device(tensors, like, device) -> tuple[torch.dtype, torch.device]:
    if like is not None:
        return like.dtype, like.device
    present = [t for t in tensors if t is not None]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in present))
    return dtype, device if device is not None else present[0].device
