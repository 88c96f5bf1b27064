"""One generation of a resilient run: its process groups, built on the coordinator's store
under the prefix ``gen{G}``, this worker's ``Topology`` in the generation's assignment, and the
drop of all of it when a peer fails.

Communication. ``Generation(...)`` is collective over the generation's members: every
member calls ``init_process_group`` on ``PrefixStore(f"gen{G}", store)`` (a rendezvous
through the store), then creates the same groups in the same order -- the world, each
pipeline in assignment order (with tp groups, one pp group per tp rank of each pipeline),
each tp group (pipeline by pipeline, stage by stage; none at tp 1), each replica group
(the ranks holding one unit of the model, one per pipeline; with tp groups one per tp rank)
in sorted order, then, when the assignment shards (ZeRO inside a replica), each stage
group (the K workers sharding one stage of one replica) in assignment order -- as
``new_group`` requires of every rank, member or not. All of it is read off the one
assignment every member has, so every rank creates the same list. Nothing else is issued
here.

Why the broken generation leaves nothing pending, and why re-forming cannot deadlock.
A generation is only ever left at a known point: the training thread raises out of the
collective that failed, or that ``abort`` ended (the coordinator declared a failure; called
from the worker's side thread, it issues nothing) (or, for a planned change, at a step boundary agreed by an
all-reduce), so no collective of this rank is left half-issued behind it, and ``drop``
then aborts every group of the generation (``_abort_process_group``: on NCCL
``ncclCommAbort``, which also ends kernels still waiting on a dead peer; a communicator
that saw a failure is never reused). On gloo an abort does not close the sockets -- only
the group's destruction does, measured here: with a reference left, peers wait for the
collective timeout; without, their next read fails within milliseconds. So ``drop``
replaces the groups in every ``Topology`` it handed out with ``DROPPED`` (using one
raises at once, never silently skips) and the caller drops the trainer, and the groups
go away. The next generation's groups are new objects on a new store prefix, created by
every member in the same order, so no rank can wait on a group another rank does not
build. A wait that no closed connection ends (on gloo, a send still waiting for its
receive, or a collective: ``comm.Abortable``) runs on the generation's waiter thread, and
``abort`` ends the training thread's side of it; on gloo ``drop`` lets the groups go on a
thread of their own (destroying a gloo group joins its threads, which finish a pending
operation first); a member that died during the rendezvous makes the others time out of
``init_process_group`` (its own timeout), and they report that like any failure.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import threading
import time
import weakref

import torch
import torch.distributed as dist

from plait import comm
from plait.resilience.assignment import Assignment, with_shard, with_tp
from plait.topology import Axis, Topology, resolve_device


class _Dropped:
    """Stands in for a dropped generation's groups: torch.distributed refuses it."""

    def __repr__(self) -> str:
        return "<dropped process group>"


DROPPED = _Dropped()


def unit_order(unit: str, n_layers: int) -> int:
    """embed, blocks.0 .. blocks.L-1, post, tied: the order units are reduced in."""
    if unit == "embed":
        return 0
    if unit.startswith("blocks."):
        return 1 + int(unit.split(".")[1])
    return n_layers + (1 if unit == "post" else 2)


def replica_groups(assignment: Assignment) -> dict[str, tuple[int, ...]]:
    """For every unit (sharded: every shard ``u/j``; with tp groups, every tp shard ``u@r``),
    the generation ranks that reduce its gradients together: its holder in each pipeline
    (sharded: in pipeline j of each replica; tp: the holder's tp rank r).
    ``tied``: the last stage of each pipeline -- its copy of the token embedding, or, in a
    one-stage pipeline, the embedding itself, whose gradient (the pipeline's whole one) it
    contributes a second time here and keeps from ``embed``'s group (``engines.py``).
    Present only when some pipeline holds a tied copy."""
    members = assignment.members
    holders: dict[str, list[int]] = {}
    for w in members:
        for unit in assignment.units_of(w):
            holders.setdefault(unit, []).append(members.index(w))
    tp = assignment.tp
    for j in {assignment.shard_index(i) for i in range(len(assignment.pipelines))}:
        for r in range(tp):
            (tied,) = with_shard(with_tp({"tied"}, r if tp > 1 else None), j)
            if tied in holders:
                holders[tied] = [
                    members.index(assignment.pipe_workers(i, r)[-1])
                    for i in range(len(assignment.pipelines))
                    if assignment.shard_index(i) == j
                ]
    return {u: tuple(sorted(r)) for u, r in holders.items()}


def stage_groups(assignment: Assignment) -> list[tuple[int, ...]]:
    """The generation ranks sharding one stage of one replica, every such group in
    assignment order (none unless the assignment shards)."""
    if assignment.shard_group == 1:
        return []
    members, out = assignment.members, []
    for first in range(0, len(assignment.pipelines), assignment.shard_group):
        for w in assignment.pipelines[first].workers:
            out.append(tuple(members.index(v) for v in assignment.stage_group(w)))
    return out


class Generation:
    """The process groups of generation ``number`` and this worker's topology in
    ``assignment`` (collective over the assignment's members: module docstring)."""

    def __init__(self, *, store, number: int, assignment: Assignment, worker: int, backend: str,
                 device, timeout: datetime.timedelta):  # fmt: skip
        self.number, self.assignment, self.worker = number, assignment, worker
        members = assignment.members
        self.rank, self.world = members.index(worker), len(members)
        self.device = resolve_device(device)
        self.timeout = timeout
        self._topologies: list[Topology] = []
        self._refs: list[weakref.ref] = []
        kw = {"device_id": self.device} if self.device.type == "cuda" else {}
        self.aborted = False
        self.abortable = comm.Abortable()  # ends this generation's waits (comm.wait)
        before = _sockets() if self.device.type != "cuda" else {}
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"gen{number}", store),
            rank=self.rank,
            world_size=self.world,
            timeout=timeout,
            **kw,
        )
        self.world_group = self._group(range(self.world))
        tp = assignment.tp
        pipe_groups = {
            (i, r): self._group(members.index(w) for w in assignment.pipe_workers(i, r))
            for i in range(len(assignment.pipelines))
            for r in range(tp)
        }
        tp_groups = {  # (pipeline, stage) -> its tp group (none at tp 1)
            (i, j): self._group(members.index(w) for w in p.workers[j * tp : (j + 1) * tp])
            for i, p in enumerate(assignment.pipelines)
            for j in range(p.num_stages)
        }
        self.units = replica_groups(assignment)
        self.groups = {r: self._group(r) for r in sorted(set(self.units.values()))}
        self.stage_groups = {r: self._group(r) for r in stage_groups(assignment)}
        # gloo's connections of this generation (its groups connect eagerly, all of them
        # here): what ``abort`` shuts down
        self._inodes = (
            set(_sockets().values()) - set(before.values()) if self.device.type != "cuda" else set()
        )
        i, j = assignment.place(worker)
        r = assignment.tp_rank(worker)
        pipe_ranks = [members.index(w) for w in assignment.pipe_workers(i, r)]
        groups = {Axis.PP: pipe_groups[(i, r)], Axis.TP: tp_groups[(i, j)]}
        self.topo = self._topology(
            pp=len(pipe_ranks),
            dp=len(assignment.pipelines),
            tp=tp,
            groups={a: g for a, g in groups.items() if g is not None},
            group_ranks={Axis.PP: pipe_ranks, Axis.DP: [self.rank],
                         Axis.TP: [members.index(w) for w in assignment.tp_group(worker)]},
            place=(j, i, r),
        )  # fmt: skip

    def _group(self, ranks):
        ranks = list(ranks)
        if len(ranks) < 2:
            return None
        group = dist.new_group(ranks, timeout=self.timeout)
        if self.rank in ranks:
            self._refs.append(weakref.ref(group))
            return group
        return None

    def _topology(self, *, tp: int = 1, **kw) -> Topology:
        topo = Topology(
            tp=tp,
            rank=self.rank,
            world_group=self.world_group,
            device=self.device,
            timeout=self.timeout,
            world=self.world,
            abort=self.abortable,
            **kw,
        )
        self._topologies.append(topo)
        return topo

    def replica_topology(self, ranks: tuple[int, ...]) -> Topology:
        """A topology whose dp axis is the replica group ``ranks`` (this rank in it): what
        the replica engine's all-reduces run on; counted on the topology's stats."""
        return self._dp_topology(ranks, self.groups[ranks])

    def stage_topology(self) -> Topology:
        """A topology whose dp axis is this rank's stage group (``stage_groups``): where
        the ZeRO engine inside a replica reduce-scatters and gathers."""
        ranks = tuple(
            self.assignment.members.index(w) for w in self.assignment.stage_group(self.worker)
        )
        return self._dp_topology(ranks, self.stage_groups[ranks])

    def _dp_topology(self, ranks: tuple[int, ...], group) -> Topology:
        topo = Topology(
            dp=len(ranks),
            tp=1,
            rank=self.rank,
            groups={Axis.DP: group},
            group_ranks={Axis.DP: list(ranks), Axis.PP: [self.rank], Axis.TP: [self.rank]},
            world_group=self.world_group,
            device=self.device,
            stats=self.topo.stats,
            timeout=self.timeout,
            place=(0, ranks.index(self.rank), 0),
            world=self.world,
            abort=self.abortable,
        )
        self._topologies.append(topo)
        return topo

    def world_topology(self) -> Topology:
        """A topology for point-to-point messages between any two ranks of the generation
        (the state copy of ``transfer.py``): the world group under the axis name
        ``"world"``, so that ``comm`` counts those bytes apart."""
        return self._topology(
            pp=1,
            dp=1,
            groups={"world": self.world_group} if self.world_group is not None else {},
            group_ranks={"world": list(range(self.world))},
            place=(0, 0, 0),
            stats=self.topo.stats,
        )

    def abort(self) -> None:
        """Make every collective of this generation, pending or future, fail at once:
        callable from a side thread while the training thread waits in one (module
        docstring). NCCL: ``ProcessGroup.abort()`` of each group (``ncclCommAbort``).
        gloo: no call of torch 2.13 does it (measured: ``abort()``, ``shutdown()``,
        ``_abort_process_group`` and ``destroy_process_group`` from a side thread left a
        pending all-reduce waiting until its timeout), but a connection that closes does:
        the generation's TCP connections are shut down (``shutdown(2)``: the descriptors
        stay gloo's to close), so its pending reads fail in milliseconds ("Connection closed
        by peer") here and at the peers. Listening sockets are left alone (gloo aborts the
        process when its accept fails)."""
        self.aborted = True
        self.abortable.abort()  # gloo: the training thread's wait returns (comm.Abortable)
        if self.device.type == "cuda":
            groups = [ref() for ref in self._refs]
            if dist.is_initialized():
                groups.append(dist.distributed_c10d._get_default_group())
            for group in groups:
                if group is not None:
                    group.abort()
            return
        for fd, inode in _sockets().items():
            if inode not in self._inodes:
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue  # closed meanwhile
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (any more)
            finally:
                sock.detach()

    def drop(self) -> int:
        """Abort every group of this generation and let go of them (module docstring).
        Returns how many of its groups are still referenced (0 when all went away)."""
        for topo in self._topologies:
            for axis in list(topo.groups):
                topo.groups[axis] = DROPPED
            # Topology is frozen for everyone else; the dropped generation is dead.
            object.__setattr__(topo, "world_group", DROPPED if topo.world_group else None)
        self.world_group, self.groups, self.stage_groups, self._topologies = None, {}, {}, []
        t0 = time.perf_counter()
        reaper = None
        if self.device.type != "cuda":
            # gloo: destroying a group joins its threads, which finish the operation they
            # run first -- one a dead peer never completes waits for gloo's own timeout.
            # So the groups are let go on a thread of their own, never this one.
            groups = [ref() for ref in self._refs]
            if dist.is_initialized():
                groups.append(dist.distributed_c10d._get_default_group())
            reaper = threading.Thread(target=_let_go, args=(groups,), name="plait-reaper",
                                      daemon=True)  # fmt: skip
            del groups
        if dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
        if reaper is not None:
            reaper.start()
            reaper.join(timeout=2.0)  # milliseconds, unless an operation is stuck
        t1 = time.perf_counter()
        stuck = reaper is not None and reaper.is_alive()
        if not stuck and any(ref() is not None for ref in self._refs):
            # only cycles (a traceback's frames, say) can still hold them: a full collection
            # takes 0.3-0.5 s with torch loaded, so only when needed
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.drop_times = {"abort_s": t1 - t0, "gc_s": time.perf_counter() - t1}
        return sum(ref() is not None for ref in self._refs)


def _let_go(groups: list) -> None:
    """Drop the last references to a dropped generation's groups (``Generation.drop``)."""
    groups.clear()


def _sockets() -> dict[int, str]:
    """{file descriptor: socket inode} of this process's sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def abort_partial() -> int:
    """After a rendezvous that failed half-way: drop whatever it created."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()
    gc.collect()
    return 0
