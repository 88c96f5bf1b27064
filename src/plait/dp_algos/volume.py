"""Bytes per step of every data-parallel algorithm, as formulas: what one rank sends and
what ``comm.py`` counts, across the replicas, at a given step. Pure Python (no torch): the
tests compare the runtime's counts with these exactly, and the simulator prices them.

Inputs: the tensors this rank reduces or averages across replicas, as shapes -- its
parameters (their tp shards, its pipeline chunks) without ZeRO, or the flat shards it
holds under ZeRO with ``--zero-shard-group`` -- and n, the ranks across which the
algorithm runs (R replicas; every dp rank for a ZeRO 0/1 compressed all-reduce). All
tensors are fp32 (plait's weights and gradients). Conventions are ``comm.py``'s: counted
bytes per operation (all-reduce: the tensor; all-gather: the gathered output; send and
recv: the tensor), and bytes *sent* on the wire under ring algorithms (all-reduce
2 (n-1)/n x the tensor, all-gather (n-1)/n x the output).

Per step (E = 4 x elements, t = the step from 1):

=========================  ======================================  =======================
algorithm                  counted                                 sent
=========================  ======================================  =======================
all-reduce                 all_reduce E                            2 (n-1)/n E
bf16                       all_reduce E/2                          2 (n-1)/n E/2
int8                       all_reduce sum(e + 4 ceil(e/512))       2 (n-1)/n x that
qsgd:s                     all_gather n sum(e + 4 ceil(e/512))     (n-1) sum(...)
topk:r                     all_gather n sum 8 ceil(r e)            (n-1) sum(...)
powersgd:r                 all_reduce sum 4 r (rows + cols)        2 (n-1)/n x that
                           (+ 4e for tensors sent whole)
local-sgd H (warm-up W)    all_reduce E when t <= W or H | t - W   2 (n-1)/n E then
  + optimizer state        all_reduce (1 + s) E at a sync          2 (n-1)/n (1 + s) E
  + bf16 sync              all_reduce E/2 at a sync                2 (n-1)/n E/2
  + int8 sync              all_reduce sum(e + 4 ceil(e/512))       2 (n-1)/n x that
diloco H                   all_reduce E when H | t                 2 (n-1)/n E then
  + bf16 / int8            as local SGD's sync
gossip (degree d)          send d E, recv d E                      d E
gossip + PGA H             all_reduce E instead when H | t         2 (n-1)/n E then
=========================  ======================================  =======================

(e: a tensor's elements; the sums run over the tensors; s: the optimizer's elementwise
state tensors averaged with the parameters under ``--sync-optimizer-state``, 1 for SGD
with momentum, 2 for AdamW.) Averaged over H steps, local SGD
and DiLoCo send 2 (n-1)/n E / H per step: H times fewer bytes than all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.dp_algos import graphs
from plait.dp_algos.config import DPAlgoConfig

QSGD_BLOCK = 512  # elements per QSGD norm / int8 scale (compression.py's codecs use these:
# it imports torch, this does not)
# elements a codec encodes at a time (whole blocks): its working set in the backward stays
# under 64 MiB whatever the tensor (``compression.encode_levels``)
ENCODE_CHUNK = 8192 * QSGD_BLOCK
# the codecs whose launch allocates the bucket's message (bf16's cast, QSGD's and top-k's
# n gathered messages) and whose completion is local work (a wait, a decode): of a
# ZeRO-0/1 reduction, at most ``IN_FLIGHT`` of their buckets are launched and not yet
# decoded (``compressed_grads.CompressedGrads``)
WINDOWED = ("bf16", "qsgd", "topk")
IN_FLIGHT = 2


@dataclass(frozen=True)
class Volume:
    """One rank's communication across replicas in one step."""

    counted: dict[str, int] = field(default_factory=dict)  # op -> bytes (comm.py's count)
    sent: float = 0.0  # bytes this rank puts on the wire
    messages: float = 0  # point-to-point messages this rank sends (gossip)

    def __add__(self, other: Volume) -> Volume:
        counted = dict(self.counted)
        for op, b in other.counted.items():
            counted[op] = counted.get(op, 0) + b
        return Volume(counted, self.sent + other.sent, self.messages + other.messages)


def _numel(shape) -> int:
    return math.prod(shape)


def all_reduce(nbytes: int, n: int) -> Volume:
    return Volume({"all_reduce": nbytes}, 2 * (n - 1) / n * nbytes) if nbytes else Volume()


def all_gather(message: int, n: int) -> Volume:
    return Volume({"all_gather": n * message}, (n - 1) * message) if message else Volume()


def codec_message(codec: str, arg, shape) -> int:
    """Bytes one rank contributes for one tensor (all-gathered codecs) or all-reduces
    (bf16, and PowerSGD's two rounds together)."""
    e = _numel(shape)
    if codec == "bf16":
        return 2 * e
    if codec in ("qsgd", "int8"):  # a byte per element, an fp32 norm or scale per block
        return e + 4 * math.ceil(e / QSGD_BLOCK)
    if codec == "topk":
        return 8 * (math.ceil(arg * e) if e else 0)
    if codec == "powersgd":
        mat = powersgd_matrix(shape, arg)
        if mat is None:
            return 4 * e
        rows, cols, r = mat
        return 4 * r * (rows + cols)
    raise ValueError(f"unknown codec {codec!r}")


def powersgd_matrix(shape, rank: int) -> tuple[int, int, int] | None:
    """(rows, cols, r) a tensor is compressed as, or None when it travels whole (as
    ``compression.PowerSGD.matrix_shape``)."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = _numel(shape) // rows if rows else 0
    r = min(rank, rows, cols)
    if r == 0 or r * (rows + cols) >= rows * cols:
        return None
    return rows, cols, r


def step_volume(cfg: DPAlgoConfig, *, step: int, shapes, n: int, index: int = 0,
                state_tensors: int = 2) -> Volume:  # fmt: skip
    """This rank's bytes across the n replicas at optimizer step ``step`` (from 0), for
    the tensors ``shapes`` (module docstring). ``index``: this rank's replica (gossip's
    one-peer graph sends one message whatever the index; the others are regular).
    ``state_tensors``: the optimizer's elementwise state tensors per parameter (2 for
    AdamW, 1 for SGD with momentum, 0 without), averaged at a local SGD sync under
    ``--sync-optimizer-state``."""
    if n < 2:
        return Volume()
    elems = sum(_numel(s) for s in shapes)
    whole = 4 * elems
    t = step + 1
    if cfg.grad_codec is not None and t <= cfg.compress_warmup:
        return all_reduce(whole, n)  # warm-up: the plain all-reduce
    if cfg.grad_codec is not None:
        codec, arg = cfg.codec
        msg = sum(codec_message(codec, arg, s) for s in shapes)
        if codec in ("bf16", "powersgd", "int8"):  # summable: all-reduced (in two rounds:
            # PowerSGD's P and Q, int8's scales and levels)
            return all_reduce(msg, n)
        return all_gather(msg, n)
    if cfg.algo == "allreduce":
        return all_reduce(whole, n)
    if cfg.algo == "local-sgd":
        warm = t <= cfg.local_warmup
        sync = is_sync(cfg, step)
        if sync and cfg.sync_optimizer_state:
            return all_reduce(whole * (1 + state_tensors), n)
        if sync:
            return sync_volume(cfg, shapes, n)
        return all_reduce(whole, n) if warm else Volume()
    if cfg.algo == "diloco":
        return sync_volume(cfg, shapes, n) if is_sync(cfg, step) else Volume()
    # gossip
    if is_sync(cfg, step):  # Gossip-PGA's all-reduce
        return all_reduce(whole, n)
    recv_from, send_to = graphs.neighbours(cfg.topology, n, index, step)
    return Volume(
        {"send": len(send_to) * whole, "recv": len(recv_from) * whole},
        float(len(send_to) * whole),
        len(send_to),
    )


def is_sync(cfg: DPAlgoConfig, step: int) -> bool:
    """Whether optimizer step ``step`` (from 0) ends in a synchronisation of the replicas:
    local SGD's after its warm-up every H, DiLoCo's every H, Gossip-PGA's all-reduce every
    H (``Replicas.is_sync``: the runtime decides by this too)."""
    t = step + 1
    if cfg.algo == "local-sgd":
        return t > cfg.local_warmup and (t - cfg.local_warmup) % cfg.sync_every == 0
    if cfg.algo == "diloco":
        return t % cfg.sync_every == 0
    if cfg.algo == "gossip":
        return bool(cfg.global_avg_every) and t % cfg.global_avg_every == 0
    return False


def characteristic_step(cfg: DPAlgoConfig | None) -> int:
    """The first optimizer step after step 0 (steps from 0) that does the algorithm's
    own work in steady state: local SGD's and DiLoCo's first sync after any warm-up, a
    codec's second compressed step after its warm-up, gossip's first step that is not a
    Gossip-PGA all-reduce; else 1. ``plait rehearse`` runs step 0 and this one, so its
    second step shows what the algorithm sends and holds (a sync every 4 steps would
    otherwise never run in a two-step rehearsal)."""
    if cfg is None:
        return 1
    if cfg.grad_codec is not None:  # the second compressed step: PowerSGD's error, made
        return cfg.compress_warmup + 1  # in the first, is then held through a backward

    def wanted(step: int) -> bool:  # a sync; for gossip, a step that is not PGA's
        return not is_sync(cfg, step) if cfg.algo == "gossip" else is_sync(cfg, step)

    period = (cfg.sync_every or 1) + cfg.global_avg_every
    return next((s for s in range(1, 2 + cfg.local_warmup + 2 * period) if wanted(s)), 1)


def block_scale_bytes(shapes) -> int:
    """int8's (and QSGD's) fp32 scales: one per block of 512 elements of each tensor."""
    return 4 * sum(math.ceil(_numel(s) / QSGD_BLOCK) for s in shapes)


def sync_volume(cfg: DPAlgoConfig, shapes, n: int) -> Volume:
    """One local SGD / DiLoCo sync of the tensors ``shapes``: fp32, bf16 or int8 (levels,
    then the block scales, each its own all-reduce)."""
    elems = sum(_numel(s) for s in shapes)
    if cfg.sync_codec == "bf16":
        return all_reduce(2 * elems, n)
    if cfg.sync_codec == "int8":
        return all_reduce(elems, n) + all_reduce(block_scale_bytes(shapes), n)
    return all_reduce(4 * elems, n)


def mean_volume(cfg: DPAlgoConfig, *, shapes, n: int, steps: int | None = None,
                state_tensors: int = 2) -> Volume:  # fmt: skip
    """The average ``Volume`` of a step over one period of the algorithm (H steps for
    local SGD / DiLoCo / Gossip-PGA, log2 n rounds of the one-peer graph, else 1), warm-up
    left out: what the simulator charges per step in steady state."""
    period = steps or _period(cfg, n)
    start = cfg.local_warmup if cfg.algo == "local-sgd" else cfg.compress_warmup
    total = Volume()
    for s in range(start, start + period):
        total = total + step_volume(cfg, step=s, shapes=shapes, n=n, state_tensors=state_tensors)
    return Volume(
        {op: b / period for op, b in total.counted.items()},
        total.sent / period,
        total.messages / period,
    )


def _period(cfg: DPAlgoConfig, n: int) -> int:
    if cfg.algo == "allreduce":
        return 1
    if cfg.algo in ("local-sgd", "diloco"):
        return cfg.sync_every
    rounds = max(1, math.ceil(math.log2(n))) if cfg.topology == "one-peer-exponential" else 1
    h = cfg.global_avg_every
    return h * rounds // math.gcd(h, rounds) if h else rounds
