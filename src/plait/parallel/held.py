"""What one rank holds of a tensor, in the whole tensor's coordinates: the link between the
runtime's sharding (tensor parallelism, ``tensor.tp_shard``; ZeRO, ``flat.shard_range``)
and a checkpoint that stores every tensor at its global shape.

A rank holds, of each parameter and optimizer state, a contiguous range of its tp shard
flattened: the whole shard (no ZeRO, or a replicated tensor), or the ZeRO range
``shard_range(numel, rank, n)``. ``Held`` says so -- the live tensor (a flat view: a save
reads it, a load writes into it), where its range starts, the tp shard's shape and the
tensor's ``ShardSpec`` -- and ``Held.boxes`` cuts it into boxes of the global tensor: a
flat range of a row-major tensor of d dimensions is at most 2d - 1 boxes, each contiguous
in the flat order (a partial first row, whole rows, a partial last row, recursively), and
tensor parallelism only shifts a box along the split dimension (vocabulary padding is cut
off). Worked example, a (4, 6) weight split over tp = 2 on dim 1 (each tp rank holds
(4, 3)) and ZeRO n = 2 (each of those 12 elements split 6 + 6): tp rank 1, ZeRO rank 0
holds flat elements [0, 6) of its (4, 3) shard = rows 0 and 1 = the global box at (0, 3)
of size (2, 3); ZeRO rank 1 the box at (2, 3) of size (2, 3). With n = 3 (4 + 4 + 4), ZeRO
rank 1 holds [4, 8): (1, 1) size (1, 2), then (2, 0) size (1, 3) locally, i.e. global
(1, 4) size (1, 2) and (2, 3) size (1, 3).

Expert parallelism adds one more shift: an ep rank holds experts [first, first + E/ep) of
an expert weight stacked (E, ...) (``model/moe.py``), so its tensor is rows [first,
first + E/ep) of dim 0 of the global one (``rows=(first, E)``); the boxes above are cut
from the (E/ep, ...) tensor and moved down by ``first``. Worked example, w_fc (8, F, C) at
ep 2: ep rank 1 holds (4, F, C), rows=(4, 8), whole or ZeRO ranges of it, each box at
offset 4 + its local row.

No rank ever needs a tensor whole to save or load it: a checkpoint (``train/checkpoint.py``)
gives DCP these boxes as the chunks this rank writes, or reads (DCP then reads from every
saved chunk that overlaps one: resharding across any layout change).

Communication: none (pure functions of the layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.parallel.flat import shard_range
from plait.parallel.tensor import REPLICATED, ShardSpec, full_shape, local_size


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of the boxes that tile elements [lo, hi) of a row-major tensor of
    ``shape``, in flat order; each box is contiguous in that order.

    ``flat_boxes((3, 4), 2, 11)`` -> [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    out, row = [], lo // inner
    if lo % inner:  # a partial first row
        end = min(hi, (row + 1) * inner)
        base = row * inner
        out += [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo - base, end - base)]
        lo, row = end, row + 1
    whole = (hi - lo) // inner
    if whole > 0:  # whole rows
        out.append(((row, *rest), (whole, *shape[1:])))
        lo, row = lo + whole * inner, row + whole
    if lo < hi:  # a partial last row
        out += [((row, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, hi - lo)]
    return out


@dataclass(frozen=True)
class Held:
    """Elements [lo, lo + flat.numel()) of the flattened tp shard (shape ``shape``) of a
    tensor with sharding ``spec``; ``flat`` is the live 1-D tensor holding them."""

    flat: torch.Tensor
    lo: int
    shape: tuple[int, ...]
    spec: ShardSpec = REPLICATED
    rows: tuple[int, int] | None = None  # (first, E): dim 0 is rows [first, ...) of E (ep)

    @classmethod
    def whole(cls, t: torch.Tensor, spec: ShardSpec = REPLICATED) -> Held:
        """All of ``t`` (a tp shard, or a replicated tensor; a scalar is held as shape (1,),
        as checkpoints store it)."""
        shape = tuple(t.shape) or (1,)
        return cls(flat=t.reshape(-1), lo=0, shape=shape, spec=spec)

    @classmethod
    def zero(cls, flat: torch.Tensor, *, shape, rank: int, n: int,
             spec: ShardSpec = REPLICATED) -> Held:  # fmt: skip
        """ZeRO rank ``rank`` of ``n``'s shard ``flat`` of a tp shard of ``shape``."""
        lo, hi = shard_range(math.prod(shape), rank, n)
        assert flat.numel() == hi - lo, (flat.shape, lo, hi)
        return cls(flat=flat.reshape(-1), lo=lo, shape=tuple(shape), spec=spec)

    def global_shape(self, tp: int) -> tuple[int, ...]:
        shape = tuple(full_shape(torch.Size(self.shape), self.spec, tp))
        return shape if self.rows is None else (self.rows[1], *shape[1:])

    def boxes(self, *, tp_rank: int, tp: int) -> list[tuple[tuple, torch.Tensor]]:
        """(global offsets, the live view of that box) for each box this rank holds
        (module docstring); padding beyond the tensor's true size is left out."""
        out, start = [], self.lo
        dim, size = self.spec.dim, self.spec.size
        split = dim is not None and tp > 1
        if split:
            local = local_size(self.global_shape(tp)[dim], self.spec, tp)
            shift = (tp_rank // self.spec.replicas) * local
        for offsets, sizes in flat_boxes(self.shape, self.lo, self.lo + self.flat.numel()):
            n = math.prod(sizes)
            view = self.flat[start - self.lo : start - self.lo + n].view(sizes)
            start += n
            offsets = list(offsets)
            if self.rows is not None:  # an ep rank's experts (module docstring)
                offsets[0] += self.rows[0]
            if split:
                offsets[dim] += shift
                if size is not None:  # the vocabulary's padding rows are not stored
                    keep = min(sizes[dim], size - offsets[dim])
                    if keep <= 0:
                        continue
                    view = view.narrow(dim, 0, keep)
            out.append((tuple(offsets), view))
        return out
