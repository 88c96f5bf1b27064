"""Fast replay of the schedules' action lists, for a simulator called thousands of times.

``schedules.replay`` is the reference: an event-driven run of the action lists in which
a send takes no time on its rank, its data arrives ``p2p`` later, and a receive waits
for the arrival. Its result depends only on the costs, and the *order* in which it can
process the actions does not depend on them at all (sends never block). So each
(schedule, p, m, v) is compiled once (cached) into one flat, dependency-respecting list
of steps, and every later replay is a single pass of additions and maxima over it:
the same times as ``schedules.replay`` (tests check equality), a few hundred
microseconds instead of tens of milliseconds.

The compiled form also records, per rank, which (micro-batch, chunk) activations are
held after each forward (for the memory peak) and the last backward of each chunk (for
gradient-reduction overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from plait.parallel.pipeline.schedules import Action, Op, Timeline, build_schedule

COLUMN = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.BACKWARD_INPUT: 2, Op.BACKWARD_WEIGHT: 3}


@dataclass(frozen=True)
class Compiled:
    """One schedule, ready to replay.

    ``steps`` holds one entry per compute action, in an order where every message is
    sent before it is received: (rank, cost index, receive slot, send slot, send
    direction, last). The cost index points into the flattened (rank, chunk, F/B/BI/W)
    cost table; the receive slot (or -1) is the message the action waits for first (the
    schedules put a receive right before the compute that needs it); the send slot (or
    -1) the one it posts right after, going forward (direction 0, an activation) or
    backward (1, a gradient); ``last`` marks a chunk's final B or W, after which its
    gradients are complete.
    """

    p: int
    m: int
    v: int
    lists: list[list[Action]]
    steps: tuple[tuple[int, int, int, int, int, bool], ...]
    num_slots: int
    held_vectors: tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], ...]


@lru_cache(maxsize=64)
def compile_schedule(name: str, p: int, m: int, v: int) -> Compiled:
    lists = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    S = p * v

    # Fold each receive into the compute after it and each send into the compute before.
    # A message is (kind, micro-batch, sending virtual stage), numbered as one integer:
    # activation of micro-batch i from stage s is i S + s, its gradient (m + i) S + s.
    send_act, recv_act, send_grad, recv_grad = Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD
    forward, backward, backward_w = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_WEIGHT
    folded: list[list[list]] = []  # per rank: [cost index, recv, send, direction, last]
    held_vectors = []
    for rank, actions in enumerate(lists):
        row: list[list] = []
        recv = -1
        fwd, wait_w = [0] * v, [0] * v  # held until B / BI, and from BI until W
        peaks = set()  # held vectors at local maxima: a forward not followed by one
        rising = False
        last_of: dict[int, int] = {}
        for a in actions:
            op = a.op
            if op is recv_act:
                recv = a.microbatch * S + a.chunk * p + rank - 1
            elif op is recv_grad:
                recv = (m + a.microbatch) * S + a.chunk * p + rank + 1
            elif op is send_act:
                row[-1][2] = a.microbatch * S + a.chunk * p + rank
            elif op is send_grad:
                row[-1][2] = (m + a.microbatch) * S + a.chunk * p + rank
                row[-1][3] = 1
            else:
                row.append([(rank * v + a.chunk) * 4 + COLUMN[op], recv, -1, 0, False])
                recv = -1
                if op is forward:
                    fwd[a.chunk] += 1
                    rising = True
                    continue
                if rising:  # the vector before this backward is a local maximum
                    peaks.add((tuple(fwd), tuple(wait_w)))
                    rising = False
                if op is backward:
                    fwd[a.chunk] -= 1
                    last_of[a.chunk] = len(row) - 1
                elif op is backward_w:
                    wait_w[a.chunk] -= 1
                    last_of[a.chunk] = len(row) - 1
                else:  # BI
                    fwd[a.chunk] -= 1
                    wait_w[a.chunk] += 1
        if rising:
            peaks.add((tuple(fwd), tuple(wait_w)))
        for i in last_of.values():
            row[i][4] = True
        folded.append(row)
        held_vectors.append(tuple(sorted(_pareto(peaks))))

    # Order: run each rank until its next compute waits on a message not yet sent (the
    # discipline of schedules._run); wake it when that message is sent.
    steps: list[tuple] = []
    pos, sent, parked = [0] * p, bytearray(2 * m * S), {}
    runnable = list(range(p - 1, -1, -1))
    while runnable:
        rank = runnable.pop()
        row = folded[rank]
        i = pos[rank]
        while i < len(row):
            ci, recv, send, direction, last = row[i]
            if recv >= 0 and not sent[recv]:
                parked[recv] = rank
                break
            steps.append((rank, ci, recv, send, direction, last))
            if send >= 0:
                sent[send] = 1
                waiting = parked.pop(send, None)
                if waiting is not None:
                    runnable.append(waiting)
            i += 1
        pos[rank] = i
    if any(pos[r] < len(folded[r]) for r in range(p)):
        raise ValueError(f"--schedule {name}: the action lists deadlock")
    return Compiled(p, m, v, lists, tuple(steps), 2 * m * S, tuple(held_vectors))


def _pareto(vectors: set) -> list:
    """Drop held-count vectors dominated by another (they can never be the peak)."""
    flat = sorted(((sum(f) + sum(w), f + w, (f, w)) for f, w in vectors), reverse=True)
    keep: list = []
    for _, x, orig in flat:
        if not any(all(a >= b for a, b in zip(y, x)) for y, _ in keep):
            keep.append((x, orig))
    return [orig for _, orig in keep]


@dataclass
class Replay:
    """What ``run`` returns. ``ends[rank]``: when the rank's last action ends;
    ``free_ends``: the same with free transfers; ``windows[rank][chunk]``: (start, end)
    of the chunk's last B or W. With ``record``: the ``schedules.Timeline`` and, per
    rank, the (start, end) spans in which a receive waited on a transfer in flight."""

    ends: list[float]
    free_ends: list[float]
    windows: list[dict[int, tuple[float, float]]]
    timeline: Timeline | None = None
    transfer_waits: dict[int, list[tuple[float, float]]] = field(default_factory=dict)


def run(
    compiled: Compiled,
    cost: tuple[tuple[tuple[float, float, float, float], ...], ...],
    p2p: tuple[tuple[float, float], ...],
    *,
    record: bool = False,
) -> Replay:
    """Replay with ``cost[rank][chunk] = (F, B, BI, W)`` and ``p2p[rank]`` = (seconds of an
    activation sent to the next stage, of a gradient sent to the previous one). One pass
    computes the times with these transfers and with free ones (their difference is the
    exposed pipeline communication)."""
    p, v = compiled.p, compiled.v
    flat = [x for row in cost for chunk in row for x in chunk]
    hop = [x for pair in p2p for x in pair]
    clock, free = [0.0] * p, [0.0] * p
    arrival, arrival_free = [0.0] * compiled.num_slots, [0.0] * compiled.num_slots
    windows: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
    for rank, ci, recv, send, direction, last in compiled.steps:
        t, tf = clock[rank], free[rank]
        if recv >= 0:
            if arrival[recv] > t:
                t = arrival[recv]
            if arrival_free[recv] > tf:
                tf = arrival_free[recv]
        dt = flat[ci]
        end = t + dt
        clock[rank] = end
        free[rank] = tf + dt
        if send >= 0:
            arrival[send] = end + hop[2 * rank + direction]
            arrival_free[send] = tf + dt
        if last:
            windows[rank][(ci // 4) % v] = (t, end)
    out = Replay(clock, free, windows)
    if record:
        out.timeline, out.transfer_waits = _timeline(compiled, flat, hop)
    return out


def _timeline(compiled: Compiled, flat: list[float], hop: list[float]):
    """Every action's (start, end) in program order, as ``schedules.replay`` reports them
    (a receive spans its wait; a send takes no time), and the part of each wait during
    which the awaited message was in flight."""
    p = compiled.p
    clock = [0.0] * p
    arrival = [0.0] * compiled.num_slots
    flight = [0.0] * compiled.num_slots
    done: list[list[tuple[float, float, float]]] = [[] for _ in range(p)]
    waits: dict[int, list[tuple[float, float]]] = {}
    for rank, ci, recv, send, direction, _ in compiled.steps:
        t = clock[rank]
        ready = t
        if recv >= 0 and arrival[recv] > t:
            ready = arrival[recv]
            start = max(t, ready - flight[recv])
            if ready > start:
                waits.setdefault(rank, []).append((start, ready))
        end = ready + flat[ci]
        if send >= 0:
            flight[send] = hop[2 * rank + direction]
            arrival[send] = end + flight[send]
        done[rank].append((t, ready, end))
        clock[rank] = end
    events: list[list[tuple[Action, float, float]]] = []
    for rank, actions in enumerate(compiled.lists):
        out, k = [], 0
        for a in actions:
            if a.is_compute:
                _, ready, end = done[rank][k]
                out.append((a, ready, end))
                k += 1
            elif a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD:
                t, ready, _ = done[rank][k]
                out.append((a, t, ready))
            else:
                end = out[-1][2]
                out.append((a, end, end))
        events.append(out)
    return Timeline(events), waits


def peak_held(compiled: Compiled, weights: tuple) -> list[float]:
    """Peak activation bytes per rank; ``weights[rank][chunk]`` = (bytes held from F to
    B/BI per micro-batch, of which held on until W)."""
    peaks = []
    for rank, vectors in enumerate(compiled.held_vectors):
        w = weights[rank]
        best = 0.0
        for fwd, wait_w in vectors:
            total = 0.0
            for c, (n_f, n_w) in enumerate(zip(fwd, wait_w)):
                held, keep = w[c]
                total += n_f * held + n_w * keep
            best = max(best, total)
        peaks.append(best)
    return peaks
