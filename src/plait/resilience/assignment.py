"""A generation's assignment: which worker holds which stage of which pipeline, the rows of the
global batch each pipeline takes, and where a worker gets the state it lacks.

Communication: none (pure data; the coordinator makes assignments, every worker reads them).

Units of state. A stage of layers [first, stop) holds the units ``embed`` (first == 0:
the token and position embeddings), ``blocks.i`` for its layers, ``post`` (stop == L:
the final norm and the head) and, with tied embeddings on a last stage that is not also
the first, ``tied`` (its copy of the token embedding). A unit is a set of parameters with
their optimizer state; ``names_in_unit`` finds them in a model by name, so the sender
and the receiver of a unit list the same tensors in the same order without talking.

Worked example: dp 2 x pp 2 on 4 layers, workers 0-3 as ranks of the grid: pipelines
[0, 2] and [1, 3], stages (0, 2) and (2, 4). Worker 3 dies. Three workers left: the
planner picks three 1-stage pipelines (``templates.choose``); workers 0 and 1 keep their
``embed``, ``blocks.0``, ``blocks.1`` and need ``blocks.2``, ``blocks.3``, ``post``,
which worker 2 alone still holds: it sends them to both (``sources``).

ZeRO inside a replica (``--zero 1|2 --zero-shard-group K``, hybrid sharding). The pipelines
come in replicas of K that share one template: pipelines [rK, (r+1)K) form replica r, and
the K workers of a stage in a replica shard every parameter of the stage over themselves
(``flat.shard_range``: shard j of a parameter depends only on its size and K). Pipeline i
has shard index j = i mod K in its replica, and its workers hold shard j of their units: the unit
``blocks.3/1`` is shard 1 of block 3's parameters and of their AdamW moments. The rest of
this module works on those names unchanged: a pipeline's units carry its shard, holdings and
moves name shards, and the holders of ``u/j`` -- pipeline j of every replica holding ``u`` --
are the ranks that sum that shard's gradient across replicas (``generation.py``). Every
shard has a copy in each replica, so F + 1 replicas keep F + 1 copies of every shard.

Interleaved stages (``--vpp V``): a pipeline's ``stages`` are its virtual stages (chunks),
s x V of them, stage j holding chunks j, j + s, ... (``Pipeline.chunks``); its units are
those of its chunks (``chunk_units``): with s = 2, V = 2 on 4 layers, stage 0 holds
``embed``, ``blocks.0``, ``blocks.2`` and stage 1 ``blocks.1``, ``blocks.3``, ``post``,
``tied``. Everything below works on those units unchanged.

Tensor parallelism (``--tp T``). The unit that fails and is replaced is a tp group: T
workers with consecutive ids ``[gT, (g+1)T)`` (the coordinator starts and replaces them T
at a time, so the ids stay aligned), one stage of one pipeline, each holding its tp shard
of every tensor of the stage. A ``Pipeline``'s ``workers`` lists them stage-major, tp rank
fastest: stage j is ``workers[jT:(j+1)T]``. Planning works on groups -- ``assign`` and
``sources`` see each group as its first worker (``lead``), exactly as they see a worker at
T = 1 -- and ``expand`` turns the plan into workers: group (w, w+1, ...) for lead w, and
each move of a unit between two groups into T moves, tp rank r of the sender to tp rank r
of the receiver (``blocks.3@r``: the tp shard r of block 3, the same shape on both sides;
nothing is ever gathered whole). A worker's units carry its tp rank, so the holders of
``u@r`` -- tp rank r of every pipeline holding ``u`` -- sum that shard's gradient across
replicas. Worked example, tp 2, pp 2, dp 2 on 4 layers: workers 0-7, groups (0, 1)
(2, 3) (4, 5) (6, 7); pipelines (0, 1, 4, 5) and (2, 3, 6, 7) (the grid's rank order);
worker 5 dies, so does its peer 4; with three groups the planner picks a two-stage and a
one-stage pipeline, the one-stage one (4 layers) on group (0, 1) or (2, 3), which receives
``blocks.2@0``, ``blocks.3@0``, ``post@0`` from worker 6 into its tp rank 0 and the
``@1`` shards from worker 7 into its tp rank 1.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from plait.resilience.templates import Template, allocate


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    workers: tuple[int, ...]  # the workers of each stage (its tp group), in stage order
    stages: tuple[tuple[int, int], ...]  # (first layer, stop) of each virtual stage
    rows: tuple[int, int]  # [lo, hi) of every global batch
    vpp: int = 1  # chunks a stage (interleaved): stage j holds stages[j], stages[j + s], ...

    @property
    def num_stages(self) -> int:
        return len(self.stages) // self.vpp

    def chunks(self, j: int) -> tuple[tuple[int, int], ...]:
        """The (first layer, stop) of each chunk stage ``j`` holds."""
        return self.stages[j :: self.num_stages]


@dataclass(frozen=True, kw_only=True)
class Assignment:
    pipelines: tuple[Pipeline, ...]
    n_layers: int
    tied: bool
    shard_group: int = 1  # K: pipelines per replica, sharding each stage over K workers
    tp: int = 1  # workers per stage: a tp group (module docstring)

    def shard_index(self, i: int) -> int | None:
        """The shard pipeline ``i``'s workers hold (None: not sharded)."""
        return i % self.shard_group if self.shard_group > 1 else None

    def stage_group(self, worker: int) -> list[int]:
        """The workers sharding ``worker``'s stage in its replica (itself alone if K = 1)."""
        i, j = self.place(worker)
        first, r = i - i % self.shard_group, self.tp_rank(worker)
        return [self.pipelines[first + k].workers[j * self.tp + r] for k in range(self.shard_group)]

    @property
    def members(self) -> list[int]:
        """Workers in rank order (pipeline by pipeline, stage by stage)."""
        return [w for p in self.pipelines for w in p.workers]

    def place(self, worker: int) -> tuple[int, int]:
        """(pipeline index, stage index) of ``worker``."""
        for i, p in enumerate(self.pipelines):
            if worker in p.workers:
                return i, p.workers.index(worker) // self.tp
        raise KeyError(f"worker {worker} is not in the assignment")

    def tp_rank(self, worker: int) -> int:
        """``worker``'s rank in its tp group (0 when tp is 1)."""
        i, _ = self.place(worker)
        return self.pipelines[i].workers.index(worker) % self.tp

    def tp_group(self, worker: int) -> tuple[int, ...]:
        """The workers of ``worker``'s stage, in tp rank order."""
        i, j = self.place(worker)
        return self.pipelines[i].workers[j * self.tp : (j + 1) * self.tp]

    def pipe_workers(self, i: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The workers at ``tp_rank`` of each stage of pipeline ``i``: one pp group."""
        return self.pipelines[i].workers[tp_rank :: self.tp]

    def chunks_of(self, worker: int) -> tuple[tuple[int, int], ...]:
        """The (first layer, stop) of each chunk ``worker``'s stage holds (one without
        interleaving)."""
        i, j = self.place(worker)
        return self.pipelines[i].chunks(j)

    def units_of(self, worker: int) -> frozenset[str]:
        i, _ = self.place(worker)
        units = chunk_units(self.chunks_of(worker), n_layers=self.n_layers, tied=self.tied)
        return with_shard(with_tp(units, self.tp_rank(worker) if self.tp > 1 else None),
                          self.shard_index(i))  # fmt: skip

    def describe(self) -> str:
        """``2 pipelines: [0, 2] 4+4 rows ...`` for log lines."""
        text = ", ".join(
            f"{'+'.join(str(b - a) for a, b in p.stages)} layers"
            f"{f' ({p.vpp} chunks a stage)' if p.vpp > 1 else ''} on workers "
            f"{_workers_text(p.workers, self.tp)} ({p.rows[1] - p.rows[0]} rows)"
            for p in self.pipelines
        )
        if self.shard_group > 1:
            text += f"; replicas of {self.shard_group} pipelines sharding their stages (ZeRO)"
        return text

    def to_json(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "tied": self.tied,
            "shard_group": self.shard_group,
            "tp": self.tp,
            "pipelines": [
                {
                    "workers": list(p.workers),
                    "stages": [list(s) for s in p.stages],
                    "rows": list(p.rows),
                    "vpp": p.vpp,
                }  # fmt: skip
                for p in self.pipelines
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> Assignment:
        return cls(
            n_layers=d["n_layers"],
            tied=d["tied"],
            shard_group=d.get("shard_group", 1),
            tp=d.get("tp", 1),
            pipelines=tuple(
                Pipeline(
                    workers=tuple(p["workers"]),
                    stages=tuple(tuple(s) for s in p["stages"]),
                    rows=tuple(p["rows"]),
                    vpp=p.get("vpp", 1),
                )
                for p in d["pipelines"]
            ),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    def expand(self, tp: int) -> Assignment:
        """This plan of tp groups (each named by its lead, the first of its ``tp``
        consecutive worker ids) as a plan of workers (module docstring)."""
        if tp == 1:
            return self
        return dataclasses.replace(self, tp=tp, pipelines=tuple(
            dataclasses.replace(p, workers=tuple(w + r for w in p.workers for r in range(tp)))
            for p in self.pipelines
        ))  # fmt: skip


def _workers_text(workers: tuple[int, ...], tp: int) -> str:
    """``[0, 2]``; with tp groups ``[0-1, 4-5]`` (each stage's group)."""
    if tp == 1:
        return str(list(workers))
    return "[" + ", ".join(f"{w}-{w + tp - 1}" for w in workers[::tp]) + "]"


def stage_units(first: int, stop: int, *, n_layers: int, tied: bool) -> frozenset[str]:
    units = {f"blocks.{i}" for i in range(first, stop)}
    if first == 0:
        units.add("embed")
    if stop == n_layers:
        units.add("post")
        if tied and first != 0:
            units.add("tied")
    return frozenset(units)


def chunk_units(chunks, *, n_layers: int, tied: bool) -> frozenset[str]:
    """The units of a stage holding ``chunks`` [(first, stop), ...]: an interleaved stage
    holds several, whose units are those of each (its tied copy only when it does not hold
    the embedding itself)."""
    units = frozenset().union(*(stage_units(a, b, n_layers=n_layers, tied=tied) for a, b in chunks))
    return units - {"tied"} if "embed" in units else units


def with_tp(units, tp_rank: int | None) -> frozenset[str]:
    """``units`` as the names of their tp shard ``tp_rank`` (``blocks.0`` -> ``blocks.0@1``)."""
    return frozenset(units if tp_rank is None else (f"{u}@{tp_rank}" for u in units))


def strip_tp(unit: str) -> str:
    """``"blocks.0@1/0"`` -> ``"blocks.0/0"``: the name a tp group's plan uses."""
    base, _, rest = unit.partition("@")
    _, slash, shard = rest.partition("/")
    return base + slash + shard


def base_unit(unit: str) -> str:
    """``"blocks.0@1/0"`` -> ``"blocks.0"``."""
    return unit.partition("/")[0].partition("@")[0]


def with_shard(units, shard: int | None) -> frozenset[str]:
    """``units`` as the names of their shard ``shard`` (``blocks.0`` -> ``blocks.0/1``)."""
    return frozenset(units if shard is None else (f"{u}/{shard}" for u in units))


def split_shard(unit: str) -> tuple[str, int | None]:
    """``"blocks.0/1"`` -> ("blocks.0", 1); ``"blocks.0"`` -> ("blocks.0", None)."""
    base, _, shard = unit.partition("/")
    return base, int(shard) if shard else None


def unit_of(name: str) -> str:
    """The unit a parameter of a whole model belongs to (``tied`` is found by the stage)."""
    if name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    if name.startswith("embed."):
        return "embed"
    return "post"


def names_in_unit(unit: str, names) -> list[str]:
    """The parameter names of ``unit`` (or of a shard of it) among ``names``, in the
    model's order."""
    unit = base_unit(unit)
    if unit == "tied":
        return [n for n in names if n == "embed.tokens.weight"]
    return [n for n in names if unit_of(n) == unit]


def serves(held: frozenset[str], unit: str) -> bool:
    """Whether a worker holding ``held`` can hand ``unit`` over (a first stage's token
    embedding equals the last stage's tied copy: the runner keeps them equal; so do their
    shards)."""
    return unit in held or (base_unit(unit) == "tied" and "embed" + unit[4:] in held)


def assign(
    sizes: tuple[int, ...],
    templates: dict[int, Template],
    *,
    holdings: dict[int, frozenset[str]],
    rows: int,
    micro_batch: int,
    n_layers: int,
    tied: bool,
    shard_group: int = 1,
) -> Assignment:
    """Workers onto the stages of one pipeline per entry of ``sizes`` (template sizes) --
    of ``shard`` pipelines per entry when sharding (a replica: module docstring) --
    keeping as much of what each worker holds as possible: ``holdings`` maps every worker
    of the new generation to the units it holds up to date (empty: a new worker, or one
    whose state is stale). Greedy by overlap, ties to the lower worker id, so every reader
    of the same inputs gets the same assignment."""
    sizes = tuple(s for s in sizes for _ in range(shard_group))
    shares = allocate(rows, micro_batch, [templates[s].throughput for s in sizes])
    # each pipeline's template as it can run its share (interleaved, or its plain twin)
    plans = [templates[s].runnable(shares[i] // micro_batch) for i, s in enumerate(sizes)]
    # (pipeline, stage, the units its worker must hold): the places to fill
    places = [
        (i, j, with_shard(chunk_units(t.stages[j :: t.nodes], n_layers=n_layers, tied=tied),
                          i % shard_group if shard_group > 1 else None))
        for i, t in enumerate(plans)
        for j in range(t.nodes)
    ]  # fmt: skip
    if len(places) > len(holdings):
        raise ValueError(f"{len(places)} stages for {len(holdings)} workers")
    pairs = sorted(
        (
            (len(units & holdings[w]), -w, k)
            for k, (_, _, units) in enumerate(places)
            for w in holdings
        ),
        reverse=True,
    )
    taken_place, taken_worker, chosen = set(), set(), {}
    for _, neg_w, k in pairs:
        w = -neg_w
        if k in taken_place or w in taken_worker:
            continue
        chosen[k] = w
        taken_place.add(k)
        taken_worker.add(w)
    pipelines, lo, k = [], 0, 0
    for i, t in enumerate(plans):
        workers = tuple(chosen[k + j] for j in range(t.nodes))
        k += t.nodes
        pipelines.append(
            Pipeline(workers=workers, stages=t.stages, rows=(lo, lo + shares[i]), vpp=t.vpp)
        )
        lo += shares[i]
    return Assignment(
        pipelines=tuple(pipelines), n_layers=n_layers, tied=tied, shard_group=shard_group
    )


def grid_assignment(
    *,
    dp: int,
    template: Template,
    rows: int,
    n_layers: int,
    tied: bool,
    shard_group: int = 1,
    tp: int = 1,
) -> Assignment:
    """The first generation: the user's dp x pp grid as dp pipelines of one template,
    tp group g (workers [g tp, (g+1) tp)) at stage g // dp of pipeline g % dp (the grid's
    global rank order, tp fastest); with ``shard`` K, dp ranks [rK, (r+1)K) are replica r,
    as ``Topology.shard_groups`` cuts them."""
    pp = template.nodes
    share = rows // dp
    plan = Assignment(
        n_layers=n_layers,
        tied=tied,
        shard_group=shard_group,
        pipelines=tuple(
            Pipeline(
                workers=tuple((s * dp + d) * tp for s in range(pp)),
                stages=template.stages,
                rows=(d * share, (d + 1) * share),
                vpp=template.vpp,
            )
            for d in range(dp)
        ),
    )
    return plan.expand(tp)


def expand_moves(moves: list, tp: int) -> list:
    """Moves between tp groups (by lead, units as ``strip_tp`` names) as moves between
    workers: tp rank r of the sending group to tp rank r of the receiving one, the unit's
    tp shard r (``blocks.3/1`` -> ``blocks.3@r/1``)."""
    if tp == 1:
        return moves
    out = []
    for receiver, unit, sender in moves:
        base, slash, shard = unit.partition("/")
        out += [(receiver + r, f"{base}@{r}{slash}{shard}", sender + r) for r in range(tp)]
    return out


def sources(assignment: Assignment, holdings: dict[int, frozenset[str]]) -> tuple[list, list[str]]:
    """Who sends what: a list of (receiver, unit, sender) for every unit a worker of
    ``assignment`` needs and does not hold, the sender chosen among its workers that hold
    it (least loaded first, then the lower id, so transfers spread over the survivors); and
    the units no survivor holds (then the run must fall back to a checkpoint)."""
    members = set(assignment.members)  # a spare is not in the generation's groups: it sends nothing
    moves, missing, load = [], [], {w: 0 for w in holdings}
    for w in assignment.members:
        for unit in sorted(assignment.units_of(w) - holdings.get(w, frozenset())):
            senders = sorted(
                (load[s], s)
                for s, held in holdings.items()
                if s != w and s in members and serves(held, unit)
            )
            if not senders:
                missing.append(unit)
                continue
            src = senders[0][1]
            load[src] += 1
            moves.append((w, unit, src))
    return moves, sorted(set(missing))
