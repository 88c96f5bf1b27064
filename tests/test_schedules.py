"""Pipeline schedules as data: validity, memory bound and bubble, without processes."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from plait.layout import SCHEDULES as LAYOUT_SCHEDULES
from plait.parallel.pipeline.schedules import (
    RECV_OPS,
    SCHEDULES,
    Action,
    CommBatch,
    Op,
    ScheduleError,
    awaiting_weight_bound,
    bubble_formula,
    build_schedule,
    forward_only,
    in_flight_bound,
    max_in_flight,
    messages,
    rank_states,
    shortest_equivalent,
    stage_location,
    validate,
    virtual_stage,
)
from plait.sim.pipeline import replay, unit_cost


def _cases():
    for name in SCHEDULES:
        for p in (2, 3, 4, 8):
            for m in sorted({p, 2 * p, 8}):
                for v in (1, 2) if name == "interleaved-1f1b" else (1,):
                    yield pytest.param(name, p, m, v, id=f"{name}-pp{p}-m{m}-v{v}")


def _build(name, p, m, v):
    """The schedule, or None after checking that the request is rejected as it should be."""
    if name == "interleaved-1f1b" and v > 1 and m % p:
        with pytest.raises(ScheduleError, match="multiple of --pp"):
            build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
        return None
    return build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)


def _unit_replay(schedule, v):
    return replay(schedule, lambda rank, action: unit_cost(rank, action, num_chunks=v))


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_schedule_rules(name, p, m, v):
    schedule = _build(name, p, m, v)
    if schedule is None:
        return
    validate(schedule, num_ranks=p, num_microbatches=m, num_chunks=v)

    # Checked again here without validate: F before B / BI before W, per chunk.
    for actions in schedule:
        computes = [a for a in actions if a.is_compute]
        pos = {(a.op, a.microbatch, a.chunk): i for i, a in enumerate(computes)}
        assert len(pos) == len(computes)
        for c in range(v):
            for mb in range(m):
                back = (Op.BACKWARD, mb, c)
                if back not in pos:
                    back = (Op.BACKWARD_INPUT, mb, c)
                    assert pos[back] < pos[(Op.BACKWARD_WEIGHT, mb, c)]
                assert pos[(Op.FORWARD, mb, c)] < pos[back]

    # Every send has exactly one receive on the peer, same micro-batch and boundary.
    pairs = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD}
    sent, received = Counter(), Counter()
    for rank, actions in enumerate(schedule):
        for _, a in messages(actions):
            stage = virtual_stage(rank, a.chunk, p)
            if a.op in pairs:
                dst = stage + (1 if a.op is Op.SEND_ACT else -1)
                assert stage_location(dst, p)[0] == a.peer
                sent[(pairs[a.op], a.microbatch, stage, dst)] += 1
            elif a.op in pairs.values():
                src = stage + (-1 if a.op is Op.RECV_ACT else 1)
                assert stage_location(src, p)[0] == a.peer
                received[(a.op, a.microbatch, src, stage)] += 1
    assert sent == received and set(sent.values()) == {1}
    assert len(sent) == 2 * m * (p * v - 1)

    in_flight = [max_in_flight(actions) for actions in schedule]
    if name == "gpipe":
        assert in_flight == [m] * p
    elif name in ("1f1b", "zb-h1"):
        assert max(in_flight) <= p
    for rank, got in enumerate(in_flight):
        bound = in_flight_bound(name, num_ranks=p, num_microbatches=m, num_chunks=v, rank=rank)
        assert got <= bound

    bubble = _unit_replay(schedule, v).bubble_fraction()
    assert bubble == pytest.approx(bubble_formula(name, p, m, v), abs=1e-9)


def test_zb_h1_peaks_are_the_closed_forms():
    """Each ZB-H1 rank's local peaks are one chain: from min(p - r, m) forwards held and
    min(r, m - that) micro-batches waiting for their W, as ``in_flight_bound`` and
    ``awaiting_weight_bound`` give them, each BI moving one from held to waiting, up to
    min(r + 1, their sum) waiting (the memory model's closed form for the schedule: what
    waits for W can be more than a held micro-batch: the output gradients W needs).
    Catches the closed form leaving out the W-deferred micro-batches, which it did (the
    replay then held up to 2% more), or the states after a BI, which plait's W holds
    most in (the closed form was 1.5x short of a rehearsed last stage)."""
    from plait.sim.pipeline import compile_schedule

    for p in range(1, 9):
        for m in range(1, 19):
            compiled = compile_schedule("zb-h1", p, m, 1)
            for rank, vectors in enumerate(compiled.held_vectors):
                kw = dict(num_ranks=p, num_microbatches=m, rank=rank)
                held = in_flight_bound("zb-h1", **kw)
                waiting = awaiting_weight_bound("zb-h1", **kw)
                most = min(rank + 1, held + waiting) if p > 1 else waiting  # p 1: B whole
                want = {(held + waiting - w, w) for w in range(waiting, most + 1)}
                assert {(f[0], w[0]) for f, w in vectors} == want, (p, m, rank)
                assert awaiting_weight_bound("1f1b", **kw) == 0


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in sorted({p, 2 * p, 8})])
def test_zb_h1_beats_1f1b_with_no_more_memory(p, m):
    zb = build_schedule("zb-h1", num_ranks=p, num_microbatches=m)
    ofob = build_schedule("1f1b", num_ranks=p, num_microbatches=m)
    assert _unit_replay(zb, 1).bubble_fraction() < _unit_replay(ofob, 1).bubble_fraction()
    for zb_rank, ofob_rank in zip(zb, ofob):
        assert max_in_flight(zb_rank) <= max_in_flight(ofob_rank)
        # Activations kept until W, counted in full, still never exceed 1F1B's p.
        held = peak = 0
        for a in zb_rank:
            held += {Op.FORWARD: 1, Op.BACKWARD_WEIGHT: -1}.get(a.op, 0)
            peak = max(peak, held)
        assert peak <= p


def test_zb_h1_fewer_microbatches_than_ranks_matches_formula():
    for p in (2, 4, 8):
        for m in range(1, p):
            schedule = build_schedule("zb-h1", num_ranks=p, num_microbatches=m)
            validate(schedule, num_ranks=p, num_microbatches=m)
            got = _unit_replay(schedule, 1).bubble_fraction()
            assert got == pytest.approx(bubble_formula("zb-h1", p, m), abs=1e-9)


def test_interleaved_bubble_is_smaller_with_more_chunks():
    bubbles = []
    for v in (1, 2, 4):
        schedule = build_schedule("interleaved-1f1b", num_ranks=4, num_microbatches=8, num_chunks=v)
        validate(schedule, num_ranks=4, num_microbatches=8, num_chunks=v)
        bubbles.append(_unit_replay(schedule, v).bubble_fraction())
    assert bubbles == pytest.approx([3 / 8, 3 / 16, 3 / 32], abs=1e-9)


def test_interleaved_order_visits_groups_of_p_per_chunk():
    schedule = build_schedule("interleaved-1f1b", num_ranks=2, num_microbatches=4, num_chunks=2)
    forwards = [(a.microbatch, a.chunk) for a in schedule[0] if a.op is Op.FORWARD]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # Rank 1 holds stage 1 (chunk 0) and stage 3, the last (chunk 1): its activation of
    # stage 1 wraps to rank 0's chunk 1.
    first_send = next(a for _, a in messages(schedule[1]) if a.op is Op.SEND_ACT)
    assert (first_send.chunk, first_send.peer) == (0, 0)
    assert Action(Op.RECV_ACT, 0, 1, 1) in [a for _, a in messages(schedule[0])]
    # Warm-up on rank 0: (p - 1) * 2 + (v - 1) * p = 4 forwards before the first backward.
    ops = [a.op for a in schedule[0] if a.is_compute]
    assert ops.index(Op.BACKWARD) == 5  # the 4 warm-up forwards and the first steady one


def test_worked_example_in_module_docstring():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    timeline = _unit_replay(schedule, 1)
    compute = [
        [(f"{a.op.value}{a.microbatch}", start) for a, start, _ in rank if a.is_compute]
        for rank in timeline.events
    ]
    assert compute[0] == [
        ("F0", 0), ("F1", 1), ("B0", 4), ("F2", 6), ("B1", 7), ("F3", 9), ("B2", 10), ("B3", 13)
    ]  # fmt: skip
    assert compute[1] == [
        ("F0", 1), ("B0", 2), ("F1", 4), ("B1", 5), ("F2", 7), ("B2", 8), ("F3", 10), ("B3", 11)
    ]  # fmt: skip
    assert timeline.makespan == 15
    assert timeline.compute_time(0) == timeline.compute_time(1) == 12
    assert timeline.bubble_fraction() == 0.25


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_one_rank_is_forward_backward_without_comm(name):
    schedule = build_schedule(name, num_ranks=1, num_microbatches=3)
    validate(schedule, num_ranks=1, num_microbatches=3)
    got = [(a.op, a.microbatch) for a in schedule[0]]
    if name == "gpipe":
        assert got == [(Op.FORWARD, i) for i in range(3)] + [(Op.BACKWARD, i) for i in range(3)]
    else:
        assert got == [(op, i) for i in range(3) for op in (Op.FORWARD, Op.BACKWARD)]
    assert _unit_replay(schedule, 1).bubble_fraction() == 0.0


def test_registry_matches_layout_names():
    assert tuple(SCHEDULES) == LAYOUT_SCHEDULES


def test_virtual_stage_round_trip():
    for p in (1, 2, 4):
        for v in (1, 3):
            pairs = [(r, c) for c in range(v) for r in range(p)]
            assert [virtual_stage(r, c, p) for r, c in pairs] == list(range(p * v))
            assert [stage_location(s, p) for s in range(p * v)] == pairs
    assert stage_location(5, 4) == (1, 1)


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("1f1b", dict(num_ranks=2, num_microbatches=0), "at least 1 micro-batch"),
        ("gpipe", dict(num_ranks=0, num_microbatches=4), "--pp must be at least 1"),
        ("interleaved-1f1b", dict(num_ranks=3, num_microbatches=4, num_chunks=2), "multiple"),
        ("interleaved-1f1b", dict(num_ranks=1, num_microbatches=4, num_chunks=2), "--pp of"),
        ("interleaved-1f1b", dict(num_ranks=2, num_microbatches=4, num_chunks=0), "--vpp"),
        ("gpipe", dict(num_ranks=2, num_microbatches=4, num_chunks=2), "--vpp 2"),
        ("1f1b", dict(num_ranks=2, num_microbatches=4, num_chunks=2), "interleaved-1f1b"),
        ("zb-h1", dict(num_ranks=2, num_microbatches=4, num_chunks=2), "--vpp 1"),
        ("pipedream", dict(num_ranks=2, num_microbatches=4), "gpipe, 1f1b, interleaved-1f1b"),
    ],
)
def test_impossible_requests_fail_in_one_line(name, kwargs, match):
    with pytest.raises(ScheduleError, match=match) as err:
        build_schedule(name, **kwargs)
    assert "\n" not in str(err.value)


def test_interleaved_with_one_chunk_is_1f1b():
    a = build_schedule("interleaved-1f1b", num_ranks=3, num_microbatches=5)
    assert a == build_schedule("1f1b", num_ranks=3, num_microbatches=5)


# ------------------------------------------------------------------ validate catches it

F, B = Op.FORWARD, Op.BACKWARD


def send_act(mb, peer, chunk=0):
    return Action(Op.SEND_ACT, mb, chunk, peer)


def recv_act(mb, peer, chunk=0):
    return Action(Op.RECV_ACT, mb, chunk, peer)


def send_grad(mb, peer, chunk=0):
    return Action(Op.SEND_GRAD, mb, chunk, peer)


def recv_grad(mb, peer, chunk=0):
    return Action(Op.RECV_GRAD, mb, chunk, peer)


def _two_rank_gpipe_m1():
    return [
        [Action(F, 0), CommBatch((send_act(0, 1), recv_grad(0, 1))), Action(B, 0)],
        [CommBatch((recv_act(0, 0),)), Action(F, 0), Action(B, 0), CommBatch((send_grad(0, 0),))],
    ]


def test_validate_accepts_the_hand_made_reference():
    validate(_two_rank_gpipe_m1(), num_ranks=2, num_microbatches=1)
    assert _two_rank_gpipe_m1() == build_schedule("gpipe", num_ranks=2, num_microbatches=1)


def test_every_shipped_schedule_passes_the_nccl_check():
    """The NCCL model (module docstring) for pp in {2, 3, 4, 8}, every valid vpp up to 4,
    1 to 4 pp + 1 micro-batches (training from pp on), and forward-only evaluation."""
    checked = 0
    for p in (2, 3, 4, 8):
        for v in (1, 2, 3, 4):
            for m in range(1, 4 * p + 2):
                kw = dict(num_ranks=p, num_microbatches=m, num_chunks=v)
                validate(forward_only(**kw), **kw, train=False)
                checked += 1
                if m < p or (v > 1 and m % p):  # (the latter refused by the layout)
                    continue
                for name in SCHEDULES if v == 1 else ["interleaved-1f1b"]:
                    validate(build_schedule(name, **kw), **kw)
                    checked += 1
    assert checked > 500  # 572 with the four schedules


def per_message_order(schedule):
    """How the executor posted messages before batching: each message alone, and the
    receives a compute needs posted before the compute ahead of it (a gloo optimisation)."""
    out = []
    for items in schedule:
        flat = [x for it in items for x in (it.messages if isinstance(it, CommBatch) else (it,))]
        posted, early = [], set()
        for i, a in enumerate(flat):
            if a.is_compute:
                j = i + 1
                while j < len(flat) and not flat[j].is_compute:
                    if flat[j].op in RECV_OPS:
                        posted.append(CommBatch((flat[j],)))
                        early.add(j)
                    j += 1
                posted.append(a)
            elif i not in early:
                posted.append(CommBatch((a,)))
        out.append(posted)
    return out


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p", [2, 4])
def test_the_per_message_order_hangs_under_nccl(name, p):
    """The old executor's order deadlocks in the model -- as on NCCL -- for every
    schedule (1F1B, pp 2: rank 0 posts >a0 <g0 >a1, rank 1 <a0 <a1 >g0: after the first
    pair both wait on a receive); so does one batch per message without the early
    receives (two ranks that both send first). The batched order passes."""
    v = 2 if name == "interleaved-1f1b" else 1
    kw = dict(num_ranks=p, num_microbatches=2 * p, num_chunks=v)
    schedule = build_schedule(name, **kw)
    validate(schedule, **kw)
    with pytest.raises(ScheduleError, match="deadlocks under NCCL"):
        validate(per_message_order(schedule), **kw)
    if name in ("1f1b", "interleaved-1f1b"):
        alone = [
            [x for it in items for x in ([CommBatch((m,)) for m in it.messages]
                                         if isinstance(it, CommBatch) else [it])]
            for items in schedule
        ]  # fmt: skip
        with pytest.raises(ScheduleError, match="deadlocks under NCCL"):
            validate(alone, **kw)


def test_deadlock_both_ranks_receive_first():
    # Each list is fine on its own (receive before the compute that reads it), but rank 0
    # waits for a gradient that rank 1 sends only after an activation rank 0 never sent.
    bad = [
        [CommBatch((recv_grad(0, 1),)), Action(F, 0), CommBatch((send_act(0, 1),)), Action(B, 0)],
        [CommBatch((recv_act(0, 0),)), Action(F, 0), Action(B, 0), CommBatch((send_grad(0, 0),))],
    ]
    with pytest.raises(ScheduleError, match=r"deadlocks under NCCL.*rank 0's batch at item 0"):
        validate(bad, num_ranks=2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="deadlocks"):
        replay(bad, lambda rank, action: 1.0)


def test_deadlock_across_microbatches():
    # 1F1B with rank 0's send of micro-batch 1's activation moved to the very end: rank 0
    # waits for m1's gradient, which rank 1 computes only after that activation arrives.
    good = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    rank0 = []
    for item in good[0]:
        if isinstance(item, CommBatch):
            kept = tuple(m for m in item.messages if m != send_act(1, 1))
            item = CommBatch(kept) if kept else None
        if item is not None:
            rank0.append(item)
    rank0.append(CommBatch((send_act(1, 1),)))
    with pytest.raises(ScheduleError, match="deadlocks under NCCL"):
        validate([rank0, good[1]], num_ranks=2, num_microbatches=2)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s: s[0].reverse(), "rank 0 item .* does not come after its"),
        (lambda s: s[1].pop(2), "rank 1: micro-batch 0 on chunk 0 needs one B.*found none"),
        (lambda s: s[1].pop(0), "rank 1: no recv_act"),
        (lambda s: s[1].append(Action(F, 0)), "rank 1 item 4 F.*duplicate of item 1"),
        (lambda s: s[0].append(Action(F, 1)), "micro-batch outside 0..0"),
        (lambda s: s[0].append(Action(F, 0, chunk=1)), "chunk outside 0..0"),
        (
            lambda s: s[0].__setitem__(1, CommBatch((send_act(0, 0), recv_grad(0, 1)))),
            "lives on rank 1",
        ),  # fmt: skip
        (lambda s: s[0].insert(0, CommBatch((recv_act(0, 1),))), "has no neighbour -1"),
        (lambda s: s.pop(), "1 rank lists, expected 2"),
        (lambda s: s[1].append(Action(B, 0, peer=0)), "compute actions have no peer"),
        (lambda s: s[1].append(send_grad(0, 0)), "a message outside a batch"),
        (lambda s: s[1].append(CommBatch(())), "an empty batch"),
        (lambda s: s[1].append(CommBatch((Action(B, 0),))), "a compute action inside a batch"),
    ],
)
def test_validate_names_the_broken_rule(edit, match):
    schedule = _two_rank_gpipe_m1()
    edit(schedule)
    with pytest.raises(ScheduleError, match=match):
        validate(schedule, num_ranks=2, num_microbatches=1)


def test_validate_split_backward_needs_both_halves_in_order():
    schedule = build_schedule("zb-h1", num_ranks=2, num_microbatches=2)
    bad = [list(rank) for rank in schedule]
    bad[1] = [a for a in bad[1] if a != Action(Op.BACKWARD_WEIGHT, 0)]
    with pytest.raises(ScheduleError, match="needs one B, or one BI and one W; found BI"):
        validate(bad, num_ranks=2, num_microbatches=2)
    bad = [list(rank) for rank in schedule]
    w = bad[0].index(Action(Op.BACKWARD_WEIGHT, 0))
    bad[0].insert(0, bad[0].pop(w))
    with pytest.raises(ScheduleError, match="W\\(m=0, chunk=0\\) does not come after its BI"):
        validate(bad, num_ranks=2, num_microbatches=2)


# ------------------------------------------------------------------------------ replay


def test_replay_charges_a_message_once_both_batches_run():
    schedule = _two_rank_gpipe_m1()
    seen = []

    def p2p(rank, action):
        seen.append((rank, action.op))
        return 0.5

    timeline = replay(schedule, unit_cost, p2p=p2p)
    # rank 1's batch <a0 starts at 0; rank 0 posts >a0 (with <g0) at 1: a0 arrives at 1.5.
    # Rank 1: F [1.5, 2.5], B [2.5, 4.5], posts >g0 at 4.5: g0 arrives at 5. Rank 0's
    # batch finishes with its last message, at 5; its B reads g0: [5, 7].
    assert timeline.makespan == 7.0
    assert seen == [(0, Op.SEND_ACT), (1, Op.SEND_GRAD)]
    batches = [[(s, e) for a, s, e in events if not a.is_compute] for events in timeline.events]
    assert batches == [[(1.0, 5.0)], [(0.0, 1.5), (4.5, 5.0)]]
    assert timeline.compute_time(0) == 3.0
    assert replay(schedule, unit_cost, p2p=0.5).makespan == 7.0


def test_a_compute_waits_only_for_the_batch_it_reads():
    """A send-only batch does not hold up the computes after it (the thread posts it and
    goes on); it only holds up the batches behind it on the rank's queue."""
    schedule = build_schedule("zb-h1", num_ranks=2, num_microbatches=2)
    # rank 1: ... BI1, [>g1], W0, W1 -- the Ws run while g1 is in flight
    timeline = replay(schedule, unit_cost, p2p=10.0)
    events = [(str(a) if not a.is_compute else f"{a.op.value}{a.microbatch}", s, e)
              for a, s, e in timeline.events[1]]  # fmt: skip
    names = [n for n, _, _ in events]
    bi1, send, w0 = (events[names.index(n)] for n in ("BI1", "comm(>g1 to rank 0)", "W0"))
    assert w0[1] == bi1[2]  # right after BI1 ...
    assert send[2] == bi1[2] + 10.0  # ... while its gradient takes 10 units to arrive


def test_replay_uses_the_slowest_rank_for_the_bubble():
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    slow_last = replay(schedule, lambda r, a: unit_cost(r, a) * (2 if r == 1 else 1))
    busiest = max(slow_last.compute_time(r) for r in range(2))
    assert busiest == 24
    assert slow_last.bubble_fraction() == pytest.approx((slow_last.makespan - 24) / 24)


def test_pp4_m8_bubbles():
    """The figures quoted in the design notes: pp=4, m=8 (v=2 for interleaved)."""
    got = {}
    for name in SCHEDULES:
        v = 2 if name == "interleaved-1f1b" else 1
        schedule = build_schedule(name, num_ranks=4, num_microbatches=8, num_chunks=v)
        got[name] = _unit_replay(schedule, v).bubble_fraction()
    assert got == pytest.approx(
        {"gpipe": 3 / 8, "1f1b": 3 / 8, "interleaved-1f1b": 3 / 16, "zb-h1": 1 / 8}, abs=1e-9
    )


def test_schedules_import_nothing_from_torch():
    code = (
        "import sys; import plait.nccl_p2p, plait.parallel.pipeline.schedules, "
        "plait.parallel.pipeline.partition;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_shortest_equivalent_reaches_the_full_steps_states(name, v):
    """The shortened step of each rank (``plait rehearse``) holds as many micro-batches in
    flight as the full one and passes through the same states, and one micro-batch fewer
    would miss one (it is the shortest). Catches a shortening that drops the steady state
    entered after the first backward (1F1B rank 0 at m = p: 16 held, never with
    gradients made) or that ignores a schedule's own warm-up (interleaved)."""
    p, m = 4, 24
    for rank in range(p):
        short = shortest_equivalent(name, num_ranks=p, num_microbatches=m, num_chunks=v,
                                    rank=rank)  # fmt: skip
        assert short < m
        full_items = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)[rank]
        items = build_schedule(name, num_ranks=p, num_microbatches=short, num_chunks=v)[rank]
        assert max_in_flight(items) == max_in_flight(full_items)
        assert rank_states(items) == rank_states(full_items)
        fewer = short - (p if name == "interleaved-1f1b" else 1)
        if fewer >= 3:
            kw = dict(num_ranks=p, num_microbatches=fewer, num_chunks=v)
            assert rank_states(build_schedule(name, **kw)[rank]) != rank_states(full_items)


def test_shortest_equivalent_of_175b_and_of_gpipe():
    """GPT-3 175B's layout (pp 16, 192 micro-batches): 1F1B's rank 0 needs p + 1 (p held,
    then a forward with gradients made), the last rank 3; GPipe holds all m before its
    first backward and cannot be shortened. Catches a shortening by formula that is wrong
    at a schedule's edges (m' = p on rank 0 misses the steady state's peak)."""
    kw = dict(num_ranks=16, num_microbatches=192)
    assert shortest_equivalent("1f1b", **kw, rank=0) == 17
    assert shortest_equivalent("1f1b", **kw, rank=15) == 3
    assert shortest_equivalent("gpipe", **kw, rank=0) == 192
    assert shortest_equivalent("1f1b", num_ranks=16, num_microbatches=16, rank=0) == 16
    # a layout asking for a multiple of pp (interleaved, even at one chunk) gets one
    assert shortest_equivalent("interleaved-1f1b", **kw, rank=0, multiple_of=16) == 32
