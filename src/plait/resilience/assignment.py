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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from plait.resilience.templates import Template, allocate


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    workers: tuple[int, ...]  # the worker of each stage, in stage order
    stages: tuple[tuple[int, int], ...]  # (first layer, stop) of each stage
    rows: tuple[int, int]  # [lo, hi) of every global batch


@dataclass(frozen=True, kw_only=True)
class Assignment:
    pipelines: tuple[Pipeline, ...]
    n_layers: int
    tied: bool
    shard_group: int = 1  # K: pipelines per replica, sharding each stage over K workers

    def shard_index(self, i: int) -> int | None:
        """The shard pipeline ``i``'s workers hold (None: not sharded)."""
        return i % self.shard_group if self.shard_group > 1 else None

    def stage_group(self, worker: int) -> list[int]:
        """The workers sharding ``worker``'s stage in its replica (itself alone if K = 1)."""
        i, j = self.place(worker)
        first = i - i % self.shard_group
        return [self.pipelines[first + k].workers[j] for k in range(self.shard_group)]

    @property
    def members(self) -> list[int]:
        """Workers in rank order (pipeline by pipeline, stage by stage)."""
        return [w for p in self.pipelines for w in p.workers]

    def place(self, worker: int) -> tuple[int, int]:
        """(pipeline index, stage index) of ``worker``."""
        for i, p in enumerate(self.pipelines):
            if worker in p.workers:
                return i, p.workers.index(worker)
        raise KeyError(f"worker {worker} is not in the assignment")

    def stage_of(self, worker: int) -> tuple[int, int]:
        i, j = self.place(worker)
        return self.pipelines[i].stages[j]

    def units_of(self, worker: int) -> frozenset[str]:
        i, _ = self.place(worker)
        units = stage_units(*self.stage_of(worker), n_layers=self.n_layers, tied=self.tied)
        return with_shard(units, self.shard_index(i))

    def describe(self) -> str:
        """``2 pipelines: [0, 2] 4+4 rows ...`` for log lines."""
        text = ", ".join(
            f"{'+'.join(str(b - a) for a, b in p.stages)} layers on workers "
            f"{list(p.workers)} ({p.rows[1] - p.rows[0]} rows)"
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
            "pipelines": [
                {
                    "workers": list(p.workers),
                    "stages": [list(s) for s in p.stages],
                    "rows": list(p.rows),
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
            pipelines=tuple(
                Pipeline(
                    workers=tuple(p["workers"]),
                    stages=tuple(tuple(s) for s in p["stages"]),
                    rows=tuple(p["rows"]),
                )
                for p in d["pipelines"]
            ),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json())


def stage_units(first: int, stop: int, *, n_layers: int, tied: bool) -> frozenset[str]:
    units = {f"blocks.{i}" for i in range(first, stop)}
    if first == 0:
        units.add("embed")
    if stop == n_layers:
        units.add("post")
        if tied and first != 0:
            units.add("tied")
    return frozenset(units)


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
    unit = split_shard(unit)[0]
    if unit == "tied":
        return [n for n in names if n == "embed.tokens.weight"]
    return [n for n in names if unit_of(n) == unit]


def serves(held: frozenset[str], unit: str) -> bool:
    """Whether a worker holding ``held`` can hand ``unit`` over (a first stage's token
    embedding equals the last stage's tied copy: the runner keeps them equal; so do their
    shards)."""
    base, shard = split_shard(unit)
    return unit in held or (base == "tied" and with_shard({"embed"}, shard) <= held)


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
    # (pipeline, stage, the units its worker must hold): the places to fill
    places = [
        (i, j, with_shard(stage_units(a, b, n_layers=n_layers, tied=tied),
                          i % shard_group if shard_group > 1 else None))
        for i, s in enumerate(sizes)
        for j, (a, b) in enumerate(templates[s].stages)
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
    shares = allocate(rows, micro_batch, [templates[s].throughput for s in sizes])
    pipelines, lo, k = [], 0, 0
    for i, s in enumerate(sizes):
        workers = tuple(chosen[k + j] for j in range(s))
        k += s
        pipelines.append(
            Pipeline(workers=workers, stages=templates[s].stages, rows=(lo, lo + shares[i]))
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
) -> Assignment:
    """The first generation: the user's dp x pp grid as dp pipelines of one template,
    worker w at stage w // dp of pipeline w % dp (the grid's global rank order); with
    ``shard`` K, dp ranks [rK, (r+1)K) are replica r, as ``Topology.shard_groups`` cuts them."""
    pp = template.nodes
    share = rows // dp
    return Assignment(
        n_layers=n_layers,
        tied=tied,
        shard_group=shard_group,
        pipelines=tuple(
            Pipeline(
                workers=tuple(s * dp + d for s in range(pp)),
                stages=template.stages,
                rows=(d * share, (d + 1) * share),
            )
            for d in range(dp)
        ),
    )


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
