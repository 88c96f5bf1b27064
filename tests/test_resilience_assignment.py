"""Resilience planning without processes: templates, combinations, assignments, state sources,
chaos schedules and the flags' checks."""

import json
import random

import pytest
from oracles import brute_force_bottleneck

from plait.layout import Layout
from plait.model.config import preset
from plait.parallel.pipeline.partition import stage_costs
from plait.resilience.assignment import (
    Assignment,
    assign,
    expand_moves,
    grid_assignment,
    names_in_unit,
    serves,
    sources,
    stage_units,
    strip_tp,
)
from plait.resilience.chaos import Chaos
from plait.resilience.config import ResilienceConfig, check_layout, parse_injections
from plait.resilience.generation import replica_groups, stage_groups
from plait.resilience.templates import Template, allocate, build_templates, choose, layer_costs


def _templates(costs: dict[int, float], rows: int = 4, n_layers: int = 12) -> dict[int, Template]:
    """Templates of s stages taking ``costs[s]`` seconds for ``rows`` rows, layers cut evenly."""
    out = {}
    for s, t in costs.items():
        cuts = [round(i * n_layers / s) for i in range(s + 1)]
        out[s] = Template(stages=tuple(zip(cuts, cuts[1:])), iter_s=t, rows=rows)
    return out


def test_oobleck_coverage_every_count_down_to_f_plus_1_times_n_min():
    # n_min = 3 (the model needs 3 workers), templates 3..5 = 2 n_min - 1 exist, F = 2:
    # every count from (F+1) n_min = 9 up keeps F+1 = 3 pipelines and uses every worker
    t = _templates({3: 1.0, 4: 0.8, 5: 0.66})
    for n in range(9, 40):
        sizes = choose(n, t, min_pipelines=3, max_pipelines=64)
        assert sizes is not None and len(sizes) >= 3 and sum(sizes) == n, (n, sizes)
        assert all(s in t for s in sizes)
    # below that, fewer copies are all that fit: as many pipelines as possible
    assert len(choose(8, t, min_pipelines=3, max_pipelines=64)) == 2
    assert choose(2, t, min_pipelines=3, max_pipelines=64) is None


def test_choose_maximises_throughput_and_respects_micro_batches():
    # two-stage pipelines are worth more than two one-stage ones here (e.g. memory-bound)
    t = _templates({1: 1.0, 2: 0.4})
    assert choose(5, t, min_pipelines=2, max_pipelines=8) == (2, 2, 1)
    t = _templates({1: 0.5, 2: 0.4})  # one-stage pipelines are better per worker
    assert choose(5, t, min_pipelines=2, max_pipelines=8) == (1, 1, 1, 1, 1)
    # only 3 micro-batches a step: at most 3 pipelines, so larger ones take the workers
    assert choose(5, t, min_pipelines=2, max_pipelines=3) == (2, 2, 1)


def test_allocate_keeps_the_batch_and_follows_throughput():
    for rows, mb, thr in [(8, 1, [1, 1, 1]), (64, 2, [3.0, 1.0, 1.0]), (12, 4, [1, 5, 1])]:
        got = allocate(rows, mb, thr)
        assert sum(got) == rows and all(g >= mb and g % mb == 0 for g in got)
    assert allocate(8, 1, [2.0, 1.0, 1.0]) == [4, 2, 2]
    with pytest.raises(ValueError, match="3 pipelines need at least 3 micro-batches"):
        allocate(4, 2, [1, 1, 1])


def test_grid_assignment_matches_the_dp_pp_grid_and_replica_groups_are_its_dp_groups():
    t = _templates({2: 1.0}, n_layers=4)
    assignment = grid_assignment(dp=2, template=t[2], rows=8, n_layers=4, tied=True)
    # rank = pp_rank * dp + dp_rank
    assert [p.workers for p in assignment.pipelines] == [(0, 2), (1, 3)]
    assert [p.rows for p in assignment.pipelines] == [(0, 4), (4, 8)]
    assert assignment.units_of(0) == {"embed", "blocks.0", "blocks.1"}
    assert assignment.units_of(3) == {"blocks.2", "blocks.3", "post", "tied"}
    # generation ranks: members in assignment order [0, 2, 1, 3] -> workers 0, 1 are ranks 0, 2
    groups = replica_groups(assignment)
    assert groups["embed"] == groups["blocks.0"] == (0, 2)
    assert groups["post"] == groups["tied"] == (1, 3)


def test_assign_keeps_what_workers_hold_and_sources_spread_the_copies():
    t = _templates({1: 1.0, 2: 0.6}, n_layers=4)
    grid = grid_assignment(dp=2, template=t[2], rows=8, n_layers=4, tied=True)
    held = {w: grid.units_of(w) for w in (0, 1, 2)}  # worker 3 died
    assignment = assign((1, 1, 1), t, holdings=held, rows=8, micro_batch=1, n_layers=4, tied=True)
    assert (
        sorted(assignment.members) == [0, 1, 2]
        and sum(p.rows[1] - p.rows[0] for p in assignment.pipelines) == 8
    )
    moves, missing = sources(assignment, held)
    assert missing == []
    # worker 2 alone holds the second half: it sends it to 0 and 1; 0 and 1 share the first
    assert {(r, u) for r, u, s in moves if s == 2} == {
        (r, u) for r in (0, 1) for u in ("blocks.2", "blocks.3", "post")
    }
    senders_to_2 = {u: s for r, u, s in moves if r == 2}
    assert set(senders_to_2) == {"embed", "blocks.0", "blocks.1"} and set(
        senders_to_2.values()
    ) == {0, 1}
    # both workers of a stage dead: nobody holds it
    _, missing = sources(assignment, {0: grid.units_of(0), 1: grid.units_of(1)})
    assert missing == ["blocks.2", "blocks.3", "post"]


def test_a_heterogeneous_assignment_and_its_tied_group():
    t = _templates({1: 1.0, 2: 0.6}, n_layers=4)
    assignment = assign((2, 1), t, holdings={w: frozenset() for w in (5, 6, 7)}, rows=8,
                     micro_batch=1, n_layers=4, tied=True)  # fmt: skip
    two, one = assignment.pipelines
    assert len(two.workers) == 2 and len(one.workers) == 1
    groups = replica_groups(assignment)
    r = {w: assignment.members.index(w) for w in assignment.members}
    assert groups["embed"] == tuple(sorted((r[two.workers[0]], r[one.workers[0]])))
    assert groups["tied"] == tuple(sorted((r[two.workers[1]], r[one.workers[0]])))
    assert Assignment.from_json(assignment.to_json()) == assignment


def test_zero_inside_replicas_every_shard_keeps_f_plus_1_copies():
    """dp 4, pp 2, --zero-shard-group 2: replicas {pipelines 0, 1} and {2, 3}; each stage
    sharded over its replica's two workers; shard j lives in pipeline j of both replicas."""
    t = _templates({1: 1.0, 2: 0.6}, n_layers=4)
    grid = grid_assignment(dp=4, template=t[2], rows=8, n_layers=4, tied=True,
                     shard_group=2)  # fmt: skip
    assert [p.workers for p in grid.pipelines] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert grid.units_of(0) == {"embed/0", "blocks.0/0", "blocks.1/0"}
    assert grid.units_of(5) == {"blocks.2/1", "blocks.3/1", "post/1", "tied/1"}
    assert grid.stage_group(5) == [4, 5] and grid.stage_group(2) == [2, 3]
    r = {w: grid.members.index(w) for w in grid.members}
    groups = replica_groups(grid)  # a shard is summed over the replicas' same shard index
    assert groups["embed/0"] == (r[0], r[2]) and groups["embed/1"] == (r[1], r[3])
    assert groups["tied/1"] == (r[5], r[7])
    assert stage_groups(grid) == [(r[0], r[1]), (r[4], r[5]), (r[2], r[3]), (r[6], r[7])]
    # every shard of every unit: one copy per replica
    for unit in {u for w in grid.members for u in grid.units_of(w)}:
        assert sum(unit in grid.units_of(w) for w in grid.members) == 2, unit
    # worker 5 dies: 7 left make 3 replica "workers", so one 2-stage and one 1-stage
    # replica (6 workers, 1 spare); every shard the assignment needs is still held somewhere
    held = {w: grid.units_of(w) for w in grid.members if w != 5}
    assignment = assign((2, 1), t, holdings=held, rows=8, micro_batch=1, n_layers=4, tied=True,
                     shard_group=2)  # fmt: skip
    assert [len(p.workers) for p in assignment.pipelines] == [2, 2, 1, 1]
    assert assignment.shard_group == 2
    assert len(assignment.members) == 6 and Assignment.from_json(assignment.to_json()) == assignment
    moves, missing = sources(assignment, held)
    assert missing == []
    for receiver, unit, sender in moves:  # a shard comes from a holder of that same shard
        assert unit.split("/")[1] == str(assignment.shard_index(assignment.place(receiver)[0]))
        assert serves(held[sender], unit) and sender in assignment.members  # never from the spare
    # the tied copy's shard 1 is served by a first stage's embedding shard 1, not shard 0
    assert serves(frozenset({"embed/1"}), "tied/1") and not serves(frozenset({"embed/0"}), "tied/1")
    # both copies of one shard gone: the run must fall back to its checkpoint
    lost = {w: h for w, h in held.items() if w != 7}
    assert "blocks.2/1" in sources(assignment, lost)[1]


def test_tp_groups_are_planned_whole_and_each_shard_comes_from_the_same_tp_rank():
    """tp 2, pp 2, dp 2 on 4 layers (assignment.py's worked example): the grid's rank order
    (tp fastest); worker 5 dies and takes its group (4, 5) with it; the three groups left
    make a two-stage and a one-stage pipeline, planned as groups (never split over two
    stages), and every unit a group lacks comes tp rank r to tp rank r from one group
    holding the same stage. Breaks if a group is split, if a shard is sent to another tp
    rank (the shapes match, so the run would train on the wrong weights silently), or if
    the replica groups mix tp ranks."""
    t = _templates({1: 1.0, 2: 0.6}, n_layers=4)
    grid = grid_assignment(dp=2, template=t[2], rows=8, n_layers=4, tied=True, tp=2)
    assert [p.workers for p in grid.pipelines] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert grid.tp_group(5) == (4, 5) and grid.place(5) == (0, 1) and grid.tp_rank(5) == 1
    assert grid.pipe_workers(0, 1) == (1, 5)  # the pp group of tp rank 1
    assert grid.units_of(5) == {"blocks.2@1", "blocks.3@1", "post@1", "tied@1"}
    r = {w: grid.members.index(w) for w in grid.members}
    groups = replica_groups(grid)
    assert groups["embed@0"] == (r[0], r[2]) and groups["embed@1"] == (r[1], r[3])
    assert groups["tied@1"] == (r[5], r[7])
    assert Assignment.from_json(grid.to_json()) == grid
    # the coordinator's view: groups by lead, units without the tp rank
    held = {g: frozenset(map(strip_tp, grid.units_of(g))) for g in (0, 2, 6)}
    plan = assign((2, 1), t, holdings=held, rows=8, micro_batch=1, n_layers=4, tied=True)
    moves, missing = sources(plan, held)
    assert missing == []
    assignment, moves = plan.expand(2), expand_moves(moves, 2)
    assert sorted(assignment.members) == [0, 1, 2, 3, 6, 7]
    for p in assignment.pipelines:  # each stage a whole group, in tp rank order
        assert all(p.workers[k] % 2 == 0 and p.workers[k + 1] == p.workers[k] + 1
                   for k in range(0, len(p.workers), 2))  # fmt: skip
    assert moves and all(
        u.split("@")[1] == str(recv % 2) == str(send % 2) for recv, u, send in moves
    )
    # the one-stage pipeline's group gets the second half from group (6, 7) only
    (one,) = [p for p in assignment.pipelines if len(p.stages) == 1]
    to_rank_1 = {(u, s) for recv, u, s in moves if recv == one.workers[1]}
    assert to_rank_1 >= {("blocks.2@1", 7), ("blocks.3@1", 7), ("post@1", 7)}
    assert "2-3" in assignment.describe() or "0-1" in assignment.describe()
    assert serves(frozenset({"embed@1"}), "tied@1") and not serves(frozenset({"embed@0"}), "tied@1")
    assert strip_tp("blocks.0@1/0") == "blocks.0/0"
    assert names_in_unit("post@1", ["head.w"]) == ["head.w"]


def test_interleaved_templates_give_each_stage_its_chunks_and_fall_back_when_the_batch_cannot():
    """--vpp 2: a two-stage template of four chunks, stage 0 holding chunks 0 and 2 (blocks 0
    and 2 with the embedding), stage 1 chunks 1 and 3 (blocks 1 and 3, the head and the
    tied copy). A pipeline whose share is not a multiple of 2 micro-batches runs the plain
    twin (the interleaved schedule could not). Breaks if a stage's units miss a chunk (the
    state copy would leave a layer behind) or if an odd share were planned interleaved."""
    plain = Template(stages=((0, 2), (2, 4)), iter_s=1.0, rows=4)
    chunked = Template(stages=((0, 1), (1, 2), (2, 3), (3, 4)), iter_s=0.8, rows=4, vpp=2,
                       plain=plain)  # fmt: skip
    one = Template(stages=((0, 4),), iter_s=1.5, rows=4)
    t = {1: one, 2: chunked}
    grid = grid_assignment(dp=2, template=chunked, rows=8, n_layers=4, tied=True)
    assert grid.units_of(0) == {"embed", "blocks.0", "blocks.2"}
    assert grid.units_of(2) == {"blocks.1", "blocks.3", "post", "tied"}
    assert grid.chunks_of(2) == ((1, 2), (3, 4)) and "2 chunks a stage" in grid.describe()
    assert Assignment.from_json(grid.to_json()) == grid
    # 4 rows of micro-batch 1 each: interleaved; 3 rows: the plain twin
    even = assign((2, 2), t, holdings={w: grid.units_of(w) for w in range(4)}, rows=8,
                  micro_batch=1, n_layers=4, tied=True)  # fmt: skip
    assert [p.vpp for p in even.pipelines] == [2, 2] and sorted(even.members) == [0, 1, 2, 3]
    assert all(even.units_of(w) == grid.units_of(w) for w in range(4))  # nothing moves
    odd = assign((2, 1), t, holdings={w: grid.units_of(w) for w in (0, 1, 2)}, rows=7,
                 micro_batch=1, n_layers=4, tied=True)  # fmt: skip
    shares = [p.rows[1] - p.rows[0] for p in odd.pipelines]
    two = odd.pipelines[0]
    assert two.vpp == (2 if shares[0] % 2 == 0 else 1), (shares, two)
    assert sum(shares) == 7
    plain_plan = assign((2,), {2: chunked}, holdings={0: frozenset(), 1: frozenset()}, rows=3,
                        micro_batch=1, n_layers=4, tied=True)  # fmt: skip
    assert plain_plan.pipelines[0].vpp == 1 and plain_plan.pipelines[0].stages == plain.stages
    assert plain_plan.units_of(plain_plan.pipelines[0].workers[0]) == {"embed", "blocks.0",
                                                                       "blocks.1"}  # fmt: skip


def test_units_and_names():
    assert stage_units(0, 4, n_layers=4, tied=True) == {"embed", "blocks.0", "blocks.1",
                                                         "blocks.2", "blocks.3", "post"}  # fmt: skip
    names = ["embed.tokens.weight", "embed.positions.weight", "blocks.0.attn.w", "blocks.10.x",
             "norm.weight", "head.weight"]  # fmt: skip
    assert names_in_unit("embed", names) == names[:2]
    assert names_in_unit("tied", names) == ["embed.tokens.weight"]
    assert names_in_unit("tied/1", names) == names_in_unit("embed/0", names)[:1]
    assert names_in_unit("blocks.1", names) == []  # not blocks.10
    assert names_in_unit("post", names) == ["norm.weight", "head.weight"]


def test_templates_from_the_simulator_are_balanced_and_fit():
    """Each template's stages are contiguous, non-empty and cover every layer in order, and
    balanced: the costliest stage (the simulator's per-layer costs, the embedding on the
    first stage, the head on the last) is the least any contiguous cut allows, found by
    brute force. The head costs about one layer here (vocabulary 256k on hidden 128), so
    the balanced cut is not the even one: catches gaps or overlaps between stages and an
    even (or otherwise unbalanced) cut."""
    from plait.sim import get_hardware

    m = preset("tiny", n_layers=8, hidden=128, n_heads=4, seq_len=64, vocab_size=256_000)
    layout, hw = Layout(dp=2, pp=2, global_batch_size=8), get_hardware("h100-sxm")
    t = build_templates(m, layout, hw, max_nodes=4, rows=4)
    assert sorted(t) == [1, 2, 3, 4]
    costs, first, last = layer_costs(m, layout, hw)
    for s, tmpl in t.items():
        assert tmpl.nodes == s and tmpl.iter_s > 0 and tmpl.fits
        bounds = [a for a, _ in tmpl.stages] + [tmpl.stages[-1][1]]
        assert bounds[0] == 0 and bounds[-1] == 8 and all(a < b for a, b in tmpl.stages)
        assert [b for _, b in tmpl.stages] == bounds[1:]  # each starts where the last stopped
        parts = [range(a, b) for a, b in tmpl.stages]
        worst = max(stage_costs(parts, costs, first_extra=first, last_extra=last))
        assert worst == pytest.approx(brute_force_bottleneck(costs, s, first, last), rel=1e-12)
    assert t[2].stages != ((0, 4), (4, 8))  # the head moves a layer off the last stage


def test_injections_and_chaos_schedule():
    inj = parse_injections("5:1, 9:3:stop, 6:2:save")
    assert [(i.step, i.worker, i.signal) for i in inj] == [(5, 1, "kill"), (9, 3, "stop"),
                                                          (6, 2, "save")]  # fmt: skip
    for bad in ("5", "x:1", "5:1:term", "0:1"):
        with pytest.raises(ValueError, match="--inject-failure"):
            parse_injections(bad)
    chaos = Chaos(ResilienceConfig(fault_tolerance=1, inject_failure=inj))
    everyone = {0, 1, 2, 3}
    assert chaos.tick({1: (4, 0.0, 0.5, "step")}, everyone, now=10.0) == []
    armed = chaos.tick({1: (5, 0.0, 0.5, "step")}, everyone, now=10.0)
    shots = armed + chaos.tick({}, everyone, now=10.6)  # within its last step's time
    assert [(s.worker, s.signal, s.step) for s in shots] == [(1, "kill", 5)]
    # "save": only once the worker writes that step's checkpoint, and at once
    assert chaos.tick({2: (6, 0.0, 0.5, "step")}, everyone, now=11.0) == []
    shots = chaos.tick({2: (6, 0.0, 0.5, "save")}, everyone, now=11.0)
    assert [(s.worker, s.signal, s.step) for s in shots] == [(2, "kill", 6)]

    every = Chaos(ResilienceConfig(fault_tolerance=1, chaos_every=10, chaos_seed=3))
    fired = []
    for step in range(1, 50):
        progress = {0: (step, 0.0, 0.0, "step"), 1: (step, 0.0, 0.0, "step")}
        copies = 1 if 25 <= step < 35 else 2  # one copy left: random kills wait
        fired += every.tick(progress, {0, 1}, now=float(step), copies=copies)
    assert [s.step for s in fired] == [10, 20, 35, 45]
    rng = random.Random(3)
    expected = []
    for _ in range(4):
        expected.append(rng.choice([0, 1]))
        rng.uniform(0.0, 0.0)
    assert [s.worker for s in fired] == expected


def test_a_shot_due_while_a_replacement_is_coming_waits_and_the_run_holds_before_it():
    """chaos.py: an injection waits while a replacement is on its way and the run holds F
    copies or fewer (the coordinator holds the run before ``next_due()``), and fires at
    once with no replacement coming (how the checkpoint fallback is scripted); random
    kills are never due at the last step."""
    inj = parse_injections("2:3,12:0")
    chaos = Chaos(ResilienceConfig(fault_tolerance=1, inject_failure=inj), steps=20)
    assert chaos.next_due() == 2
    one = {0: (12, 0.0, 0.0, "step"), 1: (12, 0.0, 0.0, "step")}
    shots = chaos.tick({3: (2, 0.0, 0.0, "step")}, {0, 1, 2, 3}, now=1.0, copies=2)
    assert [(s.worker, s.step) for s in shots] == [(3, 2)] and chaos.next_due() == 12
    # one copy left, a replacement starting: the kill of step 12 waits, however far on
    for running in (12, 13, 30):
        progress = {w: (running, 0.0, 0.0, "step") for w in (0, 1)}
        assert chaos.tick(progress, {0, 1}, now=2.0, copies=1, coming=True) == []
    assert chaos.next_due() == 12  # what the run holds before
    # no replacement coming: it fires although no copy would be left (the fallback)
    shots = chaos.tick(one, {0, 1}, now=3.0, copies=1, coming=False)
    assert [(s.worker, s.step) for s in shots] == [(0, 12)] and chaos.next_due() == 0

    every = Chaos(ResilienceConfig(fault_tolerance=1, chaos_every=5, chaos_seed=1), steps=20)
    fired, held = [], []
    for step in range(1, 21):
        progress = {0: (step, 0.0, 0.0, "step"), 1: (step, 0.0, 0.0, "step")}
        copies = 1 if 6 <= step < 9 else 2  # a kill in step 5; the rejoin before step 9
        held.append(every.next_due())
        fired += every.tick(progress, {0, 1}, now=float(step), copies=copies, coming=copies == 1)
    assert [s.step for s in fired] == [5, 10, 15]  # none at step 20, the last
    assert held[5:9] == [10] * 4 and every.next_due() == 0  # 20 is never due


@pytest.mark.parametrize(
    "layout, flags, needle",
    [
        (dict(dp=1, pp=2), {}, "--dp >= 2"),
        (dict(dp=4, tp=2, zero=1, zero_shard_group=2), {}, "--tp 2 and --zero 1"),
        (dict(dp=2, tp=2, pp=2), {"nnodes": 8}, "keeps each tp group on one node"),
        (dict(dp=2, zero=1), {}, "--zero-shard-group K"),
        (dict(dp=4, zero=3), {}, "--zero-shard-group K"),
        (dict(dp=4, zero=2, zero_shard_group=4), {}, "--zero-shard-group K"),
        (dict(dp=4, zero=2, zero_shard_group=2, offload_optimizer=True), {}, "drop --offload"),
        (dict(dp=2, zero=2, zero_shard_group=1), {}, "shards nothing"),
        (dict(dp=2, pp=3), {"nnodes": 4}, "--nnodes 4 does not divide"),
    ],
)
def test_layouts_refused_with_one_line(layout, flags, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        check_layout(ResilienceConfig(fault_tolerance=1), Layout(**layout), **flags)


def test_async_checkpoint_with_tp_refused_and_tp_groups_allowed():
    """--tp 2 runs under --fault-tolerance (a tp group is the unit of failure); only
    --async-checkpoint with it is refused, in one line."""
    check_layout(ResilienceConfig(fault_tolerance=1), Layout(dp=2, tp=2, pp=2), nnodes=2)
    with pytest.raises(ValueError, match="--async-checkpoint with --tp 2"):
        check_layout(ResilienceConfig(fault_tolerance=1, async_checkpoint=True),
                     Layout(dp=2, tp=2))  # fmt: skip


def test_config_checks():
    with pytest.raises(ValueError, match="--heartbeat-timeout"):
        ResilienceConfig(fault_tolerance=1, heartbeat_timeout=1.0)
    with pytest.raises(ValueError, match="need --fault-tolerance"):
        ResilienceConfig(chaos_every=3)
    cfg = ResilienceConfig(fault_tolerance=2, inject_failure=parse_injections("3:1:stop"))
    assert ResilienceConfig.from_dict(cfg.to_dict()) == cfg


def test_the_availability_model_orders_the_strategies_as_failures_grow():
    from plait.resilience.availability import Assumptions, Model
    from plait.sim import get_hardware

    m = Model(preset("gpt3-1.3b"), Layout(dp=4, tp=2, pp=4, micro_batch_size=1,
              global_batch_size=64, dtype="bf16"), get_hardware("h100-sxm"), Assumptions())  # fmt: skip
    assert m.capacity(0) == 1.0 and 0 < m.capacity(1.5) < m.capacity(1) < 1.0
    points = [m.point(h * 3600) for h in (6, 1, 1 / 6)]
    for p in points:
        assert 0 <= p.checkpoint <= 1 and 0 <= p.in_place <= 1 and 0 <= p.redundant <= 1
    # more failures cost every strategy; in place loses least, checkpoints most
    for attr in ("checkpoint", "in_place", "redundant"):
        assert getattr(points[0], attr) > getattr(points[-1], attr)
    assert (
        points[-1].in_place > points[-1].redundant and points[-1].in_place > points[-1].checkpoint
    )
    # redundant computation pays its extra forward even without failures
    assert m.rc_step_s > m.step_s


def test_step_watchdog_declares_a_stall_after_k_times_the_median_and_not_before():
    """The coordinator's step-progress watchdog (``Coordinator.stall_check``), on a fake
    clock: steps of 1 s, then none. A failure is declared once no step started for
    max(10 x the median, 2 x --heartbeat-timeout) = 10 s, not at 9 s; a checkpoint being
    written or a chaos hold is never a stall. Breaks if the watchdog fires on a slow but
    moving run, never fires, or times a save as a hang."""
    from plait.resilience import coordinator as c

    class Fake(c.Coordinator):
        def __init__(self):
            self.failure, self.requested, self.held, self.gen = None, False, None, 0
            self.res = ResilienceConfig(fault_tolerance=1, heartbeat_timeout=3)
            self.chaos = Chaos(self.res)
            self.stall, self.step_times, self.stall_polled = None, [], 0.0
            self.seen, self.noted = {}, []

        def progress(self):
            return self.seen

        def log(self, event, **kw):
            pass

        def note_failure(self, when, what, *, declared=True):
            self.noted.append(what)
            self.failure = (when, what)

    clock = [100.0]
    c.time.monotonic, real = (lambda: clock[0]), c.time.monotonic
    try:
        f = Fake()
        for step in range(1, 6):  # 1 s a step
            f.seen = {0: (step, 0.0, 1.0, "step"), 1: (step, 0.0, 1.0, "step")}
            f.stall_check(clock[0])
            clock[0] += 1.0
        clock[0] += 8.0  # 9 s into step 5 (started at 104): no stall yet
        f.stall_check(clock[0])
        assert f.noted == []
        f.seen = {0: (5, 0.0, 1.0, "save"), 1: (5, 0.0, 1.0, "step")}
        clock[0] += 30.0  # a checkpoint: as long as it takes
        f.stall_check(clock[0])
        assert f.noted == []
        f.seen = {0: (5, 0.0, 1.0, "step"), 1: (5, 0.0, 1.0, "step")}
        f.stall_check(clock[0])  # the save ended: timed afresh
        clock[0] += 9.5
        f.held = (0, 7)  # a chaos hold: no step is expected
        f.stall_check(clock[0])
        assert f.noted == [] and f.stall is None
        f.held = None
        f.stall_check(clock[0])
        clock[0] += 10.5
        f.stall_check(clock[0])
        assert len(f.noted) == 1 and "no step completed in 10.5 s" in f.noted[0], f.noted
    finally:
        c.time.monotonic = real


def test_a_new_generations_hold_is_in_the_store_before_its_decision():
    """A replacement is on its way and one copy is left, so the kill due at step 14 waits
    and the run holds before it (chaos.py). The coordinator writes the new generation's
    ``ft/hold`` before its decision, so no member can start a step of it unheld. Breaks
    if the hold is left to the next polling tick: on a loaded machine the members then ran
    past step 14 first, the kill fired with no copy to spare and the replacement never
    joined (a CI failure of test_resilience.py's tp-group test)."""
    from plait.resilience import coordinator as c
    from plait.resilience import protocol

    class Store:
        def __init__(self):
            self.writes = []

        def set(self, key, value):
            self.writes.append((key, value))

        def delete_key(self, key):
            pass

    class Fake(c.Coordinator):
        def __init__(self):
            self.gen, self.held, self.procs, self.store = 0, None, {}, Store()
            self.durations, self.last_progress = {}, {}
            self.res = ResilienceConfig(
                fault_tolerance=1, inject_failure=parse_injections("3:1,14:2")
            )
            self.chaos = Chaos(self.res)
            self.chaos.pending = self.chaos.pending[1:]  # the kill at step 3 has fired

        def coming(self):
            return True  # workers 4 and 5 are starting

        def log(self, event, **kw):
            pass

    f = Fake()
    f.publish({"assignment": {}, "step": 3})
    keys = [k for k, _ in f.store.writes]
    assert (protocol.HOLD, "1 14") in f.store.writes, f.store.writes
    assert keys.index(protocol.HOLD) < keys.index(protocol.DECISION.format(1)), keys


def test_nodes_hold_whole_pipelines_so_a_lost_node_leaves_a_copy_of_every_unit():
    """The coordinator's node placement (``node_slots``) of the first generation's grid:
    the workers off any one node still hold every unit. Breaks if workers are placed in
    the grid's rank order: --dp 2 --pp 2 on two nodes put stage 0 of both pipelines on
    node 0 (workers 0, 1 hold embed, blocks.0) and a node lost took every copy of a stage."""
    from plait.resilience.coordinator import node_slots

    for dp, pp, nnodes, k in ((2, 2, 2, 1), (4, 1, 2, 1), (4, 2, 4, 1), (4, 1, 2, 2), (4, 2, 2, 2)):
        tmpl = Template(stages=tuple((s, s + 1) for s in range(pp)), iter_s=1.0, rows=8 // dp)
        a = grid_assignment(dp=dp, template=tmpl, rows=8, n_layers=pp, tied=False, shard_group=k)
        slot, per_node = node_slots(a), dp * pp // nnodes
        assert sorted(slot) == sorted(slot.values()) == list(range(dp * pp))
        held = {u for w in a.members for u in a.units_of(w)}
        for node in range(nnodes):
            off = [w for w in a.members if slot[w] // per_node != node]
            assert {u for w in off for u in a.units_of(w)} == held, (dp, pp, nnodes, k, node)


def test_replicas_are_verified_when_the_run_finishes_while_a_re_form_is_pending(
        tmp_path, capsys):  # fmt: skip
    """The members can finish their last step before they see a request to re-form (a
    replacement became ready near the end): the coordinator then ends in ``reform``, not in
    its steady loop. Breaks if that end skips ``--verify-replicas`` (the run then says
    nothing of its replicas: the flaky miss CI caught), or if it reads the fingerprints
    before they are compared (a differing tensor must still stop the run)."""
    from types import SimpleNamespace

    from plait.errors import LaunchError
    from plait.resilience import coordinator as co

    class Done:
        def poll(self):
            return 0

    store = SimpleNamespace(kv={})
    store.set = store.kv.__setitem__
    coord = co.Coordinator.__new__(co.Coordinator)
    coord.res = ResilienceConfig(fault_tolerance=1, verify_replicas=True)
    coord.out, coord.store, coord.gen = tmp_path, store, 1
    coord.assignment = SimpleNamespace(members=[0, 1])
    coord.nodes = SimpleNamespace(alive=lambda node: True)
    coord.procs = {w: co.Proc(worker=w, handle=Done(), finished=True) for w in (0, 1)}
    coord.failure, coord.requested = None, True  # the replacement's request is pending
    (tmp_path / "logs").mkdir()
    for w in (0, 1):
        (tmp_path / "logs" / f"replica-{w}.json").write_text(json.dumps({"wte": "ab", "w1": "cd"}))
    with pytest.raises(co._Finished):
        coord.reform()
    assert "plait: replicas verified: 2 tensors on 2 workers" in capsys.readouterr().out
    assert json.loads(store.kv["ft/decision/2"])["stop"] == "finished"
    (tmp_path / "logs" / "replica-1.json").write_text(json.dumps({"wte": "ab", "w1": "ee"}))
    with pytest.raises(LaunchError, match="w1 differs between workers"):
        coord.reform()
