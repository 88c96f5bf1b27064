"""Pipeline schedules as data: what each pipeline rank does, and in which order.

Communication: point-to-point on the pp axis only, nothing else. For every micro-batch
and every boundary between consecutive virtual stages, one activation goes forward
(SEND_ACT / RECV_ACT) and one gradient goes backward (SEND_GRAD / RECV_GRAD), each
micro_batch_size x seq_len x hidden elements (divided by tp under sequence parallelism)
times the dtype's bytes. Per step 2 * m * (p * v - 1) such messages cross the pipeline
(p ranks, v chunks per rank, m micro-batches): a middle rank sends m * v activations and
m * v gradients; rank 0 sends m fewer gradients (stage 0 has no predecessor) and rank
p - 1 m fewer activations (the last stage computes the loss). This module only says
when; it imports nothing from torch.

Vocabulary. p = ``num_ranks`` pipeline ranks, m = ``num_microbatches``, v =
``num_chunks`` model chunks per rank (interleaving). The model is cut into S = p * v
*virtual stages*, placed in Megatron-LM's order: virtual stage s lives on rank s % p as
chunk s // p (``virtual_stage`` / ``stage_location``). With p=2, v=2: stages 0, 1, 2, 3
are (rank 0, chunk 0), (rank 1, chunk 0), (rank 0, chunk 1), (rank 1, chunk 1), so the
activation of stage 1 wraps from rank 1 back to rank 0's chunk 1.

A schedule is one ordered list of items per rank: compute ``Action``s -- F (forward),
B (full backward: input and weight gradients), or, for zero-bubble schedules, BI (input
gradient, on the critical path) and W (weight gradient, deferrable) -- and, between them,
``CommBatch``es: the point-to-point messages the rank posts together, as one
``batch_isend_irecv`` (one NCCL group). A message is a SEND_ACT / RECV_ACT (the output
activation of F(m, c) to the next virtual stage) or SEND_GRAD / RECV_GRAD (the input
gradient of B/BI(m, c) to the previous one); ``peer`` is the pipeline rank on the other
side and ``chunk`` the chunk on the rank that holds the message. Virtual stage 0 receives
no activation and sends no gradient; the last stage sends no activation and receives no
gradient (it computes the loss). ``_with_comm`` places them: after each compute, one batch
with the sends of the computes since the last batch and the receives of the computes up
to the next one -- the pairing Megatron-LM's ``send_forward_recv_backward`` makes. The
interleaved schedule posts no batch between a steady-state forward and the backward after
it, so that every steady-state batch carries both computes' sends and the next pair's
receives (Megatron-LM's ``send_forward_backward_recv_forward_backward``).

Why this cannot deadlock under NCCL. The executor keeps NCCL's point-to-point semantics
on every backend, and ``validate`` runs every schedule under them, symbolically, before
the first step: ``p2p_program`` turns the lists into the terms of the one model of those
semantics (``plait/nccl_p2p.py``: a rank's batches run one at a time in posting order; a
message completes once the batches holding its send and its receive have both started --
a send waits for its receive; a compute waits only for the batch holding the message it
reads), and ``nccl_p2p.resolve`` either finishes or names the ranks stuck -- e.g. two
ranks that each post a send to the other first and the matching receive later, which is
why crossing messages travel in one batch. Tests: pp 2-8, every vpp up to 4, 1 to 4p + 1
micro-batches, forward-only evaluation too.

Worked example: ``build_schedule("1f1b", num_ranks=2, num_microbatches=4)``. Rank 0 (the
first stage) warms up with min(p - r - 1, m) = 1 forward, then alternates one forward
and one backward, then drains; rank 1 (the last stage) has no warm-up. Written compactly
(``[>a0 <g1]`` = one batch: the activation of micro-batch 0 sent to the other rank and the
gradient of micro-batch 1 received from it)::

    rank 0: F0 [>a0] F1 [>a1 <g0] B0  F2 [>a2 <g1] B1  F3 [>a3 <g2] B2 [<g3] B3
    rank 1: [<a0] F0 B0 [>g0 <a1] F1 B1 [>g1 <a2] F2 B2 [>g2 <a3] F3 B3 [>g3]

Replayed on that model (``plait.sim.pipeline.replay``) with F = 1 and B = 2 time units
and free transfers (``.`` = waiting)::

    time    0  1  2  3  4  5  6  7  8  9  10 11 12 13 14
    rank 0  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3
    rank 1  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .

The makespan is 15 and each rank computes for 12, so the bubble fraction is
(15 - 12) / 12 = 1/4 = (p - 1) / m, as Narayanan et al. (2021) give for 1F1B.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from plait import nccl_p2p


class ScheduleError(ValueError):
    """An impossible schedule request, or a schedule that breaks the rules above."""


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "BI"  # zero-bubble split: input gradient only ...
    BACKWARD_WEIGHT = "W"  # ... and the weight gradient, run later
    SEND_ACT = "send_act"  # activation to the next virtual stage
    RECV_ACT = "recv_act"  # activation from the previous virtual stage
    SEND_GRAD = "send_grad"  # gradient to the previous virtual stage
    RECV_GRAD = "recv_grad"  # gradient from the next virtual stage
    COMM = "comm"  # a batch of the above, posted together (``CommBatch``)

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})


@dataclass(frozen=True)
class Action:
    op: Op
    microbatch: int
    chunk: int = 0  # model chunk on this rank (0 .. num_chunks - 1)
    peer: int | None = None  # pipeline rank on the other side, for send / recv

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def __str__(self) -> str:
        side = "" if self.peer is None else " to" if self.op in SEND_OPS else " from"
        peer = "" if self.peer is None else f"{side} rank {self.peer}"
        return f"{self.op.value}(m={self.microbatch}, chunk={self.chunk}{peer})"


@dataclass(frozen=True)
class CommBatch:
    """Point-to-point messages (SEND_* / RECV_* actions) that a rank posts together, as one
    ``batch_isend_irecv`` -- one NCCL group -- and that complete together."""

    messages: tuple[Action, ...]
    op = Op.COMM
    is_compute = False

    def __str__(self) -> str:
        return "comm(" + ", ".join(_short(m) for m in self.messages) + ")"


def _short(m: Action) -> str:
    sign = ">" if m.op in SEND_OPS else "<"
    kind = "a" if m.op in (Op.SEND_ACT, Op.RECV_ACT) else "g"
    chunk = f"c{m.chunk}" if m.chunk else ""
    return f"{sign}{kind}{m.microbatch}{chunk} {'to' if sign == '>' else 'from'} rank {m.peer}"


Item = Action | CommBatch  # what a rank's list holds: compute actions and batches
Schedule = list[list[Item]]  # one ordered list per pipeline rank


def messages(items) -> list[tuple[int, Action]]:
    """(index of its item, message) for every send and receive of one rank's list."""
    return [
        (i, m) for i, item in enumerate(items) if isinstance(item, CommBatch) for m in item.messages
    ]


def virtual_stage(rank: int, chunk: int, num_ranks: int) -> int:
    """Megatron-LM order: chunk c of rank r is stage c * p + r (p=4: rank 1 holds 1, 5, ...)."""
    return chunk * num_ranks + rank


def stage_location(stage: int, num_ranks: int) -> tuple[int, int]:
    """Inverse of ``virtual_stage``: (rank, chunk). p=4: stage 5 -> (1, 1)."""
    return stage % num_ranks, stage // num_ranks


# ---------------------------------------------------------------------------- building


# where a run's micro-batch count comes from (``plait viz schedule`` says --micro-batches)
MICRO_BATCHES_HINT = " (micro-batches = --global-batch-size / (--micro-batch-size x --dp))"


def _check_sizes(name: str, num_ranks: int, num_microbatches: int, num_chunks: int) -> None:
    if num_ranks < 1:
        raise ScheduleError(f"{name}: --pp must be at least 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ScheduleError(
            f"{name}: needs at least 1 micro-batch, got {num_microbatches}" + MICRO_BATCHES_HINT
        )
    if num_chunks < 1:
        raise ScheduleError(f"{name}: --vpp must be at least 1, got {num_chunks}")


def _no_interleaving(name: str, num_chunks: int) -> None:
    if num_chunks != 1:
        raise ScheduleError(
            f"--schedule {name} runs one model chunk per rank, got --vpp {num_chunks}; "
            "use --schedule interleaved-1f1b or --vpp 1"
        )


def _with_comm(
    rank: int,
    compute: Sequence[tuple[Op, int, int]],
    num_ranks: int,
    num_chunks: int,
    *,
    no_batch_after: Sequence[int] = (),
) -> list[Item]:
    """Turn one rank's compute order [(op, microbatch, chunk)] into its list of items.

    After each compute comes one ``CommBatch`` with the sends of the computes since the
    last batch and the receives of the computes up to the next one. ``no_batch_after``
    lists computes (by index) after which no batch is posted: their sends ride with the
    next batch, and the receives of the computes after them are posted before them. This
    is the only place that decides where communication sits, so every schedule function
    only has to say in which order to compute (and, for interleaving, which computes pair).
    """
    last = num_ranks * num_chunks - 1
    skip = set(no_batch_after)
    items: list[Item] = []
    segment: list[tuple[list, Action, list]] = []  # (receives, compute, sends)
    carried: list[Action] = []  # sends of the previous segment

    def close() -> None:
        nonlocal carried
        recvs = [m for r, _, _ in segment for m in r]
        if carried or recvs:
            items.append(CommBatch(tuple(carried + recvs)))
        items.extend(a for _, a, _ in segment)
        carried = [m for _, _, sends in segment for m in sends]
        segment.clear()

    for i, (op, mb, chunk) in enumerate(compute):
        stage = virtual_stage(rank, chunk, num_ranks)
        prev_rank = stage_location(stage - 1, num_ranks)[0]
        next_rank = stage_location(stage + 1, num_ranks)[0]
        recvs, sends = [], []
        if op is Op.FORWARD:
            if stage > 0:
                recvs.append(Action(Op.RECV_ACT, mb, chunk, prev_rank))
            if stage < last:
                sends.append(Action(Op.SEND_ACT, mb, chunk, next_rank))
        elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            if stage < last:
                recvs.append(Action(Op.RECV_GRAD, mb, chunk, next_rank))
            if stage > 0:
                sends.append(Action(Op.SEND_GRAD, mb, chunk, prev_rank))
        # (W needs nothing from anyone)
        segment.append((recvs, Action(op, mb, chunk), sends))
        if i not in skip:
            close()
    close()
    if carried:
        items.append(CommBatch(tuple(carried)))
    return items


def forward_only(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Evaluation: every micro-batch through every chunk, in (micro-batch, stage) order."""
    _check_sizes("forward-only", num_ranks, num_microbatches, num_chunks)
    order = [(Op.FORWARD, mb, c) for mb in range(num_microbatches) for c in range(num_chunks)]
    return [_with_comm(r, order, num_ranks, num_chunks) for r in range(num_ranks)]


def gpipe(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward. Holds m activations."""
    _check_sizes("gpipe", num_ranks, num_microbatches, num_chunks)
    _no_interleaving("gpipe", num_chunks)
    m = num_microbatches
    compute = [(Op.FORWARD, i, 0) for i in range(m)] + [(Op.BACKWARD, i, 0) for i in range(m)]
    return [_with_comm(r, compute, num_ranks, 1) for r in range(num_ranks)]


def _one_f_one_b_order(rank: int, p: int, m: int) -> list[tuple[Op, int, int]]:
    warmup = min(p - rank - 1, m)
    order = [(Op.FORWARD, i, 0) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [(Op.FORWARD, warmup + i, 0), (Op.BACKWARD, i, 0)]
    order += [(Op.BACKWARD, i, 0) for i in range(m - warmup, m)]  # cool-down
    return order


def one_f_one_b(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r warms up with
    min(p - r - 1, m) forwards, then alternates forward and backward, then drains the
    remaining backwards. Same bubble as GPipe, at most p - r activations held."""
    _check_sizes("1f1b", num_ranks, num_microbatches, num_chunks)
    _no_interleaving("1f1b", num_chunks)
    p, m = num_ranks, num_microbatches
    return [_with_comm(r, _one_f_one_b_order(r, p, m), p, 1) for r in range(p)]


def _interleaved_warmup(rank: int, p: int, m: int, v: int) -> int:
    if v == 1:  # one chunk: plain 1F1B, which Megatron-LM also falls back to
        return min(p - rank - 1, m)
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def interleaved_1f1b(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021; Megatron-LM's interleaved schedule).

    Each rank holds v chunks. Its k-th forward visits micro-batches in groups of p per
    chunk: with p=2, v=2 the order is (m0,c0) (m1,c0) (m0,c1) (m1,c1) (m2,c0) (m3,c0) ...;
    backwards go the same way with the chunks reversed. Warm-up: (p - r - 1) * 2 +
    (v - 1) * p forwards, capped at m * v; then one forward, one backward; then cool-down.
    Needs m to be a multiple of p when v > 1. The bubble shrinks to (p - 1) / (v m).
    """
    name = "interleaved-1f1b"
    _check_sizes(name, num_ranks, num_microbatches, num_chunks)
    p, m, v = num_ranks, num_microbatches, num_chunks
    if v > 1 and p == 1:
        raise ScheduleError(f"{name} with --vpp {v} needs --pp of at least 2; use --vpp 1")
    if v > 1 and m % p:
        raise ScheduleError(
            f"{name} needs the number of micro-batches ({m}) to be a multiple of --pp {p}"
            + MICRO_BATCHES_HINT
        )

    def unit(k: int, op: Op) -> tuple[Op, int, int]:
        group, in_group = divmod(k, p * v)
        chunk = in_group // p
        if op is Op.BACKWARD:
            chunk = v - 1 - chunk
        return op, group * p + in_group % p, chunk

    schedule = []
    for r in range(p):
        total, warmup = m * v, _interleaved_warmup(r, p, m, v)
        order = [unit(k, Op.FORWARD) for k in range(warmup)]
        steady_forwards = []
        for k in range(total - warmup):
            steady_forwards.append(len(order))
            order += [unit(warmup + k, Op.FORWARD), unit(k, Op.BACKWARD)]
        order += [unit(k, Op.BACKWARD) for k in range(total - warmup, total)]
        paired = steady_forwards if v > 1 else ()
        schedule.append(_with_comm(r, order, p, v, no_batch_after=paired))
    return schedule


def zb_h1(*, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), handcrafted variant.

    The backward is split into BI (input gradient, which the previous stage waits for)
    and W (weight gradient, which nobody waits for). The forwards and BIs follow 1F1B
    (warm-up of p - r - 1 forwards), and rank r runs each W r micro-batches late: the
    last rank, whose 1F1B cool-down is longest, defers the most, so the BIs of the last
    micro-batches reach rank 0 sooner and the deferred Ws fill what was the cool-down
    bubble. Activations awaiting BI stay <= p - r (as 1F1B); activations awaiting W stay
    <= p on every rank. With F = BI = W = 1 the bubble is (p - 1) / (3 m) for m >= p,
    a third of 1F1B's. With one rank there is nothing to fill: F, B per micro-batch.
    """
    _check_sizes("zb-h1", num_ranks, num_microbatches, num_chunks)
    _no_interleaving("zb-h1", num_chunks)
    p, m = num_ranks, num_microbatches
    if p == 1:
        return one_f_one_b(num_ranks=1, num_microbatches=m)
    schedule = []
    for r in range(p):
        delay = r
        order = []
        pending: deque[int] = deque()  # micro-batches whose W is still to run
        for op, mb, _ in _one_f_one_b_order(r, p, m):
            if op is Op.FORWARD:
                order.append((op, mb, 0))
                continue
            order.append((Op.BACKWARD_INPUT, mb, 0))
            pending.append(mb)
            if len(pending) > delay:
                order.append((Op.BACKWARD_WEIGHT, pending.popleft(), 0))
        order += [(Op.BACKWARD_WEIGHT, mb, 0) for mb in pending]
        schedule.append(_with_comm(r, order, p, 1))
    return schedule


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def build_schedule(
    name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1
) -> Schedule:
    """The action lists of schedule ``name`` (a key of ``SCHEDULES``), one per rank."""
    if name not in SCHEDULES:
        raise ScheduleError(f"--schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](
        num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks
    )


# ---------------------------------------------------------------------------- checking


def _message_key(rank: int, action: Action, num_ranks: int) -> tuple[str, int, int]:
    """What a send and its receive agree on: (kind, micro-batch, sending virtual stage)."""
    stage = virtual_stage(rank, action.chunk, num_ranks)
    if action.op is Op.SEND_ACT or action.op is Op.SEND_GRAD:
        src = stage
    elif action.op is Op.RECV_ACT:
        src = stage - 1
    else:  # RECV_GRAD
        src = stage + 1
    kind = "act" if action.op in (Op.SEND_ACT, Op.RECV_ACT) else "grad"
    return kind, action.microbatch, src


def _check_rank(
    rank: int,
    items: Sequence[Item],
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int,
    train: bool,
) -> None:
    """Per-rank rules: ranges, one F and one B (or BI + W) per (microbatch, chunk), in
    order, and each needed receive / send exactly once, in a batch on the right side of
    its compute. A position is the index of the item (a message: of its batch)."""
    where: dict[tuple[Op, int, int], int] = {}
    last = num_ranks * num_chunks - 1
    flat: list[tuple[int, Action]] = []
    for i, item in enumerate(items):
        if isinstance(item, CommBatch):
            if not item.messages:
                raise ScheduleError(f"rank {rank} item {i}: an empty batch")
            flat += [(i, m) for m in item.messages]
        else:
            flat.append((i, item))
    for i, a in flat:
        at = f"rank {rank} item {i} {a}"
        if not isinstance(a, Action) or not isinstance(a.op, Op) or a.op is Op.COMM:
            raise ScheduleError(f"rank {rank} item {i}: {a!r} is not an Action")
        if a.is_compute and not isinstance(items[i], Action):
            raise ScheduleError(f"{at}: a compute action inside a batch")
        if not a.is_compute and not isinstance(items[i], CommBatch):
            raise ScheduleError(f"{at}: a message outside a batch")
        if not 0 <= a.microbatch < num_microbatches:
            raise ScheduleError(f"{at}: micro-batch outside 0..{num_microbatches - 1}")
        if not 0 <= a.chunk < num_chunks:
            raise ScheduleError(f"{at}: chunk outside 0..{num_chunks - 1}")
        if a.is_compute and a.peer is not None:
            raise ScheduleError(f"{at}: compute actions have no peer")
        key = (a.op, a.microbatch, a.chunk)
        if key in where:
            raise ScheduleError(f"{at}: duplicate of item {where[key]}")
        where[key] = i
        if not a.is_compute:
            stage = virtual_stage(rank, a.chunk, num_ranks)
            other = stage + 1 if a.op in (Op.SEND_ACT, Op.RECV_GRAD) else stage - 1
            if not 0 <= other <= last:
                raise ScheduleError(f"{at}: virtual stage {stage} has no neighbour {other}")
            if a.peer != stage_location(other, num_ranks)[0]:
                raise ScheduleError(
                    f"{at}: stage {other} lives on rank {stage_location(other, num_ranks)[0]}"
                )

    def before(first: Op, then: Op, mb: int, c: int) -> None:
        if where[(first, mb, c)] >= where[(then, mb, c)]:
            raise ScheduleError(
                f"rank {rank} item {where[(then, mb, c)]} {then.value}(m={mb}, chunk={c}) "
                f"does not come after its {first.value} (item {where[(first, mb, c)]})"
            )

    for c in range(num_chunks):
        stage = virtual_stage(rank, c, num_ranks)
        for mb in range(num_microbatches):
            if (Op.FORWARD, mb, c) not in where:
                raise ScheduleError(f"rank {rank}: no F for micro-batch {mb} on chunk {c}")
            backward_ops = (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
            has = {op for op in backward_ops if (op, mb, c) in where}
            if not train:  # evaluation: forwards only, no gradient messages
                if has:
                    raise ScheduleError(f"rank {rank}: a backward in a forward-only schedule")
                needed = [(Op.RECV_ACT, Op.FORWARD)] if stage > 0 else []
                needed += [(Op.FORWARD, Op.SEND_ACT)] if stage < last else []
                grads = [(op, mb, c) in where for op in (Op.SEND_GRAD, Op.RECV_GRAD)]
                if any(grads):
                    raise ScheduleError(f"rank {rank}: gradient messages without a backward")
            elif has not in ({Op.BACKWARD}, {Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT}):
                found = ", ".join(sorted(op.value for op in has)) or "none"
                raise ScheduleError(
                    f"rank {rank}: micro-batch {mb} on chunk {c} needs one B, or one BI and "
                    f"one W; found {found}"
                )
            else:
                back = Op.BACKWARD if Op.BACKWARD in has else Op.BACKWARD_INPUT
                before(Op.FORWARD, back, mb, c)
                if back is Op.BACKWARD_INPUT:
                    before(Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, mb, c)
                needed = []
                if stage > 0:
                    needed += [(Op.RECV_ACT, Op.FORWARD), (back, Op.SEND_GRAD)]
                if stage < last:
                    needed += [(Op.FORWARD, Op.SEND_ACT), (Op.RECV_GRAD, back)]
            for first, then in needed:
                comm = first if first not in COMPUTE_OPS else then
                if (comm, mb, c) not in where:
                    raise ScheduleError(
                        f"rank {rank}: no {comm.value} for micro-batch {mb} on chunk {c} "
                        f"(virtual stage {stage})"
                    )
                before(first, then, mb, c)


def check_channel_order(schedule: Schedule) -> None:
    """Raise ScheduleError unless, for every ordered pair of ranks, the receiver posts its
    receives in the order the sender posts the sends: NCCL (and gloo) match the messages
    between two ranks in posting order (``nccl_p2p.pair``), so two messages of equal shape
    must not swap."""
    try:
        nccl_p2p.pair(p2p_program(schedule))
    except (nccl_p2p.P2PMismatch, nccl_p2p.P2PDeadlock) as e:
        raise ScheduleError(str(e)) from None


def consumed(rank: int, action: Action, num_ranks: int, num_chunks: int) -> tuple | None:
    """The message key a compute reads (its input activation, or the gradient of its
    output), or None when it reads none (stage 0's F, the last stage's B, any W)."""
    stage = virtual_stage(rank, action.chunk, num_ranks)
    if action.op is Op.FORWARD and stage > 0:
        return "act", action.microbatch, stage - 1
    last = num_ranks * num_chunks - 1
    if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and stage < last:
        return "grad", action.microbatch, stage + 1
    return None


def p2p_program(
    schedule: Schedule,
    *,
    cost_key: Callable[[int, Action], int] | None = None,
    hop_key: Callable[[int, Action], int] | None = None,
) -> list[nccl_p2p.Program]:
    """The schedule in the terms of the NCCL model (``plait/nccl_p2p.py``): each
    ``CommBatch`` a ``Post`` whose messages are tagged with their key (kind, micro-batch,
    sending virtual stage), each compute a ``Compute`` that waits for the batch receiving
    the message it reads (``consumed``). ``cost_key(rank, action)`` / ``hop_key(rank,
    send)`` say which entry of the cost and transfer vectors a compute / a send takes in
    ``nccl_p2p.timed``; by default each its own, numbered in list order (rank, item)."""
    p = len(schedule)
    num_chunks = 1 + max(
        (a.chunk for items in schedule for a in items if isinstance(a, Action)), default=0
    )
    costs, hops = itertools.count(), itertools.count()
    cost_key = cost_key or (lambda rank, action: next(costs))
    hop_key = hop_key or (lambda rank, send: next(hops))
    programs = []
    for rank, items in enumerate(schedule):
        program: nccl_p2p.Program = []
        received: dict[tuple, int] = {}  # message key -> index of the batch receiving it
        for i, item in enumerate(items):
            if isinstance(item, CommBatch):
                batch = []
                for m in item.messages:
                    key = _message_key(rank, m, p)
                    if m.op in SEND_OPS:
                        batch.append(nccl_p2p.Message(nccl_p2p.SEND, m.peer, key, hop_key(rank, m)))
                    else:
                        received[key] = i
                        batch.append(nccl_p2p.Message(nccl_p2p.RECV, m.peer, key))
                program.append(nccl_p2p.Post(tuple(batch)))
                continue
            key = consumed(rank, item, p, num_chunks)
            if key is not None and key not in received:
                raise ScheduleError(
                    f"rank {rank} item {i} {item}: no batch before it receives {key}"
                )
            wait = None if key is None else received[key]
            program.append(nccl_p2p.Compute(wait, cost_key(rank, item)))
        programs.append(program)
    return programs


def resolve(schedule: Schedule, **keys) -> nccl_p2p.Resolution:
    """``nccl_p2p.resolve`` on the schedule (``p2p_program``, with ``keys``), its errors as
    ``ScheduleError``: mismatched or missing messages, or the ranks that wait forever."""
    try:
        return nccl_p2p.resolve(
            p2p_program(schedule, **keys),
            what="schedule deadlocks",
            name=lambda rank, i: str(schedule[rank][i]),
        )
    except (nccl_p2p.P2PMismatch, nccl_p2p.P2PDeadlock) as e:
        raise ScheduleError(str(e)) from None


def validate(
    schedule: Schedule,
    *,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int = 1,
    train: bool = True,
) -> None:
    """Raise ``ScheduleError`` naming the first broken rule, else return None.

    Rules: one list per rank; each (micro-batch, chunk) on each rank has exactly one F and
    either one B or one BI and one W (``train=False``, evaluation: none), with F before
    B/BI before W; every receive and send the data flow needs is there exactly once, in a
    batch before the compute that reads it or after the one that wrote it, naming the
    right peer, and no other; messages between two ranks are posted in the same order on
    both sides; and running the lists under NCCL's semantics (``plait/nccl_p2p.py``)
    finishes: no deadlock.
    """
    if len(schedule) != num_ranks:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected {num_ranks}")
    for rank, items in enumerate(schedule):
        _check_rank(rank, items, num_ranks, num_microbatches, num_chunks, train)
    resolve(schedule)  # matched in posting order, and no deadlock


def max_in_flight(actions: Sequence[Item]) -> int:
    """Most (micro-batch, chunk) pairs on one rank whose F has run and whose B / BI has
    not: the activations held at once (W's smaller state is not counted)."""
    held = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            held -= 1
    return peak


def rank_states(actions: Sequence[Item]) -> frozenset:
    """The states one rank's list passes through, as a set: at each compute, its op and
    chunk, and per chunk the activations held (F run, B / BI not), the W still owed (BI
    run, W not), whether a weight gradient has been made yet (a B or W has run: from then
    on the rank holds its gradients), the messages received and not yet read, and the
    outputs made and not yet sent. Two lists with the same set differ only in how often
    they repeat a state: the steady state of 1F1B runs the same (F, B) pair at the same
    holdings m - warm-up times. p=2, rank 0: 1F1B at m=3 and at m=100 pass through the same
    states; at m=2 the F at 2 held with gradients made never happens."""
    chunks = 1 + max((a.chunk for a in actions if isinstance(a, Action)), default=0)
    held, owed, made = [0] * chunks, [0] * chunks, [False] * chunks
    sent = {(m.op in (Op.SEND_ACT,), m.microbatch, m.chunk)
            for _, m in messages(actions) if m.op in SEND_OPS}  # fmt: skip
    unread, unsent = set(), set()  # (is an activation, micro-batch, chunk)
    states = set()

    def per_chunk(keys: set) -> tuple:
        return tuple(sorted(Counter((act, c) for act, _, c in keys).items()))

    for a in actions:
        if isinstance(a, CommBatch):
            for m in a.messages:
                key = (m.op in (Op.SEND_ACT, Op.RECV_ACT), m.microbatch, m.chunk)
                (unsent.discard if m.op in SEND_OPS else unread.add)(key)
            continue
        states.add((a.op, a.chunk, tuple(held), tuple(owed), tuple(made), per_chunk(unread),
                    per_chunk(unsent)))  # fmt: skip
        act = a.op is Op.FORWARD
        if a.op is not Op.BACKWARD_WEIGHT:
            unread.discard((act, a.microbatch, a.chunk))
            if (act, a.microbatch, a.chunk) in sent:
                unsent.add((act, a.microbatch, a.chunk))
        if a.op is Op.FORWARD:
            held[a.chunk] += 1
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            held[a.chunk] -= 1
            owed[a.chunk] += a.op is Op.BACKWARD_INPUT
            made[a.chunk] |= a.op is Op.BACKWARD
        elif a.op is Op.BACKWARD_WEIGHT:
            owed[a.chunk] -= 1
            made[a.chunk] = True
    return frozenset(states)


def shortest_equivalent(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    num_chunks: int = 1,
    rank: int = 0,
    multiple_of: int = 1,
) -> int:
    """The fewest micro-batches m' <= m whose schedule ``name`` takes ``rank`` through the
    same states as m does (``rank_states``; so the same ``max_in_flight``, and the same
    holdings at every kind of compute), and at least 3 when m is (a first, a middle and a
    last micro-batch, which a step's first forward and last backward tell apart; and a
    multiple of ``multiple_of``, for a layout that asks one). Where
    nothing repeats -- GPipe holds all m before its first backward -- m itself. p=16,
    1F1B: rank 0 needs 17 (16 held, then a forward with gradients made), rank 15 needs 3."""
    m = num_microbatches

    def states(mb: int) -> frozenset:
        kw = dict(num_ranks=num_ranks, num_microbatches=mb, num_chunks=num_chunks)
        return rank_states(build_schedule(name, **kw)[rank])

    full = states(m)
    kw = dict(num_ranks=num_ranks, num_chunks=num_chunks, rank=rank)
    bound = in_flight_bound(name, num_microbatches=m, **kw)
    for short in range(min(3, m), m):
        if short % multiple_of or (name == "interleaved-1f1b" and num_chunks > 1
                                   and short % num_ranks):  # fmt: skip
            continue  # needs a multiple of p micro-batches
        if in_flight_bound(name, num_microbatches=short, **kw) != bound:
            continue  # the states hold fewer micro-batches at once: not the same (cheap)
        if states(short) == full:
            return short
    return m


def in_flight_bound(
    name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1, rank: int = 0
) -> int:
    """The ``max_in_flight`` that schedule ``name`` reaches on ``rank`` (rank 0 holds most)."""
    p, m, v = num_ranks, num_microbatches, num_chunks
    if name == "gpipe":
        return m
    if name in ("1f1b", "zb-h1"):
        return min(p - rank, m)
    if name == "interleaved-1f1b":
        return min(_interleaved_warmup(rank, p, m, v) + 1, m * v)
    raise ScheduleError(f"--schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")


def awaiting_weight_bound(
    name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1, rank: int = 0
) -> int:
    """Micro-batches whose weight gradient (W) is still to run on ``rank`` when it holds
    ``in_flight_bound`` forwards: ZB-H1 defers rank r's W by r slots, so its peak holds
    min(p - r, m) forwards and min(r, m - that) inputs kept for W (one peak per rank,
    ``tests/test_schedules.py`` holds it against the compiled schedules); 0 for the
    schedules that run B whole."""
    if name != "zb-h1":
        return 0
    held = in_flight_bound(name, num_ranks=num_ranks, num_microbatches=num_microbatches,
                           num_chunks=num_chunks, rank=rank)  # fmt: skip
    return min(rank, num_microbatches - held)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """Bubble fraction (idle / compute, as ``Timeline.bubble_fraction``) in closed form.

    Equal stages and free transfers; F = 1, B = 2 (interleaved: per chunk 1/v and 2/v);
    zb-h1 with F = BI = W = 1. GPipe and 1F1B: (p - 1) / m. Interleaved: (p - 1) / (v m).
    ZB-H1: (p - 1) / (3 m) for m >= p; with fewer micro-batches than ranks the BI chain
    cannot be hidden and it is (2 p - m - 1) / (3 m).
    """
    if name in ("gpipe", "1f1b"):
        return (p - 1) / m
    if name == "interleaved-1f1b":
        return (p - 1) / (v * m)
    if name == "zb-h1":
        return (p - 1) / (3 * m) if m >= p else (2 * p - m - 1) / (3 * m)
    raise ScheduleError(f"--schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")


def pipeline_transfers(name: str, rank: int, p: int, m: int, v: int = 1) -> int:
    """Stage-to-stage messages on the critical path while ``rank`` paces the pipeline, as
    the replay (``sim/pipeline.py``: a batch completes when its sends are received) counts
    them: the fill's, 2 (p v - 1) -- the first micro-batch's activations out and its
    gradients back -- and, for each micro-batch after the first, one wait per neighbour the
    rank exchanges with. A GPipe or 1F1B rank waits on 2 neighbours (1 at either end);
    interleaved 1F1B, which posts a forward's and a backward's messages together, once per
    chunk (v, and v - 1 on rank 0, whose first chunk has no predecessor), its warm-up
    hiding (p - 1)(v - 1) of the fill's ((p - 1)(v - 2) on rank 0); ZB-H1 three times in
    the middle, twice on rank 0, once on the last rank.

    Exact in the replay for interleaved 1F1B, and for GPipe and 1F1B within 3 messages
    (an even GPipe of two ranks waits twice a micro-batch: its forward and backward phases
    are paced by different ranks); ZB-H1 counts up to p - 1 more than the replay
    (``tests/test_sim.py``, which checks every count against the replay of a pipeline that
    rank paces)."""
    if p == 1:
        return 0
    first, last = int(rank == 0), int(rank == p - 1)
    fill = 2 * (p * v - 1)
    if name in ("gpipe", "1f1b"):
        return fill + (m - 1) * (2 - first - last)
    if name == "interleaved-1f1b":
        return fill - (p - 1) * (v - 1 - first) + (m - 1) * (v - first)
    if name == "zb-h1":
        return fill + (m - 1) * (3 - first - 2 * last)
    raise ScheduleError(f"--schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")


def pipeline_span(name: str, m: int, cost, hop: float = 0.0) -> float:
    """The time ``m`` micro-batches take through the pipeline in closed form, from
    ``cost[rank][chunk]`` = (F, B, BI, W) seconds of one micro-batch and ``hop``, the
    seconds of one stage-to-stage message: the rank that paces the pipeline runs its m
    micro-batches back to back, waits on ``pipeline_transfers`` messages, and every other
    rank adds its share of the fill and the drain -- the time the pacing rank waits on it:

    - GPipe: its F + B (the first micro-batch's forward reaches the pacing rank through
      it, the last one's backward leaves through it);
    - 1F1B: the same from a rank before the pacing rank r; from one after it, what the
      first backward's round trip through it adds beyond r's warm-up forwards,
      max(2 (F + B) - (F + B)_r, F + B - F_r, 0) (equal ranks: F + B);
    - interleaved 1F1B: (F + B) / v, one chunk's;
    - ZB-H1: max(F + BI - W, F, BI), with F, BI, W of all its chunks: the forward and
      input-gradient chains pass through it, and a weight gradient only fills the slot
      it is deferred to when it is shorter than what it covers (F = BI = W: one F, the
      schedule's (p - 1) / (3 m)); with fewer micro-batches than ranks, (p - m) / (p - 1)
      min(F, W) more (the tail no weight gradient is left to fill). Where the pacing
      rank's W is longer than every other's by d, its deferred weight gradients cover
      p d of the others' shares, down to their forwards (the fill no schedule hides).

    The pacing rank is the one that makes the span longest. With free transfers, equal
    ranks give m (F + B) (1 + ``bubble_formula``) at the textbook costs and the replay's
    span at any costs; one rank heavier than the rest: GPipe and 1F1B exactly wherever
    it is, interleaved and ZB-H1 exactly where it is the last (the head's; ZB-H1 from
    m = 2p, within about 5% at m = p) and within about 4% elsewhere
    (``tests/test_sim.py``: these rules were found against the replay). Before,
    m (F + B) of the busiest rank times (1 + ``bubble_formula``) charged every rank's
    fill at the busiest rank's cost (a 1.3B model with the head on its own stage, pp 8,
    m 8: 18.6% over the replay) and no transfer beyond the fill (36% under it for ZB-H1
    at 1 GB/s between stages)."""
    p, v = len(cost), len(cost[0])
    work = [sum(f + b for f, b, _, _ in row) for row in cost]
    if name == "1f1b":
        f = [sum(chunk[0] for chunk in row) for row in cost]

        def others(r):  # the ranks after r: their round trips, less r's warm-up forwards
            after = sum(max(2 * work[s] - work[r], work[s] - f[r], 0.0) for s in range(r + 1, p))
            return sum(work[:r]) + after
    elif name in ("gpipe", "interleaved-1f1b"):
        adds = [w / v for w in work]

        def others(r):
            return sum(adds) - adds[r]
    elif name == "zb-h1":
        f, bi, w = ([sum(chunk[i] for chunk in row) for row in cost] for i in (0, 2, 3))
        tail = max(0, p - m) / (p - 1) if p > 1 else 0.0
        adds = [max(f[r] + bi[r] - w[r], f[r], bi[r]) + tail * min(f[r], w[r]) for r in range(p)]

        def others(r):
            rest = [s for s in range(p) if s != r]
            longer = max(0.0, w[r] - max((w[s] for s in rest), default=w[r]))
            return max(sum(adds) - adds[r] - p * longer, sum(f[s] for s in rest))
    else:
        raise ScheduleError(f"--schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    return max(m * work[r] + pipeline_transfers(name, r, p, m, v) * hop + others(r)
               for r in range(p))  # fmt: skip
