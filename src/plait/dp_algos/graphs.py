"""Gossip graphs as data: who mixes with whom, with which weights, and the point-to-point
batches that carry it -- checked against NCCL's rules without any process.

Replicas are numbered 0 .. R-1 (their dp index, or dp index // K under hybrid ZeRO).

Graphs (undirected unless said):

- ``ring``: i - 1 and i + 1 (mod R).
- ``torus``: R = a x b with a the largest divisor of R not above sqrt(R) (4 x 4 for 16,
  2 x 3 for 6); replica i = (i // b, i % b) talks to its four grid neighbours, wrapping.
  A prime R has no such grid (a = 1): the torus is then the ring.
- ``exponential``: i +- 2^k (mod R) for k = 0 .. ceil(log2 R) - 1 -- the static
  exponential graph of Ying et al. (2021), made symmetric so that Metropolis-Hastings
  weights apply; about 2 log2 R neighbours.
- ``complete``: everyone (the mixing is then the exact average: a reference, not a
  saving).
- ``one-peer-exponential`` (directed, time-varying; Ying et al. 2021): at step t, with
  tau = ceil(log2 R) and s = 2^(t mod tau), replica i receives from i + s and sends to
  i - s, and mixes x_i <- (x_i + x_{i+s}) / 2. For R a power of two, tau consecutive
  rounds multiply to the exact average (every one of the R values reaches every replica
  with weight 1/R), which the tests check.

Weights. Undirected graphs use Metropolis-Hastings weights, W_ij = 1 / (1 + max(d_i,
d_j)) on an edge and W_ii = 1 - sum_j W_ij: symmetric, doubly stochastic, and for the
regular graphs above simply 1 / (d + 1) everywhere. The one-peer graph uses (I + P) / 2,
P a permutation: doubly stochastic too. A doubly-stochastic W keeps the replicas' mean
unchanged by mixing; the spectral gap 1 - |lambda_2(W)| says how fast the spread around
it shrinks (tests: ring < torus < exponential).

Point-to-point, and why it cannot deadlock under NCCL. Each gossip round, every replica
posts *one* batch (``comm.batch_p2p``, one ``batch_isend_irecv``: one NCCL group) holding
all its sends and receives of that round, and waits for it before mixing; the next round
is posted only after. ``round_ops`` builds these batches -- ``gossip.mix`` posts exactly
its list --; every send of round t has its receive in the peer's batch of round t (the
graph is symmetric, or, one-peer, i sends to i - s exactly when i - s receives from i),
and between two replicas at most one message goes each way per round, so NCCL's in-order
matching pairs them. ``run_p2p`` runs batches under the one model of NCCL's semantics
(``plait/nccl_p2p.py``: a rank's batches run one at a time in posting order; a send
completes only once its receive has started -- no buffering; a batch finishes with its
last message) and raises on a deadlock; the tests run the batches ``gossip.mix`` posts,
for every graph and every R up to 17, through it, and show that posting the same messages
one at a time (send to each neighbour, then receive from each) deadlocks.
"""

from __future__ import annotations

import math

import numpy as np

from plait.dp_algos.config import TOPOLOGIES
from plait.nccl_p2p import Compute, Message, Post, resolve


def _tau(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def torus_shape(n: int) -> tuple[int, int]:
    """(rows a, columns b), a the largest divisor of n with a <= sqrt(n)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


def neighbours(topology: str, n: int, i: int, step: int = 0) -> tuple[list[int], list[int]]:
    """(replicas i receives from, replicas i sends to) in round ``step``, each sorted and
    without i; for undirected graphs the two lists are equal."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"--topology {topology!r}: choose one of {', '.join(TOPOLOGIES)}")
    if n < 2:
        return [], []
    if topology == "one-peer-exponential":
        s = 2 ** (step % _tau(n))
        return [(i + s) % n], [(i - s) % n]
    if topology == "ring":
        peers = {(i - 1) % n, (i + 1) % n}
    elif topology == "torus":
        a, b = torus_shape(n)
        r, c = divmod(i, b)
        peers = {((r + dr) % a) * b + (c + dc) % b for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))}
    elif topology == "exponential":
        peers = {(i + sign * 2**k) % n for k in range(_tau(n)) for sign in (1, -1)}
    else:  # complete
        peers = set(range(n))
    peers.discard(i)
    out = sorted(peers)
    return out, list(out)


def mixing_matrix(topology: str, n: int, step: int = 0) -> np.ndarray:
    """W (n x n, float64) of round ``step`` (module docstring): x_i <- sum_j W_ij x_j."""
    w = np.zeros((n, n))
    if topology == "one-peer-exponential":
        for i in range(n):
            (src,), _ = neighbours(topology, n, i, step) if n > 1 else ([i], [])
            w[i, i] += 0.5
            w[i, src] += 0.5
        return w
    degree = [len(neighbours(topology, n, i)[0]) for i in range(n)]
    for i in range(n):
        for j in neighbours(topology, n, i)[0]:
            w[i, j] = 1.0 / (1 + max(degree[i], degree[j]))
        w[i, i] = 1.0 - w[i].sum()
    return w


def weights(topology: str, n: int, i: int, step: int = 0) -> tuple[float, dict[int, float]]:
    """(W_ii, {j: W_ij}) for replica i: what it keeps of itself and takes from each peer."""
    w = mixing_matrix(topology, n, step)
    peers, _ = neighbours(topology, n, i, step)
    return float(w[i, i]), {j: float(w[i, j]) for j in peers}


def spectral_gap(w: np.ndarray) -> float:
    """1 - the second largest |eigenvalue| of W (W doubly stochastic: the largest is 1)."""
    mags = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    return float(1.0 - mags[1]) if len(mags) > 1 else 1.0


def degree(topology: str, n: int) -> int:
    """Messages a replica sends per round (the bytes multiplier of gossip)."""
    return len(neighbours(topology, n, 0)[1])


def rounds_to_average(topology: str, n: int) -> int:
    """Rounds after which the product of the mixing matrices is the exact average, for
    the one-peer graph with n a power of two (tau = log2 n); 0 when it never is."""
    if topology == "complete":
        return 1
    if topology == "one-peer-exponential" and n & (n - 1) == 0:
        return _tau(n)
    return 0


# --- point-to-point batches and NCCL's semantics --------------------------------------------


def round_ops(topology: str, n: int, i: int, step: int) -> list[tuple[str, int]]:
    """Replica i's batch of round ``step``: ("send", peer) and ("recv", peer), all posted
    together (module docstring). Sends first, then receives; within one NCCL group the
    order does not matter."""
    recv_from, send_to = neighbours(topology, n, i, step)
    return [("send", j) for j in send_to] + [("recv", j) for j in recv_from]


def one_at_a_time(topology: str, n: int, steps: int) -> list[list[list[tuple[str, int]]]]:
    """The same messages, each its own batch, sends before receives: what a naive
    per-neighbour ``send`` / ``recv`` loop does (it deadlocks under NCCL)."""
    return [[[op] for t in range(steps) for op in round_ops(topology, n, i, t)] for i in range(n)]


def run_p2p(batches: list[list[list[tuple[str, int]]]]) -> int:
    """Run every rank's batches under NCCL's point-to-point semantics (``nccl_p2p``); return
    the number of batches completed, or raise ``P2PDeadlock`` naming the ranks that wait
    forever, or a message left without its other side (``nccl_p2p.P2PDeadlock``).

    Rank r posts ``batches[r][b]`` and waits for it before posting ``batches[r][b + 1]``
    (the caller mixes in between). Messages between two ranks are matched in posting
    order (the k-th send from a to b with the k-th receive at b from a)."""
    programs = [
        [x for b, batch in enumerate(rank)
         for x in (Post(tuple(Message(kind, peer) for kind, peer in batch)), Compute(2 * b))]
        for rank in batches
    ]  # fmt: skip
    resolve(
        programs,
        what="gossip batches deadlock",
        name=lambda rank, i: f"(batch {i // 2}: {batches[rank][i // 2]})",
    )
    return sum(len(x) for x in batches)
