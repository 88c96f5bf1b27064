"""Fast replay of the schedules' item lists, for a simulator called thousands of times.

``schedules.replay`` is the reference: the lists run under NCCL's point-to-point model
(``schedules`` module docstring) -- a compute waits only for the batch holding the message
it reads; a rank's batches run one after another on its communication queue; a message
completes ``p2p`` after the batches holding its send and its receive have both started.
Which item waits on which depends only on the lists, not on the costs. So each
(schedule, p, m, v) is compiled once (cached) into one flat, dependency-respecting list
of steps -- compute, post a batch, start a batch, finish a batch -- and every later
replay is a single pass of additions and maxima over it: the same times as
``schedules.replay`` (tests check equality), a few hundred microseconds instead of tens
of milliseconds.

The compiled form also records, per rank, which (micro-batch, chunk) activations are
held after each forward (for the memory peak) and the last backward of each chunk (for
gradient-reduction overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from plait.parallel.pipeline.schedules import (
    SEND_OPS,
    Action,
    CommBatch,
    Op,
    Timeline,
    _message_key,
    build_schedule,
    consumed,
)

COLUMN = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.BACKWARD_INPUT: 2, Op.BACKWARD_WEIGHT: 3}
COMPUTE, POST, START, FINISH = 0, 1, 2, 3


@dataclass(frozen=True)
class Compiled:
    """One schedule, ready to replay.

    ``steps``: (kind, rank, x, y) in an order where everything a step reads is already
    known. COMPUTE: x = index into the flattened (rank, chunk, F/B/BI/W) cost table, y =
    (batch it waits for or -1, True if it is its chunk's final B or W). POST / START /
    FINISH: x = the batch's number. ``batch_messages[b]``: (the other batch of each
    message, index of its transfer time: 2 * sending rank + 0 for an activation, 1 for
    a gradient). ``items[rank]``: per item of the list, ("c", k) for the rank's k-th
    compute or ("b", b) for batch b.
    """

    p: int
    m: int
    v: int
    lists: list
    steps: tuple[tuple[int, int, int, object], ...]
    batch_messages: tuple[tuple[tuple[int, int], ...], ...]
    items: tuple[tuple[tuple[str, int], ...], ...]
    held_vectors: tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], ...]


def _number_batches(lists, p):
    """Every batch numbered; each message's two batches and its transfer index."""
    number: dict[tuple[int, int], int] = {}
    where: dict[tuple, dict[str, int]] = {}
    hop_index: dict[tuple, int] = {}
    for rank, items in enumerate(lists):
        for i, item in enumerate(items):
            if isinstance(item, CommBatch):
                b = number[(rank, i)] = len(number)
                for msg in item.messages:
                    key = _message_key(rank, msg, p)
                    side = "send" if msg.op in SEND_OPS else "recv"
                    where.setdefault(key, {})[side] = b
                    if side == "send":
                        hop_index[key] = 2 * rank + (0 if msg.op is Op.SEND_ACT else 1)
    messages = [[] for _ in number]
    for key, sides in where.items():
        messages[sides["send"]].append((sides["recv"], hop_index[key]))
        messages[sides["recv"]].append((sides["send"], hop_index[key]))
    return number, where, tuple(tuple(ms) for ms in messages)


@lru_cache(maxsize=64)
def compile_schedule(name: str, p: int, m: int, v: int) -> Compiled:
    lists = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    number, where, batch_messages = _number_batches(lists, p)
    last_of = [{} for _ in range(p)]  # chunk -> index of its final B or W on the rank
    for rank, items in enumerate(lists):
        for i, a in enumerate(items):
            if isinstance(a, Action) and a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                last_of[rank][a.chunk] = i
    finals = [set(d.values()) for d in last_of]

    # Resolve as schedules._run does, recording each step as it becomes computable.
    steps: list[tuple] = []
    pos, head = [0] * p, [0] * p
    queue = [[number[(r, i)] for i, a in enumerate(items) if isinstance(a, CommBatch)]
             for r, items in enumerate(lists)]  # fmt: skip
    posted, started, finished = set(), set(), set()
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            items = lists[rank]
            while pos[rank] < len(items):  # the compute thread
                i, a = pos[rank], items[pos[rank]]
                if isinstance(a, CommBatch):
                    steps.append((POST, rank, number[(rank, i)], None))
                    posted.add(number[(rank, i)])
                else:
                    key = consumed(rank, a, p, v)
                    wait = where[key]["recv"] if key is not None else -1
                    if wait >= 0 and wait not in finished:
                        break
                    ci = (rank * v + a.chunk) * 4 + COLUMN[a.op]
                    steps.append((COMPUTE, rank, ci, (wait, i in finals[rank])))
                pos[rank] += 1
                progress = True
            while head[rank] < len(queue[rank]):  # the communication queue
                b = queue[rank][head[rank]]
                if b not in posted:
                    break
                if b not in started:
                    steps.append((START, rank, b, None))
                    started.add(b)
                    progress = True
                if any(other not in started for other, _ in batch_messages[b]):
                    break
                steps.append((FINISH, rank, b, None))
                finished.add(b)
                head[rank] += 1
                progress = True
    if any(pos[r] < len(lists[r]) or head[r] < len(queue[r]) for r in range(p)):
        raise ValueError(f"--schedule {name}: the lists deadlock")

    items = tuple(
        tuple(("b", number[(r, i)]) if isinstance(a, CommBatch) else ("c", 0) for i, a in enumerate(row))
        for r, row in enumerate(lists)
    )  # fmt: skip
    return Compiled(
        p, m, v, lists, tuple(steps), batch_messages, items, tuple(_held_vectors(lists, v))
    )


def _held_vectors(lists, v: int):
    """Per rank, the (held until B/BI, held until W) counts per chunk at each local peak."""
    out = []
    for actions in lists:
        fwd, wait_w = [0] * v, [0] * v
        peaks = set()  # held vectors at local maxima: a forward not followed by one
        rising = False
        for a in actions:
            if not isinstance(a, Action):
                continue
            if a.op is Op.FORWARD:
                fwd[a.chunk] += 1
                rising = True
                continue
            if rising:  # the vector before this backward is a local maximum
                peaks.add((tuple(fwd), tuple(wait_w)))
                rising = False
            if a.op is Op.BACKWARD:
                fwd[a.chunk] -= 1
            elif a.op is Op.BACKWARD_WEIGHT:
                wait_w[a.chunk] -= 1
            else:  # BI
                fwd[a.chunk] -= 1
                wait_w[a.chunk] += 1
        if rising:
            peaks.add((tuple(fwd), tuple(wait_w)))
        out.append(tuple(sorted(_pareto(peaks))))
    return out


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
    """What ``run`` returns. ``ends[rank]``: when the rank's last item ends (its last
    compute, or its last batch); ``free_ends``: the same with free transfers;
    ``windows[rank][chunk]``: (start, end) of the chunk's last B or W. With ``record``:
    the ``schedules.Timeline`` and, per rank, the (start, end) spans in which a compute
    waited on a message in flight."""

    ends: list[float]
    free_ends: list[float]
    windows: list[dict[int, tuple[float, float]]]
    timeline: Timeline | None = None
    transfer_waits: dict[int, list[tuple[float, float]]] = field(default_factory=dict)


def _times(compiled: Compiled, flat: list[float], hop: list[float], record: bool):
    """One pass over the steps: per-rank clocks, batch start / finish times, and (when
    ``record``) each item's (start, end) and the waits on messages in flight."""
    p, n = compiled.p, len(compiled.batch_messages)
    clock, queue_free = [0.0] * p, [0.0] * p
    post, start, finish, flight = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    windows: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
    computes: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    waits: dict[int, list[tuple[float, float]]] = {}
    messages = compiled.batch_messages
    v = compiled.v
    for kind, rank, x, y in compiled.steps:
        if kind == COMPUTE:
            wait, last = y
            t = ready = clock[rank]
            if wait >= 0 and finish[wait] > t:
                ready = finish[wait]
                if record:
                    waits.setdefault(rank, []).append((max(t, ready - flight[wait]), ready))
            end = ready + flat[x]
            clock[rank] = end
            if record:
                computes[rank].append((ready, end))
            if last:
                windows[rank][(x // 4) % v] = (ready, end)
        elif kind == POST:
            post[x] = clock[rank]
        elif kind == START:
            start[x] = post[x] if post[x] > queue_free[rank] else queue_free[rank]
        else:  # FINISH: the batch's last message
            end, s = start[x], start[x]
            for other, h in messages[x]:
                done = (s if s > start[other] else start[other]) + hop[h]
                if done > end:
                    end, flight[x] = done, hop[h]
            finish[x] = queue_free[rank] = end
    ends = [max(a, b) for a, b in zip(clock, queue_free)]
    return ends, windows, computes, start, finish, waits


def run(
    compiled: Compiled,
    cost: tuple[tuple[tuple[float, float, float, float], ...], ...],
    p2p: tuple[tuple[float, float], ...],
    *,
    record: bool = False,
) -> Replay:
    """Replay with ``cost[rank][chunk] = (F, B, BI, W)`` and ``p2p[rank]`` = (seconds of an
    activation sent to the next stage, of a gradient sent to the previous one). Computes
    the times with these transfers and with free ones (their difference is the exposed
    pipeline communication)."""
    flat = [x for row in cost for chunk in row for x in chunk]
    hop = [x for pair in p2p for x in pair]
    ends, windows, computes, start, finish, waits = _times(compiled, flat, hop, record)
    free_ends = _times(compiled, flat, [0.0] * len(hop), False)[0]
    out = Replay(ends, free_ends, windows)
    if record:
        events = []
        for rank, row in enumerate(compiled.items):
            k, out_row = 0, []
            for item, (kind, b) in zip(compiled.lists[rank], row):
                if kind == "c":
                    out_row.append((item, *computes[rank][k]))
                    k += 1
                else:
                    out_row.append((item, start[b], finish[b]))
            events.append(out_row)
        out.timeline, out.transfer_waits = Timeline(events), waits
    return out


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
