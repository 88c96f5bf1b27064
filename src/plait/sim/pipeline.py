"""Pipeline schedules replayed in time: what each rank does when, for the simulator and
for drawing a schedule.

Communication: none (nothing here runs; no torch). The schedules' item lists
(``parallel/pipeline/schedules.py``) run under the one model of NCCL's point-to-point
semantics, ``plait/nccl_p2p.py`` -- a compute waits only for the batch holding the message
it reads; a rank's batches run one after another on its communication queue; a message
completes ``p2p`` after the batches holding its send and its receive have both started.
Which item waits on which depends only on the lists, not on the costs, so a schedule is
resolved once (``nccl_p2p.resolve``) and then timed in one pass of additions and maxima
(``nccl_p2p.timed``) for any costs.

``replay`` is the reference, for any costs given as functions of (rank, action): it
returns the ``Timeline`` (``viz schedule`` draws it; the tests check the bubble formulas on
it). ``compile_schedule`` resolves a (schedule, p, m, v) once (cached) with its computes
reading a cost table indexed by (rank, chunk, F/B/BI/W) and its sends a table indexed by
(rank, activation/gradient), so that ``run``, called for every layout the simulator
tries, is only the timing pass: the same times as ``replay`` (tests check equality), a few
hundred microseconds instead of tens of milliseconds.

The compiled form also records, per rank, which (micro-batch, chunk) activations are
held after each forward (for the memory peak), the same with which chunks have made
their weight gradients by then (``grad_states``: a rank whose last forward comes before
its first backward never holds both at once) and the last backward of each chunk (for
gradient-reduction overlap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from plait.nccl_p2p import COMPUTE, Resolution, Timeline, Times, timed
from plait.parallel.pipeline.schedules import (
    SEND_OPS,
    Action,
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    messages,
    resolve,
)

COLUMN = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.BACKWARD_INPUT: 2, Op.BACKWARD_WEIGHT: 3}


def replay(
    schedule: Schedule,
    cost: Callable[[int, Action], float],
    *,
    p2p: Callable[[int, Action], float] | float = 0.0,
) -> Timeline:
    """Time a schedule: each rank runs its list in order from time 0.

    A compute action takes ``cost(rank, action)``, once the batch holding the message it
    reads has finished. A send takes no time on the sender's thread; its message arrives
    ``p2p`` (a number, or ``p2p(sender_rank, send_action)``) after the batches holding the
    send and its receive have both started, and a batch spans from its start to its last
    arrival. Links are not shared: two transfers never slow each other down. Raises
    ``ScheduleError`` on a deadlock.
    """
    resolution = resolve(schedule)  # computes and sends keyed in list order, as below
    costs = [cost(rank, a) for rank, items in enumerate(schedule)
             for a in items if isinstance(a, Action)]  # fmt: skip
    transfer = p2p if callable(p2p) else (lambda rank, action, _t=float(p2p): _t)
    hops = [transfer(rank, m) for rank, items in enumerate(schedule)
            for _, m in messages(items) if m.op in SEND_OPS]  # fmt: skip
    return Timeline.of(schedule, resolution, timed(resolution, costs, hops))


def unit_cost(rank: int, action: Action, *, num_chunks: int = 1) -> float:
    """The textbook costs behind ``schedules.bubble_formula``: F = 1, B = 2, BI = W = 1,
    each divided by the number of chunks a rank holds (a chunk is 1/v of a stage)."""
    base = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.BACKWARD_INPUT: 1.0, Op.BACKWARD_WEIGHT: 1.0}
    return base[action.op] / num_chunks


@dataclass(frozen=True)
class Compiled:
    """One schedule, resolved and ready to time.

    ``resolution``: the lists under the NCCL model, a compute taking entry
    (rank * v + chunk) * 4 + column (F, B, BI, W) of the flattened cost table and a send
    entry 2 * rank (activation) or 2 * rank + 1 (gradient) of the flattened transfer
    table. ``finals[rank]``: (item, chunk) of each chunk's final B or W on the rank.
    ``held_vectors``: see ``_held_vectors``; ``grad_states``: see ``_grad_states``;
    ``forward_vectors``: see ``_forward_vectors``.
    """

    p: int
    m: int
    v: int
    lists: Schedule
    resolution: Resolution
    finals: tuple[tuple[tuple[int, int], ...], ...]
    held_vectors: tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], ...]
    grad_states: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...] = ()
    forward_vectors: tuple = ()


@lru_cache(maxsize=64)
def compile_schedule(name: str, p: int, m: int, v: int) -> Compiled:
    lists = build_schedule(name, num_ranks=p, num_microbatches=m, num_chunks=v)
    try:
        resolution = resolve(
            lists,
            cost_key=lambda rank, a: (rank * v + a.chunk) * 4 + COLUMN[a.op],
            hop_key=lambda rank, send: 2 * rank + (0 if send.op is Op.SEND_ACT else 1),
        )
    except ScheduleError as e:
        raise ScheduleError(f"--schedule {name}: {e}") from None
    finals = []
    for items in lists:
        last_of = {}  # chunk -> index of its final B or W on the rank
        for i, a in enumerate(items):
            if isinstance(a, Action) and a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                last_of[a.chunk] = i
        finals.append(tuple(sorted((i, c) for c, i in last_of.items())))
    states = tuple(_grad_states(lists, v))
    return Compiled(p, m, v, lists, resolution, tuple(finals), tuple(_held_vectors(states)),
                    states, tuple(_forward_vectors(states)))  # fmt: skip


def _held_vectors(grad_states) -> list:
    """Per rank, the (held until B/BI, held until W) counts per chunk at each local peak
    of the activations (``_grad_states``' x = 0 states, their gradients set aside): after
    a forward followed by a backward, and after each BI (what waits for its W can be more
    than the micro-batch held)."""
    return [tuple(sorted(_pareto({(f, w) for f, w, _, (x, *_) in states if x == 0})))
            for states in grad_states]  # fmt: skip


def _forward_vectors(grad_states) -> list:
    """Per rank, the (held until B/BI, held until W, chunk, outputs) at each forward's end
    (``_grad_states``' x = 5 states): the micro-batches held per chunk with the forward's
    own counted, the chunk it runs, and how many earlier stage outputs still await their
    send beside it -- where a forward's last moments (its last block's output, the final
    norm's fp32 copies: ``memory.forward_end_moment``) top the activations."""
    return [tuple(sorted((f, w, c, n) for c, n in {s[3][1:] for s in states if s[3][0] == 5}
                         for f, w in _pareto({(f, w) for f, w, _, x in states
                                              if x == (5, c, n)})))
            for states in grad_states]  # fmt: skip


def _grad_states(lists, v: int):
    """Per rank, the states at which its activations and weight gradients together can
    peak, each (f, w, g, x): per chunk the micro-batches held until B/BI (f) and until W
    (w) and whether the chunk's weight gradients exist yet (g: its first B or W has run;
    autograd makes them there); x = 1 for the moment a chunk's first B or W ends, its
    micro-batch's activations freed, its gradients made, and that backward's working set
    still held (``memory.backward_transient``); x = 2 for the end of a BI, its micro-batch
    still whole beside the output gradients it captured for W (what it does not keep for
    W goes after it: ``executor.SavedBoxes``); x = 3 for the end of every B or W of the
    first chunk, whose last act on the model's first stage is the embedding's backward
    (``memory.embedding_backward_transient``: a vocabulary table's gradient or three,
    which can outweigh the micro-batch it has freed); x = (4, chunk) for a W of a chunk
    whose gradients exist, its micro-batch still waiting, as it casts a weight's
    gradient to add it in (``memory.w_cast_working_set``). The others are
    the local maxima of the activations (a forward not followed by one, and each BI), with
    the gradients made so far (x = (0, the chunk whose backward starts, the boundary
    tensors awaiting their send then)), and every backward's start once gradients exist (a B that
    follows a B holds one micro-batch fewer than the start before it, but the gradients
    the first made and its own working set: LLaMA blocks at ``--pp 2 --cp 2`` and two
    micro-batches peak as rank 0's second backward starts); and x = (5, chunk, outputs)
    for each forward's end, with the stage outputs awaiting their send beside it
    (``_forward_vectors``; the loss's moment, its logits in the compute dtype beside the
    head's buffers, can be a last stage's whole peak). A later B or W ends below the
    local maximum before it (its working set is less than the micro-batch's activations
    it has freed), so only the first counts, the first chunk's apart."""
    out = []
    p = len(lists)
    for rank, actions in enumerate(lists):
        fwd, wait_w, made = [0] * v, [0] * v, [0] * v
        states = set()
        rising = False
        # boundary tensors awaiting their send (``executor``: a stage's output or input
        # gradient is held from its compute until its batch is posted, and by a send-only
        # batch until the compute after it has run; a batch that receives too is waited on,
        # and lets go of what it sent, before the compute that reads one of its messages)
        unposted, sending, waiting = set(), set(), []  # waiting: [(receives, sends)]
        for a in actions:
            if not isinstance(a, Action):
                sent = {(m.microbatch, m.chunk, m.op is Op.SEND_ACT) for m in a.messages
                        if m.op in SEND_OPS}  # fmt: skip
                unposted -= sent
                got = {(m.microbatch, m.chunk, m.op is Op.RECV_ACT) for m in a.messages
                       if m.op not in SEND_OPS}  # fmt: skip
                if got:
                    waiting.append((got, sent))
                else:
                    sending |= sent
                continue
            if a.op is not Op.BACKWARD_WEIGHT:  # what it reads: its batch waited on first
                reads = (a.microbatch, a.chunk, a.op is Op.FORWARD)
                waiting = [(got, sent) for got, sent in waiting if reads not in got]
            awaiting = unposted | sending | {x for _, sent in waiting for x in sent}
            held_out = len(awaiting)
            outputs = sum(1 for *_, act in awaiting if act)
            sending = set()
            if a.op is Op.FORWARD:
                fwd[a.chunk] += 1
                rising = True
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (5, a.chunk, outputs)))
                if a.chunk * p + rank < v * p - 1:  # its output goes to the next stage
                    unposted.add((a.microbatch, a.chunk, True))
                continue
            if a.op is not Op.BACKWARD_WEIGHT and a.chunk * p + rank > 0:  # and its input's
                unposted.add((a.microbatch, a.chunk, False))  # gradient to the one before
            # a backward's start, with the chunk whose backward it is (a W's: -1): after a
            # forward, a local maximum of the activations; after a backward that made
            # gradients, fewer activations beside more gradients and a working set that
            # can outweigh the transient the backward before ended with
            c = a.chunk if a.op is not Op.BACKWARD_WEIGHT else -1
            if rising or any(made):
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (0, c, held_out)))
            if a.op is Op.BACKWARD_WEIGHT and made[a.chunk]:  # a W beside its gradients:
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (4, a.chunk)))  # casts
            rising = False
            first = a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT) and not made[a.chunk]
            if a.op is Op.BACKWARD:
                fwd[a.chunk] -= 1
            elif a.op is Op.BACKWARD_WEIGHT:
                wait_w[a.chunk] -= 1
            else:  # BI: as it ends, its micro-batch whole and the gradients it captured
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (2,)))
                fwd[a.chunk] -= 1
                wait_w[a.chunk] += 1
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (0, -1)))
            if first:
                made[a.chunk] = 1
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (1,)))
            if a.chunk == 0 and a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
                states.add((tuple(fwd), tuple(wait_w), tuple(made), (3,)))
        if rising:
            states.add((tuple(fwd), tuple(wait_w), tuple(made), (0, -1)))
        # a transient need not grow with x: prune among the states of one x (and chunk)
        kept = [s for x in {s[3] for s in states}
                for s in _pareto({s for s in states if s[3] == x})]  # fmt: skip
        out.append(tuple(sorted(kept)))
    return out


def _pareto(vectors: set) -> list:
    """Drop held-count vectors dominated by another (they can never be the peak)."""
    flat = sorted(((sum(map(sum, x)), sum(x, ()), x) for x in vectors), reverse=True)
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
    the ``Timeline`` and, per rank, the (start, end) spans in which a compute waited on a
    message in flight."""

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
    activation sent to the next stage, of a gradient sent to the previous one). Computes
    the times with these transfers and with free ones (their difference is the exposed
    pipeline communication)."""
    flat = [x for row in cost for chunk in row for x in chunk]
    hop = [x for pair in p2p for x in pair]
    resolution = compiled.resolution
    times = timed(resolution, flat, hop)
    free_ends = timed(resolution, flat, [0.0] * len(hop)).ends
    windows = [
        {chunk: (times.start[base + i], times.end[base + i]) for i, chunk in finals}
        for finals, base in zip(compiled.finals, resolution.offsets)
    ]
    out = Replay(times.ends, free_ends, windows)
    if record:
        out.timeline = Timeline.of(compiled.lists, resolution, times)
        out.transfer_waits = _transfer_waits(resolution, times)
    return out


def _transfer_waits(resolution: Resolution, times: Times) -> dict[int, list[tuple[float, float]]]:
    """Per rank, the spans in which a compute waited on a message in flight: from the later
    of the rank's clock and the message's departure (its batch's finish less the transfer
    that finished it last) to the compute's start."""
    waits: dict[int, list[tuple[float, float]]] = {}
    clock = [0.0] * len(resolution.offsets)
    for kind, rank, x, extra in resolution.steps:
        if kind == COMPUTE:
            start, wait = times.start[x], extra[1]
            if start > clock[rank]:  # it waited: for its batch (wait >= 0)
                span = (max(clock[rank], start - times.flight[wait]), start)
                waits.setdefault(rank, []).append(span)
            clock[rank] = times.end[x]
    return waits


def peak_held(compiled: Compiled, weights: tuple, waiting: tuple) -> tuple[list, list]:
    """Peak activation bytes per rank, ``weights[rank][chunk]`` = (bytes held from F to
    B/BI per micro-batch, of which held on until W), and what the peak's state holds of
    ``waiting[rank][chunk]`` (bytes of a micro-batch's ``keep`` of some kind)."""
    peaks, parts = [], []
    for rank, vectors in enumerate(compiled.held_vectors):
        w = weights[rank]
        best, part = 0.0, 0.0
        for fwd, wait_w in vectors:
            total = sum(n_f * w[c][0] + n_w * w[c][1]
                        for c, (n_f, n_w) in enumerate(zip(fwd, wait_w)))  # fmt: skip
            if total > best:
                best = total
                part = sum(n_w * waiting[rank][c] for c, n_w in enumerate(wait_w))
        peaks.append(best)
        parts.append(part)
    return peaks, parts


def forward_peaks(compiled: Compiled, weights: tuple, ends: tuple) -> list:
    """Per rank, the activations at their forwards' ends (``_forward_vectors``), with
    ``weights`` as ``peak_held``'s and ``ends[rank][chunk]`` = (what that chunk's forward
    holds at its end beyond its micro-batch's ``weights`` -- less where the weights count
    what is not made yet --, bytes of one stage output awaiting its send)."""
    peaks = []
    for rank, vectors in enumerate(compiled.forward_vectors):
        w, best = weights[rank], 0.0
        for fwd, wait_w, chunk, outputs in vectors:
            extra, output = ends[rank][chunk]
            total = extra + outputs * output
            total += sum(n_f * w[c][0] + n_w * w[c][1]
                         for c, (n_f, n_w) in enumerate(zip(fwd, wait_w)))  # fmt: skip
            best = max(best, total)
        peaks.append(best)
    return peaks


def peak_with_grads(compiled: Compiled, rank: int, weights: tuple, grads: tuple,
                    transient: tuple, w_caps: tuple = (), boundary: float = 0.0,
                    last_cast: float = 0.0, fresh: tuple = (),
                    forward_ends: tuple = ()) -> tuple:  # fmt: skip
    """Peak of activations plus weight gradients on ``rank`` (``_grad_states``);
    ``weights`` as ``peak_held``'s for the rank, ``grads[chunk]``: bytes of the chunk's
    weight gradients, ``transient``: (per chunk, what its backward adds to a local
    maximum that it follows -- their largest where a W or nothing follows --, what a
    first backward holds as it ends, what a BI has captured as it ends, what the first
    chunk's backward holds as it ends, and per chunk what a W holds as it casts a weight's
    gradient beside the chunk's). Returns (the peak, its state's transient, where
    that is a backward's end or a W's cast: x = 1, 3 or 4; else 0, the weight gradients
    that state holds,
    its state's transient where that is a BI's end: x = 2; else 0, of what it keeps for
    waiting Ws, ``w_caps[chunk]`` a micro-batch: the output gradients BIs captured, and
    the chunk whose backward starts at the peak: -1 where none does or it is not known,
    -2 where the peak is a W's cast; and whether that backward is the chunk's first,
    where ``fresh[chunk]`` = (its backward start's transient there, the weight gradients
    that start has made: counted among the gradients) leads).
    ``boundary``: bytes of a stage's output or input gradient, held at a backward's start
    by each awaiting its send; ``last_cast``: a tied head's cast of the table on the rank
    of the last stage, held only while its last chunk has a micro-batch in flight (the
    head's backward lets go of it; an interleaved rank's other chunks run without it).
    ``forward_ends[chunk]``: as ``forward_peaks``' ``ends`` for the rank, its forwards' ends
    weighed too (x = 5; the chunk returned -3 where one is the peak)."""
    best, ends, held_grads, captures, waiting, chunk = 0.0, 0.0, 0.0, 0.0, 0.0, -1
    first_b = False
    for fwd, wait_w, made, (x, *after) in compiled.grad_states[rank]:
        if x == 5:  # a forward's end (``_forward_vectors``), where they are weighed
            if not forward_ends:
                continue
            end, output = forward_ends[after[0]]
            extra, new_grads = end + after[1] * output, 0.0
            if not (fwd[-1] or wait_w[-1]):
                extra -= last_cast
        else:
            extra, new_grads = transient[x], 0.0
        following = after[0] if after else -1
        if x == 4:
            extra = extra[after[0]]
            if not extra:
                continue
        if x == 0:
            extra = extra[following] if following >= 0 else max(extra)
            lead = fresh[following] if fresh and following >= 0 else None
            if lead is not None and not made[following] and sum(lead) > extra:
                extra, new_grads = lead
            extra += boundary * (after[1] if len(after) > 1 else 0)
            if not (fwd[-1] or wait_w[-1]):
                extra -= last_cast
        total, made_grads = extra, 0.0
        for c, (n_f, n_w, done) in enumerate(zip(fwd, wait_w, made)):
            held, keep = weights[c]
            total += n_f * held + n_w * keep
            made_grads += done * grads[c]
        made_grads += new_grads
        total += made_grads
        if total > best:
            best, ends, held_grads = total, extra if x in (1, 3, 4) else 0.0, made_grads
            first_b = new_grads > 0
            captures = extra if x == 2 else 0.0
            waiting = sum(n * c for n, c in zip(wait_w, w_caps))
            chunk = following if x == 0 else {4: -2, 5: -3}.get(x, -1)
    return best, ends, held_grads, captures, waiting, chunk, first_b
