"""NCCL's point-to-point semantics, as one model: per-rank lists of batches of sends and
receives, and of computes that wait for them, resolved without any process -- into the
order in which everything happens and, given costs, the time of each item; or into the
ranks that wait forever.

Communication: none. This module runs nothing; it says whether, and when, the batches that
plait posts complete under NCCL's rules: the pipeline's (``schedules.validate`` before the
first step, ``sim/pipeline.py`` to time a step) and gossip's (``dp_algos/graphs.py``). It
imports nothing from torch.

The rules -- NCCL's, which plait keeps on every backend:

1. A rank's *program* is an ordered list of items, run by its compute thread. A ``Post``
   (a batch: sends and receives posted together, one ``batch_isend_irecv``, one NCCL
   group) is posted when the thread reaches it; the thread goes on without waiting. A
   ``Compute`` first waits until the batch it names (``waits_for``: an earlier item of the
   same rank) has finished, then runs.
2. A rank's batches run one at a time, in posting order, on its communication queue
   (NCCL's stream): a batch starts once it is posted and the batch before it has finished.
3. Messages between two ranks are matched in posting order: the k-th send from rank a to
   rank b with the k-th receive at b from a (``pair``). Their ``tag``s (what the two sides
   believe the message is) must then agree, or the data would be mixed up.
4. A message completes once the batches holding its send and its receive have both
   started -- a send waits for its receive, nothing is buffered -- ``hop`` after the later
   start; a batch finishes with its last message.
5. A *deadlock*: some batch that never starts or finishes, or a compute whose batch never
   finishes. Whether one occurs, and which item waits on which, depends only on the lists,
   not on the costs: ``resolve`` finds it once, and ``timed`` then gives the times for any
   costs in one pass of additions and maxima.

Worked example: two ranks that exchange one message each way. Posted one message at a
time, send first::

    rank 0: [>1] [<1]        rank 1: [>0] [<0]

rank 0's send waits for rank 1's receive, which rank 1 posts as its second batch, which
starts only after its first (the send to rank 0) has finished, which waits for rank 0's
receive, queued behind rank 0's send: both ranks wait forever -- ``resolve`` raises
``P2PDeadlock`` naming rank 0's and rank 1's first batch. Posted together,
``[>1 <1]`` and ``[>0 <0]``, both batches start at once and complete: this is why
crossing messages travel in one batch in every caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

SEND, RECV = "send", "recv"
COMPUTE, POST, START, FINISH = 0, 1, 2, 3  # the kinds of ``Resolution.steps``


class P2PDeadlock(RuntimeError):
    """Batches that cannot all complete under NCCL's semantics: a message without its other
    side, or ranks that wait forever (named in the message)."""


class P2PMismatch(ValueError):
    """The k-th send from one rank to another and the k-th receive of it carry different
    tags: NCCL would pair them, and the receiver would get the wrong tensor."""


class Message(NamedTuple):
    """One side of a point-to-point message: ``kind`` SEND to or RECV from rank ``peer``.
    ``tag``: what the message is, to check that both sides agree (None: not checked).
    ``hop``: on a send, which entry of the transfer times given to ``timed`` it takes."""

    kind: str
    peer: int
    tag: object = None
    hop: int = 0


class Post(NamedTuple):
    """A batch posted together: one ``batch_isend_irecv``, one NCCL group."""

    messages: tuple[Message, ...]

    def __str__(self) -> str:  # [>1 <1]: a send to rank 1 and a receive from it
        return (
            "[" + " ".join(f"{'>' if m.kind == SEND else '<'}{m.peer}" for m in self.messages) + "]"
        )


class Compute(NamedTuple):
    """Work on the compute thread, run once the batch at item ``waits_for`` of the same
    rank has finished (None: it waits for nothing). ``cost``: which entry of the compute
    times given to ``timed`` it takes."""

    waits_for: int | None = None
    cost: int = 0

    def __str__(self) -> str:
        return "compute" if self.waits_for is None else f"compute after item {self.waits_for}"


Program = list[Post | Compute]  # one rank's items


def pair(programs: Sequence[Program]) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """Match every send with its receive as NCCL does, in posting order per (sender,
    receiver); return (send's (rank, item), receive's (rank, item), send's ``hop``) per
    message, in the order in which a scan of the lists (rank, item, message) first meets
    one of its sides. Raise ``P2PDeadlock`` for a message without its other side and
    ``P2PMismatch`` for two paired sides with different tags (the first such, by sender,
    receiver and position)."""
    sides: dict[tuple[int, int], tuple[list, list]] = {}  # (src, dst) -> (sends, receives)
    scan = []  # (src, dst, k) of every message side, in scan order
    for rank, items in enumerate(programs):
        for i, item in enumerate(items):
            if isinstance(item, Post):
                for msg in item.messages:
                    send = msg.kind == SEND
                    channel = (rank, msg.peer) if send else (msg.peer, rank)
                    queue = sides.setdefault(channel, ([], []))[0 if send else 1]
                    scan.append((*channel, len(queue)))
                    queue.append((rank, i, msg))
    for (src, dst), (sends, recvs) in sorted(sides.items()):
        for k in range(max(len(sends), len(recvs))):
            if k >= len(sends) or k >= len(recvs):
                missing = "send" if k >= len(sends) else "receive"
                raise P2PDeadlock(f"message {k} from rank {src} to rank {dst} has no {missing}")
            sent, received = sends[k][2].tag, recvs[k][2].tag
            if sent != received:
                raise P2PMismatch(
                    f"messages from rank {src} to rank {dst} are sent and received in "
                    f"different orders (message {k}: sent {sent}, received {received})"
                )
    out = []
    for src, dst, k in dict.fromkeys(scan):  # each message once, where first met
        (sr, si, msg), (rr, ri, _) = sides[(src, dst)][0][k], sides[(src, dst)][1][k]
        out.append(((sr, si), (rr, ri), msg.hop))
    return out


@dataclass(frozen=True)
class Resolution:
    """A set of programs resolved under NCCL's semantics. Items are numbered across ranks:
    rank r's item i is ``offsets[r] + i``. ``steps``: (kind, rank, item number, extra) in an
    order where each step comes after everything it waits for -- COMPUTE (extra: (the
    compute's ``cost``, the number of the batch it waits for or -1)), POST, START, FINISH
    of a batch (extra None). ``partners[n]``: for batch n, (number of the other batch,
    ``hop``) per message, in ``pair``'s order (``timed`` keeps the first of equal
    arrivals)."""

    offsets: tuple[int, ...]
    steps: tuple[tuple[int, int, int, object], ...]
    partners: tuple[tuple[tuple[int, int], ...] | None, ...]

    @property
    def num_items(self) -> int:
        return len(self.partners)


def resolve(
    programs: Sequence[Program],
    *,
    what: str = "batches deadlock",
    name: Callable[[int, int], str] | None = None,
) -> Resolution:
    """Run the programs symbolically (module docstring); raise ``P2PDeadlock`` (or
    ``P2PMismatch``, from ``pair``) if they cannot all complete.

    The error reads "{what} under NCCL's point-to-point semantics: rank 0's batch at item
    2 ...; rank 1 at item 5 ... wait forever", ``name(rank, item)`` naming each stuck item
    (a rank's batch when its queue is stuck on a batch its thread has passed, else the
    item its thread waits at).
    """
    p = len(programs)
    offsets, n = [], 0
    for items in programs:
        offsets.append(n)
        n += len(items)
    partners: list[list | None] = [None] * n
    for rank, items in enumerate(programs):
        for i, item in enumerate(items):
            if isinstance(item, Post):
                partners[offsets[rank] + i] = []
            elif item.waits_for is not None and not (
                0 <= item.waits_for < i and isinstance(items[item.waits_for], Post)
            ):
                raise ValueError(f"rank {rank} item {i} waits for item {item.waits_for}: no batch")
    for (sr, si), (rr, ri), hop in pair(programs):
        send, recv = offsets[sr] + si, offsets[rr] + ri
        partners[send].append((recv, hop))
        partners[recv].append((send, hop))

    steps: list[tuple] = []
    pos, head = [0] * p, [0] * p  # compute thread: next item; queue: index into batches
    batches = [[i for i, it in enumerate(items) if isinstance(it, Post)] for items in programs]
    posted, started, finished = set(), set(), set()
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            items, base = programs[rank], offsets[rank]
            while pos[rank] < len(items):  # the compute thread
                i, item = pos[rank], items[pos[rank]]
                if isinstance(item, Post):
                    steps.append((POST, rank, base + i, None))
                    posted.add(base + i)
                else:
                    wait = -1 if item.waits_for is None else base + item.waits_for
                    if wait >= 0 and wait not in finished:
                        break
                    steps.append((COMPUTE, rank, base + i, (item.cost, wait)))
                pos[rank] += 1
                progress = True
            while head[rank] < len(batches[rank]):  # the communication queue
                b = base + batches[rank][head[rank]]
                if b not in posted:
                    break
                if b not in started:
                    steps.append((START, rank, b, None))
                    started.add(b)
                    progress = True
                if any(other not in started for other, _ in partners[b]):
                    break
                steps.append((FINISH, rank, b, None))
                finished.add(b)
                head[rank] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(programs[r]) or head[r] < len(batches[r])]
    if stuck:
        name = name or (lambda rank, i: str(programs[rank][i]))

        def where(r: int) -> str:
            if head[r] < len(batches[r]) and (
                pos[r] == len(programs[r]) or batches[r][head[r]] < pos[r]
            ):
                i = batches[r][head[r]]
                return f"rank {r}'s batch at item {i} {name(r, i)}"
            return f"rank {r} at item {pos[r]} {name(r, pos[r])}"

        raise P2PDeadlock(
            f"{what} under NCCL's point-to-point semantics: "
            + "; ".join(where(r) for r in stuck)
            + " wait forever"
        )
    return Resolution(
        tuple(offsets), tuple(steps), tuple(None if x is None else tuple(x) for x in partners)
    )


@dataclass
class Times:
    """What ``timed`` returns, per item number: ``start`` and ``end`` (a compute: when it
    ran, after its wait; a batch: when it started and finished), ``flight`` (a batch: the
    ``hop`` of the message that finished it last, 0 if none outlasted its start); and per
    rank ``ends``, when its last item ended."""

    start: list[float]
    end: list[float]
    flight: list[float]
    ends: list[float] = field(default_factory=list)


def timed(resolution: Resolution, cost: Sequence[float], hop: Sequence[float]) -> Times:
    """Each item's times, every rank starting at 0: a compute takes ``cost[c]`` (c: its
    ``Compute.cost``) from the later of its thread's clock and its batch's finish; a batch
    starts at the later of its posting and the finish of the batch before it on the rank;
    a message arrives ``hop[h]`` (h: its send's ``Message.hop``) after the later start of
    its two batches; a batch finishes with its last message. One pass over the steps."""
    p, n = len(resolution.offsets), resolution.num_items
    clock, queue_free = [0.0] * p, [0.0] * p
    start, end, flight = [0.0] * n, [0.0] * n, [0.0] * n
    partners = resolution.partners
    for kind, rank, x, extra in resolution.steps:
        if kind == COMPUTE:
            c, wait = extra
            t = clock[rank]
            if wait >= 0 and end[wait] > t:
                t = end[wait]
            start[x] = t
            clock[rank] = end[x] = t + cost[c]
        elif kind == POST:
            start[x] = clock[rank]  # posted; START moves it to when the queue takes it
        elif kind == START:
            if queue_free[rank] > start[x]:
                start[x] = queue_free[rank]
        else:  # FINISH: the batch's last message
            s = done = start[x]
            for other, h in partners[x]:
                arrival = (s if s > start[other] else start[other]) + hop[h]
                if arrival > done:
                    done, flight[x] = arrival, hop[h]
            end[x] = queue_free[rank] = done
    return Times(start, end, flight, [max(a, b) for a, b in zip(clock, queue_free)])


@dataclass
class Timeline:
    """What each rank did when: ``events[rank]`` lists (item, start, end) in program order,
    compute and communication alike (a batch spans its wait). Items have ``is_compute``
    (the pipeline's ``Action`` / ``CommBatch``)."""

    events: list[list[tuple[object, float, float]]] = field(default_factory=list)

    @property
    def num_ranks(self) -> int:
        return len(self.events)

    @property
    def makespan(self) -> float:
        return max((end for rank in self.events for _, _, end in rank), default=0.0)

    def compute_time(self, rank: int) -> float:
        return sum(end - start for a, start, end in self.events[rank] if a.is_compute)

    def bubble_fraction(self) -> float:
        """(makespan - compute) / compute with compute the busiest rank's compute time, as
        in Narayanan et al. 2021: the pipeline's overhead over a device that never idles."""
        busiest = max((self.compute_time(r) for r in range(self.num_ranks)), default=0.0)
        return (self.makespan - busiest) / busiest if busiest > 0 else 0.0

    @classmethod
    def of(cls, items: Sequence[Sequence], resolution: Resolution, times: Times) -> Timeline:
        """The timeline of ``items[rank][i]`` (the caller's objects, one per program item)."""
        return cls([
            [(item, times.start[base + i], times.end[base + i]) for i, item in enumerate(row)]
            for row, base in zip(items, resolution.offsets)
        ])  # fmt: skip
