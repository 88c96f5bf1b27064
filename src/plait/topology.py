"""The rank grid: axes pp, dp, cp, tp (tp fastest-varying), and the process groups of each axis.

Global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. Worked example, 8
ranks with tp=2, pp=2, dp=2 (cp=1):

    rank:      0  1  2  3  4  5  6  7
    pp_rank:   0  0  0  0  1  1  1  1
    dp_rank:   0  0  1  1  0  0  1  1
    tp_rank:   0  1  0  1  0  1  0  1

    tp groups: [0,1] [2,3] [4,5] [6,7]   (neighbours: tensor parallelism wants the fastest link)
    dp groups: [0,2] [1,3] [4,6] [5,7]
    pp groups: [0,4] [1,5] [2,6] [3,7]

Context parallelism (cp) sits between dp and tp, as in Megatron-Core: tensor parallelism
keeps the fastest link, and the cp ring comes next (its K/V exchange runs every layer). The
cp ranks of one dp rank take the same rows and split each sequence (parallel/context.py),
so gradients are reduced over dp x cp: ``grad_view`` is the topology the data-parallel
engines see, whose dp axis is that product. Because cp is laid out right after dp, merging
the two gives a grid of its own -- dp' = dp x cp, dp_rank' = dp_rank x cp + cp_rank --
and every engine runs on it unchanged. Worked example, 8 ranks with cp=2, dp=2, tp=2:
cp groups [0,2] [1,3] [4,6] [5,7]; dp groups [0,4] [1,5] [2,6] [3,7]; dp x cp groups
[0,2,4,6] [1,3,5,7].

``Topology`` is built once per worker and passed by keyword. It is immutable; after a
failure a new one is built (on a new store prefix), never patched. Process groups live
here and nowhere else. The world group is a group of its own (``new_group`` over every
rank), not the default group, so that everything a topology does runs on groups it
created: a resilient run builds each generation's default group on the store prefix
``gen{G}`` (``plait.resilience.generation``) and the same code runs on it.

Grids and pipelines that differ. A regular run is the grid above. A resilient run after
a failure may hold pipelines of different lengths (``plait.resilience``: templates);
such a topology names this rank's place explicitly (``place``: pipeline rank, pipeline
index, tp rank) and the number of ranks (``world``), and ``pp`` is the length of this
rank's own pipeline, ``dp`` the number of pipelines.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist


class Call(NamedTuple):
    """One entry of ``CommStats.log``: a collective, a batch of point-to-point messages
    (``op`` "batch"; ``peers``: (kind, global peer rank, bytes) of each message, in
    posting order), or the wait for earlier batches (``op`` "wait"; ``peers``: their
    entries' indices in the log)."""

    axis: str
    op: str
    dtype: str
    nbytes: int
    peers: tuple = ()


@dataclass
class CommStats:
    """What a topology's collectives moved: calls and bytes per (axis, operation), counted
    by ``comm.py`` (its docstring gives the byte conventions). With ``log`` a list, every
    call is also appended to it as a ``Call``, in the order issued (``plait rehearse``
    compares that order between a rehearsal and a real run)."""

    calls: Counter = field(default_factory=Counter)  # (axis, op) -> number of calls
    bytes: Counter = field(default_factory=Counter)  # (axis, op) -> bytes (see module doc)
    sent: Counter = field(default_factory=Counter)  # (axis, op) -> bytes on the wire (float)
    enabled: bool = True
    log: list[Call] | None = None
    posted: dict = field(default_factory=dict, repr=False)  # id(work) -> its batch's log index

    def record(self, axis: str, op: str, nbytes: int, sent: float = 0.0, *,
               dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """Count one call; with its ``dtype`` also log it (the messages of a batch are
        counted one by one and logged as one entry: ``note``)."""
        if self.enabled:
            self.calls[(axis, op)] += 1
            self.bytes[(axis, op)] += int(nbytes)
            self.sent[(axis, op)] += sent
            if dtype is not None:
                self.note(Call(axis, op, str(dtype).removeprefix("torch."), int(nbytes)))

    def note(self, call: Call) -> None:
        """Append ``call`` to the log, if there is one (counts nothing)."""
        if self.enabled and self.log is not None:
            self.log.append(call)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.sent.clear()

    def sent_bytes(self, axis: str | None = None, op: str | None = None) -> float:
        return sum(
            n
            for (a, o), n in self.sent.items()
            if (axis is None or a == axis) and (op is None or o == op)
        )

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


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: "cuda" becomes this process's current CUDA device, so
    that a tensor's device and the topology's compare equal (``comm.check_device``)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class Axis(str, enum.Enum):
    PP = "pp"
    DP = "dp"
    TP = "tp"
    CP = "cp"


GRID = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)  # slowest- to fastest-varying


def coords(rank: int, *, pp: int, dp: int, tp: int, cp: int = 1) -> dict[Axis, int]:
    """Coordinates of a global rank: ``coords(5, pp=2, dp=2, tp=2) == {PP: 1, DP: 0, CP: 0,
    TP: 1}``."""
    if not 0 <= rank < pp * dp * cp * tp:
        raise ValueError(f"rank {rank} outside a grid of {pp * dp * cp * tp} ranks")
    return {
        Axis.TP: rank % tp,
        Axis.CP: (rank // tp) % cp,
        Axis.DP: (rank // (tp * cp)) % dp,
        Axis.PP: rank // (tp * cp * dp),
    }


def rank_of(*, pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int, cp_rank: int = 0,
            cp: int = 1) -> int:  # fmt: skip
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def axis_groups(axis: Axis, *, pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    """Every group along ``axis``, in a fixed order (each rank must create them identically)."""
    sizes = {Axis.PP: pp, Axis.DP: dp, Axis.CP: cp, Axis.TP: tp}
    others = [a for a in GRID if a != axis]
    groups = []
    for fixed in itertools.product(*(range(sizes[a]) for a in others)):
        at = dict(zip(others, fixed))
        members = []
        for k in range(sizes[axis]):
            at[axis] = k
            members.append(rank_of(pp_rank=at[Axis.PP], dp_rank=at[Axis.DP], cp_rank=at[Axis.CP],
                                   tp_rank=at[Axis.TP], dp=dp, cp=cp, tp=tp))  # fmt: skip
        groups.append(members)
    return groups


def dp_cp_groups(*, pp: int, dp: int, tp: int, cp: int) -> list[list[int]]:
    """The groups gradients are reduced over: every (dp, cp) pair of one (pp, tp) place,
    in rank order -- which is dp-major, so a group's i-th member has dp' rank i."""
    return [
        sorted(
            rank_of(pp_rank=i, dp_rank=d, cp_rank=c, tp_rank=t, dp=dp, cp=cp, tp=tp)
            for d in range(dp)
            for c in range(cp)
        )  # fmt: skip
        for i in range(pp)
        for t in range(tp)
    ]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """This worker's place in the grid and the process groups it belongs to.

    ``group(axis)`` is None when that axis has size 1 (no communication needed);
    ``world_group`` is None for a single process.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    rank: int = 0
    groups: dict = field(default_factory=dict)  # Axis -> ProcessGroup, for axes of size > 1
    group_ranks: dict = field(default_factory=dict)  # Axis -> list of global ranks
    world_group: object | None = None
    device: torch.device = torch.device("cpu")
    stats: CommStats = field(default_factory=CommStats)
    timeout: datetime.timedelta | None = None  # of every group built here (``build``)
    # Not a grid (module docstring): this rank's (pp_rank, dp_rank, tp_rank), and the
    # number of ranks. None: read off the grid.
    place: tuple[int, int, int] | None = None
    world: int | None = None
    # cp > 1: the dp x cp group (its ProcessGroup, its global ranks): ``grad_view``
    dp_cp: tuple | None = None
    # a resilient generation's abort (``comm.Abortable``): waits on its handles end with
    # an error once it is aborted; None: waits block as the backend does
    abort: object | None = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Topology:
        return cls(
            group_ranks={a: [0] for a in Axis},
            device=resolve_device(device),
        )

    @classmethod
    def build(
        cls,
        *,
        pp: int,
        dp: int,
        tp: int,
        cp: int = 1,
        device: torch.device | str = "cpu",
        timeout: datetime.timedelta | None = None,
    ) -> Topology:
        """Create every axis group (collectively: all ranks must call this) and keep ours.

        ``timeout`` bounds every collective on the axis groups; new_group does not inherit
        the world group's timeout (it would default to 30 minutes), so it is passed here.
        """
        world = pp * dp * cp * tp
        if not dist.is_initialized():
            if world != 1:
                raise RuntimeError("Topology.build needs torch.distributed initialised")
            return cls.single(device)
        if dist.get_world_size() != world:
            raise ValueError(
                f"layout pp={pp} x dp={dp} x cp={cp} x tp={tp} = {world} ranks but "
                f"{dist.get_world_size()} processes were started"
            )
        rank = dist.get_rank()
        groups, group_ranks = {}, {}
        for axis in (Axis.TP, Axis.CP, Axis.DP, Axis.PP):
            for ranks in axis_groups(axis, pp=pp, dp=dp, cp=cp, tp=tp):
                # new_group is collective over the world even for groups we are not in.
                pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    group_ranks[axis] = ranks
                    if pg is not None:
                        groups[axis] = pg
        dp_cp = None
        if cp > 1:  # gradients are reduced over dp x cp (``grad_view``)
            for ranks in dp_cp_groups(pp=pp, dp=dp, cp=cp, tp=tp):
                pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    dp_cp = (pg, ranks)
        # the world as a group of its own: communication never uses the default group
        world_group = dist.new_group(list(range(world)), timeout=timeout) if world > 1 else None
        return cls(
            pp=pp,
            dp=dp,
            tp=tp,
            cp=cp,
            dp_cp=dp_cp,
            rank=rank,
            groups=groups,
            group_ranks=group_ranks,
            world_group=world_group,
            device=resolve_device(device),
            timeout=timeout,
        )

    def shard_groups(self, k: int) -> tuple[Topology, Topology | None]:
        """Hybrid sharding (HSDP): the dp axis cut into blocks of ``k`` ranks. Returns
        (shard, across) topologies whose dp axis is the sub-group: dp rank j shards
        with the k dp ranks of its block, and all-reduces with the ranks holding the same
        shard in the other blocks. Worked example, dp=4 (global ranks 0-3), k=2: shard
        groups [0,1] [2,3], across groups [0,2] [1,3]. (self, None) when k == dp.

        Both share ``stats`` (their collectives count on the "dp" axis) and the timeout.
        Collective over the world: every rank creates every group, in the same order.
        """
        dp = self.dp
        if k == dp:
            return self, None
        if k < 1 or dp % k:
            raise ValueError(f"--zero-shard-group {k} must divide --dp {dp}")
        mine: dict[str, tuple[list[int], object]] = {}
        if dist.is_initialized():
            for ranks in axis_groups(Axis.DP, pp=self.pp, dp=dp, tp=self.tp):
                for kind, sets in (
                    ("shard", [ranks[i : i + k] for i in range(0, dp, k)]),
                    ("across", [ranks[j::k] for j in range(k)]),
                ):
                    for members in sets:
                        pg = (
                            dist.new_group(members, timeout=self.timeout)
                            if len(members) > 1
                            else None
                        )
                        if self.rank in members:
                            mine[kind] = (members, pg)

        def sub(kind: str, size: int) -> Topology:
            members, pg = mine.get(kind, ([self.rank], None))
            return Topology(
                pp=1,
                dp=size,
                tp=1,
                rank=self.rank,
                groups={Axis.DP: pg} if pg is not None else {},
                group_ranks={Axis.DP: members, Axis.PP: [self.rank], Axis.TP: [self.rank]},
                world_group=self.world_group,
                device=self.device,
                stats=self.stats,
                timeout=self.timeout,
                place=(0, members.index(self.rank), 0),  # its dp_rank: its place in the group
            )

        return sub("shard", k), sub("across", dp // k)

    def replica_grid(self, k: int) -> tuple[Topology, Topology]:
        """Replicas of ``k`` dp ranks each (``dp_algos``: local SGD, DiLoCo, gossip run
        across them, ZeRO shards inside them). Returns (replica, across):

        - ``replica``: this rank's replica as a grid of its own -- pp x k x tp ranks, the
          same tp and pp groups, the dp axis cut to the k ranks of the replica, and a
          world group holding exactly the replica's ranks.
          Its ``rank`` is this rank's place in that grid (its coordinates are right);
          ``group_ranks`` keep global ranks.
        - ``across``: the dp axis of the R = dp / k ranks that hold the same place in
          every replica (``self`` when k == 1).

        Worked example, 8 ranks, tp=2 dp=4, k=2: replicas {0,1,2,3} and {4,5,6,7} (dp
        ranks 0-1 and 2-3); replica dp groups [0,2] [1,3] [4,6] [5,7]; across groups
        [0,4] [2,6] [1,5] [3,7]. Collective over the world: every rank creates every
        group, in the same order (``shard_groups``', then one per replica).
        """
        dp = self.dp
        if k < 1 or dp % k:
            raise ValueError(f"--zero-shard-group {k} must divide --dp {dp}")
        if k == 1:
            shard, across = None, self
        else:
            shard, across = self.shard_groups(k)
        block = self.dp_rank // k
        mine = None
        for b in range(dp // k):  # one world group per replica
            members = [
                rank_of(pp_rank=i, dp_rank=b * k + j, tp_rank=t, dp=dp, tp=self.tp)
                for i in range(self.pp)
                for j in range(k)
                for t in range(self.tp)
            ]
            pg = None
            if dist.is_initialized() and len(members) > 1:
                pg = dist.new_group(members, timeout=self.timeout)
            if b == block:
                mine = pg
        groups = {a: g for a, g in self.groups.items() if a != Axis.DP}
        if shard is not None and shard.group(Axis.DP) is not None:
            groups[Axis.DP] = shard.group(Axis.DP)
        dp_members = shard.group_ranks[Axis.DP] if shard is not None else [self.rank]
        replica = Topology(
            pp=self.pp,
            dp=k,
            tp=self.tp,
            rank=rank_of(
                pp_rank=self.pp_rank,
                dp_rank=self.dp_rank % k,
                tp_rank=self.tp_rank,
                dp=k,
                tp=self.tp,
            ),
            groups=groups,
            group_ranks={**self.group_ranks, Axis.DP: dp_members},
            world_group=mine,
            device=self.device,
            stats=self.stats,
            timeout=self.timeout,
        )
        return replica, across

    def grad_view(self) -> Topology:
        """The topology the data-parallel engines see: ``self`` without cp; with cp, the
        same grid with dp and cp merged into one axis of dp x cp ranks (module docstring),
        whose dp group is the dp x cp group. Shares ``stats``: its traffic counts on the
        "dp" axis. Creates no group (``build`` made the dp x cp ones)."""
        if self.cp == 1:
            return self
        pg, members = self.dp_cp
        groups = {a: g for a, g in self.groups.items() if a not in (Axis.DP, Axis.CP)}
        if pg is not None:
            groups[Axis.DP] = pg
        return dataclasses.replace(
            self,
            dp=self.dp * self.cp,
            cp=1,
            groups=groups,
            group_ranks={**self.group_ranks, Axis.DP: members, Axis.CP: [self.rank]},
            dp_cp=None,
        )

    @property
    def world_size(self) -> int:
        return self.world if self.world is not None else self.pp * self.dp * self.cp * self.tp

    def size(self, axis: Axis) -> int:
        return {Axis.PP: self.pp, Axis.DP: self.dp, Axis.CP: self.cp, Axis.TP: self.tp}[axis]

    def coord(self, axis: Axis) -> int:
        if self.place is not None:  # resilient runs: no cp (RunConfig refuses it)
            return dict(zip((Axis.PP, Axis.DP, Axis.TP, Axis.CP), (*self.place, 0)))[axis]
        return coords(self.rank, pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp)[axis]

    def group(self, axis: Axis):
        return self.groups.get(axis)

    @property
    def tp_rank(self) -> int:
        return self.coord(Axis.TP)

    @property
    def cp_rank(self) -> int:
        return self.coord(Axis.CP)

    @property
    def dp_rank(self) -> int:
        return self.coord(Axis.DP)

    @property
    def pp_rank(self) -> int:
        return self.coord(Axis.PP)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the pipeline rank ``pp_rank`` in this rank's pipeline."""
        return self.group_ranks[Axis.PP][pp_rank]
