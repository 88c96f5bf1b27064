"""Every collective plait issues goes through this module.

Each call is counted in the ``CommStats`` of the topology it runs on: calls and bytes per
(axis, operation). Tests assert exact counts (e.g. two all-reduces per tensor-parallel
layer forward) and the simulator's byte formulas are checked against them.

Byte convention, per call on one rank: all-reduce and broadcast count the tensor;
all-gather counts the gathered output; reduce-scatter counts the full input; send and
recv count the tensor. So an all-reduce moves as many counted bytes as the
reduce-scatter + all-gather pair that can replace it.

An axis of size 1 issues nothing and counts nothing: a single process runs the same code
with no communication at all.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

if TYPE_CHECKING:
    from plait.topology import Axis, Topology


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the operation."""


@dataclass
class CommStats:
    calls: Counter = field(default_factory=Counter)  # (axis, op) -> number of calls
    bytes: Counter = field(default_factory=Counter)  # (axis, op) -> bytes (see module doc)
    enabled: bool = True

    def record(self, axis: str, op: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[(axis, op)] += 1
            self.bytes[(axis, op)] += int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def count(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(
            n
            for (a, o), n in self.calls.items()
            if (axis is None or a == axis) and (op is None or o == op)
        )

    def nbytes(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(
            n
            for (a, o), n in self.bytes.items()
            if (axis is None or a == axis) and (op is None or o == op)
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _axis_name(axis) -> str:
    return getattr(axis, "value", str(axis))


def _essence(message: str) -> str:
    """The informative part of a backend error: no source path, no boilerplate advice."""
    first = (message.strip().splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    return first.split(". This is typically")[0].strip()


def _guard(topo: Topology, op: str, axis, fn):
    try:
        return fn()
    except RuntimeError as e:  # gloo/NCCL errors and timeouts surface as RuntimeError
        first = _essence(str(e)) or type(e).__name__
        raise CollectiveError(
            f"rank {topo.rank}: {op} on the {_axis_name(axis)} axis failed: {first}"
        ) from e


def all_reduce(
    t: torch.Tensor, *, topo: Topology, axis: Axis, op=dist.ReduceOp.SUM, async_op: bool = False
):
    """In-place all-reduce over ``axis``. Returns the work handle when ``async_op``."""
    group = topo.group(axis)
    if group is None:
        return None
    topo.stats.record(_axis_name(axis), "all_reduce", _nbytes(t))
    return _guard(
        topo, "all_reduce", axis, lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op)
    )


def all_gather(t: torch.Tensor, *, topo: Topology, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (in axis order)."""
    group = topo.group(axis)
    if group is None:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(topo.size(axis))]
    topo.stats.record(_axis_name(axis), "all_gather", len(parts) * _nbytes(t))
    _guard(topo, "all_gather", axis, lambda: dist.all_gather(parts, t, group=group))
    return torch.cat(parts, dim=dim)


def reduce_scatter(t: torch.Tensor, *, topo: Topology, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Sum ``t`` over ``axis`` and keep this rank's 1/n slice along ``dim``."""
    group = topo.group(axis)
    if group is None:
        return t
    n = topo.size(axis)
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} not divisible by {n}")
    topo.stats.record(_axis_name(axis), "reduce_scatter", _nbytes(t))
    chunks = [c.contiguous() for c in t.chunk(n, dim=dim)]
    out = torch.empty_like(chunks[0])
    # gloo implements reduce_scatter on lists of tensors, not reduce_scatter_tensor.
    _guard(topo, "reduce_scatter", axis, lambda: dist.reduce_scatter(out, chunks, group=group))
    return out


def broadcast(t: torch.Tensor, *, topo: Topology, axis: Axis, src_index: int = 0) -> torch.Tensor:
    """Broadcast from the ``src_index``-th rank of this rank's ``axis`` group, in place."""
    group = topo.group(axis)
    if group is None:
        return t
    topo.stats.record(_axis_name(axis), "broadcast", _nbytes(t))
    src = topo.group_ranks[axis][src_index]
    _guard(topo, "broadcast", axis, lambda: dist.broadcast(t, src=src, group=group))
    return t


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], *, topo: Topology, axis: Axis):
    """Issue point-to-point transfers together: ``ops`` holds ("send"|"recv", tensor, global
    peer rank). Returns the work handles (wait on them before reading a received tensor)."""
    if not ops:
        return []
    p2p = []
    for kind, t, peer in ops:
        topo.stats.record(_axis_name(axis), kind, _nbytes(t))
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, t, peer))
    return _guard(topo, "send/recv", axis, lambda: dist.batch_isend_irecv(p2p))


def wait(works, *, topo: Topology, what: str = "send/recv", axis="pp") -> None:
    for w in works or []:
        if w is not None:
            _guard(topo, what, axis, w.wait)


def world_all_reduce(t: torch.Tensor, *, topo: Topology, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over every rank (metrics, overflow flags, the global gradient norm)."""
    if topo.world_group is None:
        return t
    topo.stats.record("world", "all_reduce", _nbytes(t))
    _guard(topo, "all_reduce", "world", lambda: dist.all_reduce(t, op=op))
    return t


def barrier(*, topo: Topology) -> None:
    if topo.world_group is not None:
        _guard(topo, "barrier", "world", dist.barrier)
