"""Every collective plait issues goes through this module.

Each call is counted in the ``CommStats`` of the topology it runs on (``topology.py``): calls and bytes per
(axis, operation). Tests assert exact counts (e.g. two all-reduces per tensor-parallel
layer forward) and the simulator's byte formulas are checked against them.

Byte convention, per call on one rank: all-reduce and broadcast count the tensor;
all-gather counts the gathered output; reduce-scatter counts the full input; send and
recv count the tensor. So an all-reduce moves as many counted bytes as the
reduce-scatter + all-gather pair that can replace it.

Bytes *sent* (``CommStats.sent``): what this rank puts on the wire for the call, under the
ring algorithms NCCL uses for large messages, n ranks in the group: all-reduce 2 (n-1)/n
x the tensor, all-gather and reduce-scatter (n-1)/n x the full buffer, broadcast (n-1)/n x
the tensor (a pipelined chain, averaged over its ranks), send the tensor, recv nothing.
A float: exact for groups of 2 and 4 ranks (dyadic factors), which the tests use.

An axis of size 1 issues nothing and counts nothing: a single process runs the same code
with no communication at all.

Rules every call keeps, so that what runs on gloo here also runs on NCCL (DESIGN.md
section 8):

- **Device tensors only.** A process group started with ``nccl`` has no CPU side: every
  tensor handed to this module must live on ``topo.device``, or the call is refused with
  one line naming it (``CommDeviceError``) -- on gloo as well, so a CPU test catches what
  would crash a GPU run.
- **Explicit groups.** Every call names its process group from the ``Topology`` (the axis
  group, or ``topo.world_group``); nothing here falls back to the default group, so a
  topology rebuilt on new groups after a failure carries all its communication along.
- **Tensor-form collectives.** All-gather and reduce-scatter work on one flat tensor
  (``all_gather_into`` / ``reduce_scatter_into``, NCCL's native forms: no list of
  per-rank buffers and no ``cat``), and take ``async_op``: the caller keeps the handle and
  ``wait``s right before it reads the result. Handles are issued from the training thread
  or from autograd's hooks, never from a thread pool, so each rank issues its
  collectives in program order -- the same order on every rank.
- **Waits that an abort ends.** Under ``--fault-tolerance`` a generation's topologies
  carry an ``Abortable``: on gloo, ``wait`` hands each handle to that generation's waiter
  thread and returns when it completes, or raises once the generation is aborted. gloo
  does not wake a send still waiting for its receive when the connection under it closes
  (measured: 8 of 30 trials of crossing batches aborted mid-stream hung in a send's
  ``wait`` until gloo's own timeout), so the training thread must never block in one
  itself. The waiter only waits: it issues nothing. On NCCL the group's ``abort()`` ends
  every pending operation and the handles are waited on the training thread as usual.
- **Point-to-point in batches.** ``batch_p2p`` posts a set of sends and receives together
  (one ``batch_isend_irecv``: one NCCL group). Callers post, as one batch, every message
  that could otherwise wait on another in the opposite direction (the pipeline schedules
  build those batches; ``schedules.validate`` checks them under NCCL's semantics).
"""

from __future__ import annotations

import queue
import re
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.topology import Call

ReduceOp = dist.ReduceOp

if TYPE_CHECKING:
    from plait.topology import Axis, Topology

# NCCL's single-tensor collectives; torch 2.13 renames them (the old names still work,
# with a deprecation warning), torch 2.6 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the operation."""


class CommDeviceError(ValueError):
    """A tensor handed to a collective does not live on the topology's device."""


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


def _abortable(topo: Topology) -> Abortable | None:
    """The generation's ``Abortable`` where waits must go through it (gloo: module
    docstring), else None."""
    return topo.abort if topo.abort is not None and topo.device.type == "cpu" else None


def _issue(topo: Topology, op: str, axis, call, async_op: bool = False):
    """``call(async_op)`` under ``_guard``; a blocking call of a resilient generation on
    gloo is issued asynchronously and waited through its ``Abortable``."""
    abort = _abortable(topo)
    if async_op or abort is None:
        return _guard(topo, op, axis, lambda: call(async_op))
    work = _guard(topo, op, axis, lambda: call(True))
    _guard(topo, op, axis, lambda: abort.wait(work))
    return None


def check_device(topo: Topology, op: str, *tensors: torch.Tensor) -> None:
    """Refuse (one line) a tensor that does not live on ``topo.device``."""
    for t in tensors:
        if t.device != topo.device:
            raise CommDeviceError(
                f"rank {topo.rank}: comm.{op} was given a tensor on {t.device}, but this "
                f"rank's collectives run on {topo.device} (NCCL has no CPU side); move it "
                "to topo.device first"
            )


def all_reduce(
    t: torch.Tensor, *, topo: Topology, axis: Axis, op=ReduceOp.SUM, async_op: bool = False
):
    """In-place all-reduce over ``axis``. Returns the work handle when ``async_op``."""
    group = topo.group(axis)
    if group is None:
        return None
    check_device(topo, "all_reduce", t)
    n = topo.size(axis)
    topo.stats.record(_axis_name(axis), "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t),
                      dtype=t.dtype)  # fmt: skip
    return _issue(topo, "all_reduce", axis,
                  lambda a: dist.all_reduce(t, op=op, group=group, async_op=a), async_op)  # fmt: skip


def all_gather_into(
    out: torch.Tensor, t: torch.Tensor, *, topo: Topology, axis: Axis, async_op: bool = False
):
    """Every rank's ``t`` (same shape everywhere) into ``out`` = n x ``t.numel()`` elements,
    in axis order. With an axis of size 1, ``out`` is filled with ``t`` locally. Returns the
    work handle when ``async_op`` (wait on it before reading ``out``)."""
    return _single_tensor("all_gather", _all_gather_single, out, t, topo, axis, async_op)


def reduce_scatter_into(
    out: torch.Tensor, t: torch.Tensor, *, topo: Topology, axis: Axis, async_op: bool = False
):
    """Sum ``t`` (n equal consecutive pieces) over ``axis`` and keep this rank's piece in
    ``out``. With an axis of size 1, ``out`` is ``t`` copied. Returns the work handle when
    ``async_op``."""
    return _single_tensor("reduce_scatter", _reduce_scatter_single, out, t, topo, axis, async_op)


def _single_tensor(op: str, fn, out, t, topo: Topology, axis, async_op: bool):
    """An all-gather or reduce-scatter between one flat input and one flat output (the
    concatenated form every backend accepts); counted bytes as the module docstring says."""
    group = topo.group(axis)
    if group is None:
        out.view(-1).copy_(t.reshape(-1))
        return None
    check_device(topo, op, out, t)
    full = _nbytes(out if op == "all_gather" else t)  # the gathered / reduced buffer
    n = topo.size(axis)
    topo.stats.record(_axis_name(axis), op, full, (n - 1) / n * full, dtype=t.dtype)
    flat_out, flat_in = out.view(-1), t.contiguous().view(-1)
    return _issue(
        topo, op, axis, lambda a: fn(flat_out, flat_in, group=group, async_op=a), async_op
    )


def _stacked_in_order(shape, dim: int) -> bool:
    """Pieces of ``shape`` stacked along a new first dimension lie in memory as their
    concatenation along ``dim``: every dimension before ``dim`` has size 1 (dim 0 always;
    sequence parallelism's (B, T, C) split along T at one sequence per micro-batch)."""
    return all(size == 1 for size in shape[:dim])


def joined(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """The concatenation along ``dim`` of ``rows`` (n, ...) stacked as a collective lays
    them out: a view where memory already holds it (``_stacked_in_order``), else a copy."""
    n, *shape = rows.shape
    if _stacked_in_order(shape, dim):
        return rows.view(*shape[:dim], n * shape[dim], *shape[dim + 1 :])
    return torch.cat(rows.unbind(0), dim=dim)


def all_gather(t: torch.Tensor, *, topo: Topology, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (in axis order)."""
    if topo.group(axis) is None:
        return t
    n = topo.size(axis)
    out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
    all_gather_into(out, t, topo=topo, axis=axis)
    return joined(out, dim)


def reduce_scatter(t: torch.Tensor, *, topo: Topology, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Sum ``t`` over ``axis`` and keep this rank's 1/n slice along ``dim``."""
    if topo.group(axis) is None:
        return t
    n = topo.size(axis)
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} not divisible by {n}")
    # the pieces in rank order, one after another: ``t`` itself where it already lies so
    pieces = t.contiguous() if _stacked_in_order(t.shape, dim) else torch.stack(t.chunk(n, dim=dim))
    shape = list(t.shape)
    shape[dim] //= n
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    reduce_scatter_into(out, pieces, topo=topo, axis=axis)
    return out


def broadcast(t: torch.Tensor, *, topo: Topology, axis: Axis, src_index: int = 0) -> torch.Tensor:
    """Broadcast from the ``src_index``-th rank of this rank's ``axis`` group, in place."""
    group = topo.group(axis)
    if group is None:
        return t
    check_device(topo, "broadcast", t)
    n = topo.size(axis)
    topo.stats.record(_axis_name(axis), "broadcast", _nbytes(t), (n - 1) / n * _nbytes(t),
                      dtype=t.dtype)  # fmt: skip
    src = topo.group_ranks[axis][src_index]
    _issue(topo, "broadcast", axis, lambda a: dist.broadcast(t, src=src, group=group, async_op=a))
    return t


def batch_p2p(ops: list[tuple[str, torch.Tensor, int]], *, topo: Topology, axis: Axis):
    """Post point-to-point transfers together, as one batch: ``ops`` holds ("send"|"recv",
    tensor, global peer rank), every peer in this rank's ``axis`` group. Returns the work
    handles; wait on all of them before reading a received tensor or reusing a sent one
    (on NCCL the batch is one group and completes as a whole)."""
    if not ops:
        return []
    group = topo.group(axis)
    if group is None:
        raise ValueError(
            f"rank {topo.rank}: point-to-point on the {_axis_name(axis)} axis of size 1"
        )
    p2p = []
    for kind, t, peer in ops:
        check_device(topo, kind, t)
        topo.stats.record(_axis_name(axis), kind, _nbytes(t), _nbytes(t) if kind == "send" else 0)
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, t, peer, group=group))
    works = _guard(topo, "send/recv", axis, lambda: dist.batch_isend_irecv(p2p))
    stats = topo.stats
    if stats.log is not None:  # the batch as one entry, and where its waits will point
        stats.posted.update(dict.fromkeys(map(id, works or []), len(stats.log)))
        messages = tuple((kind, peer, _nbytes(t)) for kind, t, peer in ops)
        stats.note(Call(_axis_name(axis), "batch", str(ops[0][1].dtype).removeprefix("torch."),
                        sum(m[2] for m in messages), messages))  # fmt: skip
    return works


class Abortable:
    """The abort of one resilient generation (``resilience/generation.py``) and, on gloo,
    the thread that waits on its handles (module docstring: "Waits that an abort ends").

    ``abort()`` may be called from any thread. A handle whose wait never returns (a gloo
    send whose receive never comes) keeps its waiter thread, and the handle with its
    buffers, until gloo's own timeout ends it; the next generation has a waiter of its own.
    """

    POLL_S = 0.05  # how often a waiting training thread looks at the abort

    def __init__(self) -> None:
        self.event = threading.Event()
        self._queue: queue.SimpleQueue | None = None

    def abort(self) -> None:
        self.event.set()
        if self._queue is not None:
            self._queue.put(None)  # the waiter ends once it is past what it waits on

    @property
    def aborted(self) -> bool:
        return self.event.is_set()

    def wait(self, work) -> None:
        """Block until ``work`` completes (re-raising its error), or raise once aborted."""
        if self.aborted:
            raise RuntimeError("the generation was aborted")
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(self._queue,), name="plait-waiter",
                             daemon=True).start()  # fmt: skip
        done, box = threading.Event(), [work, None]
        self._queue.put((box, done))
        while not done.wait(self.POLL_S):
            if self.aborted:
                raise RuntimeError("the generation was aborted while this rank waited")
        if box[1] is not None:
            raise box[1]

    def _run(self, q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            box, done = item
            try:
                box[0].wait()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                box[1] = e if isinstance(e, RuntimeError) else RuntimeError(str(e))
            box[0] = None
            done.set()


def wait(works, *, topo: Topology, what: str = "send/recv", axis="pp") -> None:
    works = [w for w in works or [] if w is not None]
    if topo.stats.log is not None and works:  # which logged batches this waits for
        batches = {topo.stats.posted.pop(id(w), None) for w in works} - {None}
        if batches:
            topo.stats.note(Call(_axis_name(axis), "wait", "", 0, tuple(sorted(batches))))
    abort = _abortable(topo)
    for w in works:
        _guard(topo, what, axis, w.wait if abort is None else lambda w=w: abort.wait(w))


def world_all_reduce(t: torch.Tensor, *, topo: Topology, op=ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over every rank of the run (metrics, overflow flags, the global gradient
    norm), on the topology's own world group."""
    if topo.world_group is None:
        return t
    check_device(topo, "world_all_reduce", t)
    n = topo.world_size
    topo.stats.record("world", "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t),
                      dtype=t.dtype)  # fmt: skip
    _issue(topo, "all_reduce", "world",
           lambda a: dist.all_reduce(t, op=op, group=topo.world_group, async_op=a))  # fmt: skip
    return t


def host_values(t: torch.Tensor) -> list:
    """``t.tolist()``: the one read of a step's reduced statistics on the host. Under
    ``plait rehearse`` the tensors are fake (shapes and dtypes, no storage: there are no
    values to read), so zeros of ``t``'s shape stand in and the step goes on through the
    code a real one runs; the rehearsal reports none of them."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        assert t.dim() <= 1, "statistics are a scalar or a vector"
        zero = 0.0 if t.is_floating_point() else 0
        return [zero] * t.numel() if t.dim() else zero
    return t.tolist()


def barrier(*, topo: Topology, axis: Axis | None = None) -> None:
    """Every rank of the run (or of this rank's ``axis`` group) waits for all the others.
    On NCCL this also brings up the group's communicator with every member present,
    which a first batched point-to-point call on it needs."""
    group = topo.world_group if axis is None else topo.group(axis)
    if group is not None:
        _issue(topo, "barrier", axis or "world", lambda a: dist.barrier(group=group, async_op=a))


def all_to_all_into(out: torch.Tensor, t: torch.Tensor, *, topo: Topology, axis: Axis):
    """``t`` as n equal consecutive pieces: piece j goes to the j-th rank of ``axis``, and
    ``out``'s piece i is what the i-th rank sent here (NCCL's ``all_to_all_single``; the
    Ulysses exchange of ``parallel/context.py``). Counted: ``t``; sent: (n-1)/n of it (the
    piece a rank keeps does not travel). With an axis of size 1, ``out`` is ``t`` copied."""
    group = topo.group(axis)
    if group is None:
        out.view(-1).copy_(t.reshape(-1))
        return None
    check_device(topo, "all_to_all", out, t)
    n = topo.size(axis)
    topo.stats.record(_axis_name(axis), "all_to_all", _nbytes(t), (n - 1) / n * _nbytes(t),
                      dtype=t.dtype)  # fmt: skip
    flat_out, flat_in = out.view(-1), t.contiguous().view(-1)
    return _issue(topo, "all_to_all", axis,
                  lambda a: dist.all_to_all_single(flat_out, flat_in, group=group, async_op=a))  # fmt: skip


def all_to_all_v(
    out: torch.Tensor,
    t: torch.Tensor,
    *,
    out_splits: list[int],
    in_splits: list[int],
    topo: Topology,
    axis: Axis,
):
    """Rows of ``t`` in consecutive pieces of ``in_splits`` rows: piece j goes to the j-th
    rank of ``axis``; ``out``'s piece i (``out_splits[i]`` rows) is what the i-th rank sent
    here (``all_to_all_single`` with splits: expert parallelism's token exchange). Any
    piece may be empty. Counted: ``t``; sent: the rows that leave this rank. With an axis
    of size 1, ``out`` is ``t`` copied."""
    group = topo.group(axis)
    if group is None:
        out.copy_(t)
        return None
    check_device(topo, "all_to_all", out, t)
    me = topo.group_ranks[axis].index(topo.rank)
    row = _nbytes(t[:1]) if t.shape[0] else 0
    topo.stats.record(_axis_name(axis), "all_to_all", _nbytes(t),
                      (t.shape[0] - in_splits[me]) * row, dtype=t.dtype)  # fmt: skip
    return _issue(topo, "all_to_all", axis,
                  lambda a: dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits,
                                                   group=group, async_op=a))  # fmt: skip
