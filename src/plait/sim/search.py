"""The layout search behind ``plait plan``: every valid layout of a model on a cluster,
ranked by simulated step time, the ones that do not fit in memory rejected.

    from plait.sim.search import PlanRequest, search, space_for
    plan = search(PlanRequest(model=cfg, hardware=hw, n_devices=1024, global_batch_size=1536))
    plan.best.layout, plan.best.result.iter_time_s, plan.best.result.peak_mem_bytes

The search space
    tp divides the devices, the heads and the FFN width (the key/value heads and tp divide
    one another) and is at most ``--max-tp`` (default: devices per node); pp divides the
    rest, at most the layers; dp = devices / (tp pp) divides the global batch; every
    micro-batch size dividing the per-replica batch (up to ``--max-micro-batch-size``);
    the schedules gpipe, 1f1b, zb-h1 and interleaved-1f1b with 2..``--max-vpp`` chunks
    per rank (pp vpp at most the layers, micro-batches a multiple of pp); ZeRO 0-3 (one stage
    only without data parallelism), and for ZeRO-3 on one pipeline stage HSDP groups
    (``_shard_choices``: a node's dp ranks times a power of two); sequence parallelism on or off (only with tp > 1);
    recomputation none, selective or full, and full for only the first N blocks of each
    model chunk (``--recompute-layers N``, below); context parallelism (cp > 1, each rank holding
    s / cp tokens of every sequence, ``sim/context.py``) for sequences of at least
    ``CP_MIN_SEQ_LEN`` tokens (or when ``--cp`` pins it): every cp dividing the devices
    left by tp x pp (dp = devices / (tp pp cp)), at most ``--max-cp``, with 2 cp dividing
    the sequence, and each exchange mode that can split the heads -- ring, allgather, a2a
    -- priced as a layout of its own, so the mode is picked by predicted step time (few
    key/value heads make allgather's K/V cheap, a2a needs heads divisible by cp, ring
    hides behind the blocks). Below that length activations are small and cp only adds
    exchanges, so the space stays as it was. For a mixture of experts, expert parallelism:
    every ep dividing both dp and the expert count (``sim/expert.py``: the experts' state
    falls as 1 / ep, their dispatch grows with it and leaves the node past it), priced
    like any other axis; a dense model keeps ep = 1. One pipeline rank runs every schedule alike,
    so pp = 1 is tried with 1f1b only. A runtime profile (``--runtime``) narrows the space
    to what that software could do (``RUNTIME_FEATURES``); any layout flag (``--tp 8``,
    ``--schedule 1f1b``, ``--zero 1`` ...) pins that axis.

The method: best-first branch and bound, exact over the space
    The objective is the simulator's closed-form step time, ``simulate(exact=False)``
    (``schedules.pipeline_span``: the micro-batches of the rank that paces the pipeline,
    each other rank's share of the fill and drain, and the messages it waits on; within
    0.03% of the replay on average, ``benchmarks/closed_form.py``), and a layout is
    feasible when that simulation says it fits. Every layout first gets two cheap lower
    bounds, built with the simulator's own cost functions (``costs.py``, ``memory.py``) from per-layer figures cached by the
    few axes they depend on (a layer's cost depends on tp, micro-batch, sequence
    parallelism and recomputation only; model state on tp, pp, vpp, dp and ZeRO):

    - memory: model state per ZeRO stage + buffers + overhead + activations, the
      larger of (the schedule's in-flight micro-batches x the rank's smallest chunk)
      and (the last stage's chunk with the head) -- both held at some instant of every
      schedule (the gradients left out where they may come after that instant: GPipe,
      or no more micro-batches than stages). A layout whose bound is above the device's memory can never fit, and is
      rejected without simulating;
    - time: m x busiest-rank work + the other ranks' share of the fill and drain (as
      ``schedules.pipeline_span`` with that rank pacing) + the fewest messages any rank
      waits on + optimizer + ZeRO gathers + the exposed gradient reduction (all of it
      where it is not overlapped; with one chunk per rank, what outlasts the last
      backward; with several chunks, nothing) -- the closed form itself but for that last case, the
      ranks' shares where a forward is needed (ZB-H1's and 1F1B's, from below) and the
      transfers of the rank that paces, taken 0.5% lower (``SLACK``) to stay a bound
      through small refinements of the costs.

    The survivors go on a heap keyed by their bound. Popping the smallest: a bound is
    replaced by the layout's simulated time (pushed back); a simulated time is final --
    nothing left on the heap can beat it, since every other key is a lower bound or a
    true time. So layouts come out in exact order of step time while only those whose
    bound is below the K-th best are ever simulated (the bound is within a few percent,
    so ~K to a few K of them). 10,000+ device clusters: ~10^4-10^5 layouts, bounds in
    about a second, a few dozen simulations. tests/test_plan.py checks the result against
    brute force on small spaces.

    Partial recomputation is one layout per layout of full recomputation
    (``FEWEST_BLOCKS``): the fewest blocks per chunk, 1 to one short of the chunk, whose
    closed form fits -- each block more recomputes more and holds less, so that is the
    fastest that fits (``resolve_blocks`` bisects when the layout comes up; a layout that
    fits recomputing nothing drops it, being that layout made slower). Its bounds: no
    recomputation's time plus a block's recomputation per chunk (``family_time``), full
    recomputation's memory. tests/test_plan.py's brute force tries every N.

    The K winners are then replayed exactly (``simulate(exact=True)``, the figures
    ``plait simulate`` prints; uneven stages and transfers included) and shown in that
    order; a layout whose replayed memory no longer fits is dropped for the next one (a
    partial recomputation's N + 1 goes back on the heap by its closed form).
    Compiling a schedule for the replay costs ~0.1 ms per (rank, micro-batch, chunk), so
    winners are replayed best first while the schedules they add stay within
    ``REPLAY_BUDGET`` of those units; the rest keep their closed-form figures (marked).

Figures: TFLOP/s and MFU count model FLOPs (no recomputation) against the hardware's
dense (non-sparse) peak of the dtype; the "simple estimate" line quotes the
8 x tokens x parameters convention of Narayanan et al. 2021 (it counts full
recomputation) against the same dense peak. Sparse peaks would halve every utilisation.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from plait.layout import CP_MODES, DTYPES, RECOMPUTE, SCHEDULES, Layout, check_cp_split
from plait.model import sizes
from plait.model.config import ModelConfig
from plait.parallel.pipeline.schedules import in_flight_bound, pipeline_transfers
from plait.sim import context as cp_sim
from plait.sim import costs, step
from plait.sim import expert as ep_sim
from plait.sim.hardware import Hardware
from plait.sim.memory import (
    chunk_activation_bytes,
    gather_input_bytes,
    last_stage_buffers,
    stage_params,
    zero3_buffer_bytes,
    zero3_gathered_bytes,
    zero3_head_unit_bytes,
)
from plait.sim.runtime import DEFAULT_RUNTIME, Runtime, get_runtime
from plait.sim.simulate import Result, layers_per_stage, simulate

GiB = 2**30
SLACK = 0.995  # the time bound is taken this much lower (module docstring)
# Replaying a schedule costs ~0.1 ms per (rank, micro-batch, chunk) to compile: the
# winners are replayed, best first, while the new schedules they need stay within this
# many units in all (~2 s).
REPLAY_BUDGET = 16384
FEWEST_BLOCKS = -1  # Candidate.recompute_layers: the fewest recomputing blocks that fit
FOLD = 1e-3  # relative step-time difference below which two layouts tie
# Context parallelism joins the search from this sequence length (module docstring): Llama 3
# trained 8k-token sequences without it and turned it on for its 128k phase.
CP_MIN_SEQ_LEN = 8192
TOKENS_PER_PARAM = 20  # Chinchilla (Hoffmann et al. 2022): compute-optimal tokens / parameter

# What the software each runtime profile models could do (the rest is searched fully).
# Megatron-LM 2021 (Narayanan et al. SC21): 1F1B and interleaved 1F1B, full activation
# recomputation of every block (the block method landed after the paper's runs, August
# 2021), no ZeRO; sequence parallelism and selective recomputation came in 2022
# (Korthikanti et al.: megatron-lm-2022). Megatron-DeepSpeed (BLOOM): its 1F1B engine,
# ZeRO-1, full recomputation in intervals alike. FSDP (llm-foundry): data parallelism
# with sharding only.
RUNTIME_FEATURES: dict[str, dict[str, tuple]] = {
    "megatron-lm": dict(
        schedule=("1f1b", "interleaved-1f1b"),
        zero=(0,),
        zero_shard_group=(0,),
        sequence_parallel=(False,),
        recompute=("none", "full"),
        recompute_layers=(0,),
        cp=(1,),
        ep=(1,),
    ),
    "megatron-lm-2022": dict(
        schedule=("1f1b", "interleaved-1f1b"),
        zero=(0,),
        zero_shard_group=(0,),
        recompute=("none", "selective", "full"),
        cp=(1,),
        ep=(1,),
    ),
    "megatron-deepspeed": dict(
        schedule=("1f1b",),
        zero=(0, 1),
        zero_shard_group=(0,),
        sequence_parallel=(False,),
        recompute=("none", "full"),
        recompute_layers=(0,),
        cp=(1,),
        ep=(1,),
    ),
    "fsdp": dict(tp=(1,), pp=(1,), zero=(2, 3), cp=(1,), ep=(1,)),
    "fms-fsdp": dict(tp=(1,), pp=(1,), zero=(2, 3), cp=(1,), ep=(1,)),
    "fsdp2": dict(tp=(1,), pp=(1,), zero=(2, 3), cp=(1,), ep=(1,)),
}


class Candidate(NamedTuple):
    """One point of the search space (the axes the planner chooses)."""

    tp: int
    pp: int
    dp: int
    vpp: int
    schedule: str
    micro_batch_size: int
    zero: int
    sequence_parallel: bool
    recompute: str
    cp: int = 1
    cp_mode: str = "ring"
    ep: int = 1
    # under ``full``: 0 every block; N > 0 the first N of each model chunk
    # (``--recompute-layers N``); ``FEWEST_BLOCKS``: the fewest N that fit, chosen when
    # the layout is simulated (``resolve_blocks``)
    recompute_layers: int = 0
    shard: int = 0  # ZeRO's shard group (HSDP, ``--zero-shard-group``); 0: all dp ranks

    def label(self) -> str:
        """Short form for tables: ``tp8 pp8 dp16 interleaved v2 mbs1 z1 sp selective``
        (with context parallelism ``tp8 pp1 dp2 cp4 ring ...``; ``full x3``: the first 3
        blocks of each chunk recompute; ``z3 hsdp64``: ZeRO-3 sharded within groups of
        64 dp ranks, replicated across them)."""
        sched = {"interleaved-1f1b": f"interleaved v{self.vpp}"}.get(self.schedule, self.schedule)
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{self.cp} {self.cp_mode}")
        if self.pp > 1:
            parts.append(sched)
        parts += [f"mbs{self.micro_batch_size}", f"z{self.zero}"]
        if self.shard:
            parts.append(f"hsdp{self.shard}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(self.recompute)
        if self.recompute_layers:
            parts.append("x?" if self.recompute_layers == FEWEST_BLOCKS else
                         f"x{self.recompute_layers}")  # fmt: skip
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Space:
    """Allowed values per axis; ``None`` means every valid value. ``max_*`` cap the
    axes whose valid range is large (see the module docstring)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    schedule: tuple[str, ...] = SCHEDULES
    micro_batch_size: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    # ZeRO-3's shard group (0: every dp rank); None: every dp rank, and groups of a node's
    # dp ranks times a power of two (``_shard_choices``)
    zero_shard_group: tuple[int, ...] | None = None
    sequence_parallel: tuple[bool, ...] = (False, True)
    recompute: tuple[str, ...] = RECOMPUTE
    # under ``full``: 0 every block, N the first N of each chunk; None: every block, and
    # the fewest blocks that fit (``Candidate.recompute_layers``)
    recompute_layers: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None  # None: 1, and more from CP_MIN_SEQ_LEN tokens
    cp_mode: tuple[str, ...] = CP_MODES
    ep: tuple[int, ...] | None = None  # None: every ep dividing dp and the experts (MoE)
    max_tp: int | None = None  # None: the hardware's devices per node
    max_vpp: int = 8
    max_micro_batch_size: int | None = None
    max_cp: int = 16

    def __post_init__(self) -> None:
        bad = [s for s in self.schedule if s not in SCHEDULES]
        if bad:
            raise ValueError(f"--schedule {bad[0]!r}: choose one of {', '.join(SCHEDULES)}")
        if self.max_vpp < 1:
            raise ValueError(f"--max-vpp must be at least 1, got {self.max_vpp}")
        if self.max_tp is not None and self.max_tp < 1:
            raise ValueError(f"--max-tp must be at least 1, got {self.max_tp}")
        if self.max_cp < 1:
            raise ValueError(f"--max-cp must be at least 1, got {self.max_cp}")

    def narrowed(self, **allowed: tuple) -> Space:
        """This space intersected with ``allowed`` values per axis."""
        changes = {}
        for axis, values in allowed.items():
            mine = getattr(self, axis)
            changes[axis] = tuple(values) if mine is None else tuple(v for v in mine if v in values)
        return Space(**{**self.__dict__, **changes})


def space_for(runtime: str, pins: dict | None = None, **limits) -> Space:
    """The space a runtime profile can run, with pinned axes (``{"tp": 8}``) and limits."""
    space = Space(**limits).narrowed(**RUNTIME_FEATURES.get(runtime, {}))
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    wanted = {}
    for axis, value in pins.items():
        allowed = getattr(space, axis)
        if allowed is not None and value not in allowed:
            can = ", ".join(map(_flag_value, allowed))
            if axis == "recompute_layers":
                can = "every block under --recompute full"
            elif axis == "zero_shard_group":
                can = "no HSDP: ZeRO shards over every data-parallel rank"
            raise ValueError(
                f"--{axis.replace('_', '-')} {_flag_value(value)} is outside what --runtime "
                f"{runtime} can run ({can})"
            )
        wanted[axis] = (value,)
    return space.narrowed(**wanted) if wanted else space


def _flag_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan: a model on ``n_devices`` of ``hardware`` for a global batch of
    ``global_batch_size`` sequences of ``model.seq_len`` tokens."""

    model: ModelConfig
    hardware: Hardware
    n_devices: int
    global_batch_size: int
    dtype: str = "bf16"
    runtime: str = DEFAULT_RUNTIME
    space: Space = field(default_factory=Space)
    top_k: int = 10
    exact: bool = True  # replay the K winners exactly
    tokens: float | None = None  # training tokens, for days and device-hours
    dp_algo: object | None = None  # dp_algos.DPAlgoConfig: price every layout with it
    moe_imbalance: float = 1.0  # a MoE model's most-loaded expert over the mean (sim/expert.py)

    def __post_init__(self) -> None:
        if self.n_devices < 1:
            raise ValueError(f"--gpus must be at least 1, got {self.n_devices}")
        if self.global_batch_size < 1:
            raise ValueError(
                f"--global-batch-size must be at least 1, got {self.global_batch_size}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        self.hardware.peak(self.dtype)  # raises: the device has no fast path for it
        get_runtime(self.runtime)
        if self.top_k < 1:
            raise ValueError(f"--top must be at least 1, got {self.top_k}")
        if self.tokens is not None and self.tokens <= 0:
            raise ValueError(f"--tokens must be positive, got {self.tokens:g}")
        ep_sim.check_imbalance(self.model, self.moe_imbalance)


@dataclass(frozen=True)
class Entry:
    """One ranked layout with its simulated figures."""

    candidate: Candidate
    layout: Layout
    result: Result  # the exact replay where ``replayed``, else the closed form
    screen_s: float  # closed-form step time the search ranked it by
    replayed: bool
    train_days: float | None = None
    device_hours: float | None = None

    def to_dict(self, model: ModelConfig) -> dict:
        """The ``plait simulate --json`` object of this layout, plus training time."""
        out = self.result.to_dict()
        out["model"] = model.to_dict()
        out["layout"] = self.layout.to_dict()
        if self.train_days is not None:
            out["train_days"] = self.train_days
            out["device_hours"] = self.device_hours
        return out


@dataclass(frozen=True)
class Rejected:
    """A layout that would have been fast but does not fit: its step time and memory."""

    candidate: Candidate
    iter_time_s: float
    peak_mem_bytes: float


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    entries: tuple[Entry, ...]  # best first
    n_layouts: int  # valid layouts in the space
    n_rejected_memory: int  # of them, rejected because they do not fit
    n_simulated: int  # closed-form simulations the search ran
    best_rejected: tuple[Rejected, ...]  # the fastest layouts rejected for memory
    seconds: float

    @property
    def best(self) -> Entry:
        return self.entries[0]


# -- the search space ----------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def candidates(req: PlanRequest):
    """Every valid layout of ``req`` (module docstring), as ``Candidate`` tuples."""
    cfg, n, G, sp_ = req.model, req.n_devices, req.global_batch_size, req.space
    L = cfg.n_layers
    max_tp = sp_.max_tp or req.hardware.devices_per_node
    kv = cfg.n_kv_heads
    for tp in _divisors(n):
        if (sp_.tp is not None and tp not in sp_.tp) or (sp_.tp is None and tp > max_tp):
            continue
        if cfg.n_heads % tp or (kv % tp and tp % kv) or cfg.ffn_hidden % tp:
            continue
        for pp in _divisors(n // tp):
            if pp > L or (sp_.pp is not None and pp not in sp_.pp):
                continue
            for cp, mode in _cp_choices(req, tp, pp):
                dp = n // (tp * pp * cp)
                if G % dp or (sp_.dp is not None and dp not in sp_.dp):
                    continue
                for ep in _ep_choices(req, dp):
                    yield from _per_replica(req, tp, pp, dp, cp, mode, ep)


def _ep_choices(req: PlanRequest, dp: int) -> list[int]:
    """Expert-parallel sizes for ``dp`` data-parallel ranks: 1 for a dense model; for a
    MoE model every ep dividing dp and the expert count (or the pinned ones that do)."""
    E = req.model.moe_experts
    if not E:
        return [1] if req.space.ep is None or 1 in req.space.ep else []
    allowed = req.space.ep or _divisors(dp)
    return [ep for ep in allowed if dp % ep == 0 and E % ep == 0]


def _per_replica(req: PlanRequest, tp: int, pp: int, dp: int, cp: int, mode: str, ep: int = 1):
    """The candidates of one (tp, pp, dp, cp, mode): micro-batch, schedule, sequence
    parallelism, recomputation and ZeRO stage."""
    cfg, G, sp_, L = req.model, req.global_batch_size, req.space, req.model.n_layers
    # without data parallelism (over dp x cp) there is nothing to shard
    zeros = sp_.zero if dp * cp > 1 else sp_.zero[:1]
    for mbs in _divisors(G // dp):
        if sp_.micro_batch_size is not None:
            if mbs not in sp_.micro_batch_size:
                continue
        elif sp_.max_micro_batch_size and mbs > sp_.max_micro_batch_size:
            continue
        m = G // (dp * mbs)
        for schedule, vpp in _schedules(sp_, pp, m, L):
            for seq_par in sp_.sequence_parallel:
                if seq_par and (tp == 1 or (mbs * cfg.seq_len // cp) % tp):
                    continue
                for recompute in sp_.recompute:
                    for blocks in _block_choices(sp_, recompute, _ceil_div(L, pp * vpp)):
                        for zero in zeros:
                            for shard in _shard_choices(req, tp, pp, dp, zero, cp, ep):
                                yield Candidate(tp, pp, dp, vpp, schedule, mbs, zero, seq_par,
                                                recompute, cp, mode, ep, blocks, shard)  # fmt: skip


def _shard_choices(
    req: PlanRequest, tp: int, pp: int, dp: int, zero: int, cp: int, ep: int
) -> list[int]:
    """``Candidate.shard`` values: the pinned ones where ZeRO shards and they divide dp;
    else 0 (every dp rank), and under ZeRO-3 (its per-layer gathers and reductions are
    what a smaller group speeds) HSDP groups of the dp ranks in a node (at least 2) times
    a power of two, below dp: for one pipeline stage (the FSDP-style layouts HSDP is made
    for; with pipelines the space grows by up to three quarters -- 175B on 1,024 A100s:
    32,592 -> 56,640 layouts -- and in 26 plans, 7B to 405B on 32 to 1,024 A100s and
    H100s under plait, Megatron-Core and FSDP2, none of those layouts won, 2026-11-28),
    dense models and no cp (their groups span dp alone)."""
    pinned = req.space.zero_shard_group
    if pinned is not None:
        return [g for g in pinned if g == 0 or (zero and dp % g == 0)]
    if zero != 3 or pp > 1 or cp > 1 or ep > 1:
        return [0]
    out, g = [0], max(2, req.hardware.devices_per_node // tp)
    while g < dp and dp % g == 0:
        out.append(g)
        g *= 2
    return out


def _block_choices(space: Space, recompute: str, chunk: int) -> list[int]:
    """``Candidate.recompute_layers`` values under ``recompute`` for chunks of at most
    ``chunk`` blocks: 0 but under ``full``, where the pinned ones, or every block and the
    fewest that fit (when a chunk has blocks to leave out)."""
    if recompute != "full":
        return [0]
    if space.recompute_layers is not None:
        return list(space.recompute_layers)
    return [0, FEWEST_BLOCKS] if chunk > 1 else [0]


def _cp_choices(req: PlanRequest, tp: int, pp: int) -> list[tuple[int, str]]:
    """(cp, mode) pairs for tp x pp (module docstring): (1, "ring") alone below
    ``CP_MIN_SEQ_LEN`` tokens unless ``--cp`` pins more."""
    cfg, sp_ = req.model, req.space
    if sp_.cp is not None:
        allowed = sp_.cp
    elif cfg.seq_len >= CP_MIN_SEQ_LEN:
        allowed = tuple(c for c in _divisors(req.n_devices // (tp * pp)) if c <= sp_.max_cp)
    else:
        allowed = (1,)
    out = []
    for cp in allowed:
        if (req.n_devices // (tp * pp)) % cp:
            continue
        if cp == 1:
            out.append((1, "ring"))
            continue
        for mode in sp_.cp_mode:
            try:  # the same checks as the trainer's (sequence parallelism aside)
                check_cp_split(cfg, Layout(cp=cp, tp=tp, cp_mode=mode))
            except ValueError:
                continue
            out.append((cp, mode))
    return out


def _schedules(space: Space, pp: int, m: int, L: int) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs for ``pp`` ranks and ``m`` micro-batches."""
    names = space.schedule
    if pp == 1:  # one pipeline rank: every schedule runs F then B; try one of them
        ok = space.vpp is None or 1 in space.vpp
        return [("1f1b" if "1f1b" in names else names[0], 1)] if ok else []
    out = []
    for name in names:
        if name != "interleaved-1f1b":
            if space.vpp is None or 1 in space.vpp:
                out.append((name, 1))
            continue
        for v in space.vpp or range(2, space.max_vpp + 1):
            if v == 1 and "1f1b" in names:
                continue  # interleaving one chunk is 1F1B
            if pp * v <= L and m % pp == 0:
                out.append((name, v))
    return out


def make_layout(c: Candidate, req: PlanRequest) -> Layout:
    return Layout(
        dp=c.dp, tp=c.tp, pp=c.pp, vpp=c.vpp, schedule=c.schedule,
        micro_batch_size=c.micro_batch_size, global_batch_size=req.global_batch_size,
        zero=c.zero, sequence_parallel=c.sequence_parallel, recompute=c.recompute,
        recompute_layers=c.recompute_layers if c.recompute_layers > 0 else None,
        dtype=req.dtype, cp=c.cp, cp_mode=c.cp_mode, ep=c.ep, zero_shard_group=c.shard or None,
    )  # fmt: skip


def largest_chunk(c: Candidate, req: PlanRequest) -> int:
    """The blocks of ``c``'s largest model chunk (the planner's layouts cut uniformly)."""
    return _ceil_div(req.model.n_layers, c.pp * c.vpp)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def resolve_blocks(
    req: PlanRequest, c: Candidate, known: bool = False
) -> tuple[Candidate | None, Result | None, int]:
    """A ``FEWEST_BLOCKS`` candidate made concrete: the fewest recomputing blocks per chunk,
    1 to one short of every block, whose closed form fits (each block more recomputes
    more and holds less, so the fewest that fit is the fastest that fits; tests/test_plan.py
    holds it against every N), with its result and the simulations it took. When none
    fits: the leanest of them, its result not fitting. When the layout fits recomputing
    nothing, the family is that layout made slower: (None, None, runs). ``known``: that
    it does not."""

    def member(n):  # 0: recomputing nothing
        return c._replace(recompute_layers=n, recompute="full" if n else "none")

    def sim(n):
        return simulate(req.model, make_layout(member(n), req), req.hardware,
                        runtime=req.runtime, exact=False, dp_algo=req.dp_algo,
                        moe_imbalance=req.moe_imbalance)  # fmt: skip

    hi = largest_chunk(c, req) - 1
    best, runs = (hi, sim(hi)), 1
    if not best[1].fits:
        return member(hi), best[1], runs
    lo = 1 if known else 0  # the fewest that fit is in [lo, best]
    while lo < best[0]:
        mid = (lo + best[0]) // 2
        res, runs = sim(mid), runs + 1
        if res.fits:
            best = (mid, res)
        else:
            lo = mid + 1
    if best[0] == 0:
        return None, None, runs
    return member(best[0]), best[1], runs


# -- bounds --------------------------------------------------------------------------------


def _memo(method):
    """Cache a ``_Bounds`` method's results per instance, keyed by its arguments (the
    few layout axes each figure depends on)."""
    name = method.__name__

    @functools.wraps(method)
    def cached(self, *args):
        table = self._memo_tables.setdefault(name, {})
        if args not in table:
            table[args] = method(self, *args)
        return table[args]

    return cached


class _Bounds:
    """Lower bounds on a candidate's closed-form step time and on its peak memory, from
    figures cached by the few axes each depends on (module docstring), each composed of
    the simulator's own terms (``step.py``, ``costs.py``, ``memory.py``,
    ``sizes.model_state_breakdown``). Per-rank figures are numpy vectors over the
    pipeline ranks."""

    def __init__(self, req: PlanRequest):
        self.req, self.cfg, self.hw = req, req.model, req.hardware
        if self.hw.host_overlap:  # the step is at least the device's, which has no host costs
            self.hw = self.hw.device_only()
        self.rt: Runtime = dataclasses.replace(
            get_runtime(req.runtime), moe_imbalance=req.moe_imbalance
        )
        self._memo_tables: dict[str, dict] = {}

    @_memo
    def proto(self, tp, pp, dp, mbs, sp, recompute, zero, cp=1, mode="ring", ep=1,
              shard=0) -> Layout:  # fmt: skip
        """A layout with these fields, for the cost functions (batch: one micro-batch)."""
        return Layout(
            dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, global_batch_size=mbs * dp,
            sequence_parallel=sp, recompute=recompute, zero=zero, dtype=self.req.dtype,
            cp=cp, cp_mode=mode, ep=ep, zero_shard_group=shard or None,
        )  # fmt: skip

    @_memo
    def layer(self, tp, mbs, sp, recompute, z3_dp, cp=1, mode="ring", ep=1, shard=0):
        """One layer's ``step.LayerStep`` (``z3_dp``: the data-parallel ranks of ZeRO-3, 0
        for none; its shard group spans them x cp, or ``shard`` of them); embedding and
        head (F, B);
        activation bytes of a layer and of the head; one layer's cp exchange buffers; a MoE
        block's step and activation bytes (the dense block's for a dense model)."""
        lay = self.proto(tp, 1, z3_dp or ep, mbs, sp, recompute, 3 if z3_dp else 0, cp, mode, ep,
                         shard if z3_dp else 0)  # fmt: skip
        if z3_dp:  # ZeRO-3's gradient reduction may spread over the step's micro-batches
            lay = lay.replace(global_batch_size=self.req.global_batch_size)
        e = costs.embedding_cost(self.cfg, lay, self.hw)
        h = costs.head_cost(self.cfg, lay, self.hw, self.rt)
        ends = (e.fwd + e.fwd_tp, e.bwd_weight, h.fwd + h.fwd_tp,
                h.bwd_input + h.bwd_tp + h.bwd_weight)  # fmt: skip
        held = chunk_activation_bytes(self.cfg, lay, self.rt, 1)[0]
        layer = step.layer_step(self.cfg, lay, self.hw, self.rt)
        cp_buf = cp_sim.buffer_bytes(self.cfg, lay, not cp_sim.math_attention(lay, self.rt))
        moe_layer, moe_held = layer, held
        if self.cfg.moe:
            moe_layer = step.layer_step(self.cfg, lay, self.hw, self.rt, moe=True)
            moe_held = chunk_activation_bytes(self.cfg, lay, self.rt, 1, 1)[0]
        return layer, ends, held, last_stage_buffers(self.cfg, lay), cp_buf, moe_layer, moe_held

    @_memo
    def ranks(self, tp, pp, vpp, ep=1):
        """Per pipeline rank: layers in all, in chunk 0, in the smallest chunk, whether it
        holds the first / last stage, layers of the last stage, parameters (one tp rank;
        routed experts apart), MoE layers in all and in chunk 0, routed expert parameters."""
        S = pp * vpp
        lay = self.proto(tp, pp, ep, 1, False, "none", 0, 1, "ring", ep)
        staged = Layout(tp=tp, pp=pp, vpp=vpp, schedule=_schedule_of(vpp), global_batch_size=pp)
        counts = layers_per_stage(self.cfg, staged)  # the planner's layouts cut uniformly
        moe = ep_sim.stage_moe_layers(self.cfg, counts)
        rows = [[counts[c * pp + r] for c in range(vpp)] for r in range(pp)]
        moe_rows = [[moe[c * pp + r] for c in range(vpp)] for r in range(pp)]
        params = [
            sum(stage_params(self.cfg, lay, n, c * pp + r == 0, c * pp + r == S - 1,
                             moe_rows[r][c])
                for c, n in enumerate(row))
            for r, row in enumerate(rows)
        ]  # fmt: skip
        first, last = np.zeros(pp), np.zeros(pp)
        first[0], last[(S - 1) % pp] = 1.0, 1.0
        moe_layers = np.array([sum(row) for row in moe_rows], float)
        return (
            np.array([sum(row) for row in rows], float), np.array([row[0] for row in rows], float),
            np.array([min(row) for row in rows], float), first, last, counts[-1],
            np.array(params), moe_layers, np.array([row[0] for row in moe_rows], float),
            moe_layers * ep_sim.expert_params(self.cfg, lay),
        )  # fmt: skip

    @_memo
    def work(self, tp, pp, vpp, mbs, sp, recompute, z3_dp, cp=1, mode="ring", ep=1, shard=0):
        """(per rank F + B of one micro-batch; per rank the F of its first chunk; per rank
        its B, with one chunk per rank), summed as ``simulate._action_costs`` does."""
        layer, (fe, be, fh, bh), _, _, _, routed, _ = self.layer(tp, mbs, sp, recompute, z3_dp,
                                                                 cp, mode, ep, shard)  # fmt: skip
        f, b, fm, bm = layer.fwd, layer.bwd, routed.fwd, routed.bwd
        layers, chunk0, _, first, last, _, _, moe, moe0, _ = self.ranks(tp, pp, vpp, ep)
        dense = layers - moe
        total = dense * (f + b) + moe * (fm + bm) + first * (fe + be) + last * (fh + bh)
        fwd0 = (chunk0 - moe0) * f + moe0 * fm + first * fe + (last * fh if vpp == 1 else 0.0)
        return total, fwd0, dense * b + moe * bm + first * be + last * bh

    @_memo
    def buckets(self, tp, pp, vpp, ep=1):
        """Per rank, the buckets its overlapped gradient reduction streams in
        (``costs.grad_buckets``, as ``simulate`` counts them), at least one."""
        rk = self.ranks(tp, pp, vpp, ep)
        lay = self.proto(tp, pp, ep, 1, False, "none", 0, 1, "ring", ep)
        return np.array([max(1, costs.grad_buckets(n, int(k), lay, self.rt))
                         for k, n in zip(rk[0], rk[6] + rk[9])], float)  # fmt: skip

    @_memo
    def hop(self, tp, pp, dp, mbs, sp, cp=1):
        """The slowest stage-to-stage message (``schedules.pipeline_transfers`` of them)."""
        lay = self.proto(tp, pp, dp, mbs, sp, "none", 0, cp)
        return max(max(pair) for pair in step.stage_messages(self.cfg, lay, self.hw))

    @_memo
    def dp_times(self, tp, pp, vpp, dp, zero, cp=1, ep=1, shard=0):
        """Per rank (gradient reduction, weight gather) seconds; optimizer seconds (the
        gradients reduced over dp x cp, ``costs.grad_ranks``; routed experts' over edp)."""
        lay = self.proto(tp, pp, dp, 1, False, "none", zero, cp, "ring", ep, shard)
        rk = self.ranks(tp, pp, vpp, ep)
        held = list(zip(rk[6].tolist(), rk[9].tolist()))  # (dense, routed experts) per rank
        tied = step.tied_sync(self.cfg, lay, self.hw, self.rt)

        def reduce(n, x):
            out = costs.dp_comm_time(n, lay, self.hw, self.rt)
            if x:
                more = costs.dp_comm_time(x, lay, self.hw, self.rt, experts=True)
                out = {k: out[k] + more[k] for k in out}
            return out

        times = {nx: reduce(*nx) for nx in set(held)}
        if self.req.dp_algo is not None:  # --dp-algo / --compress: at least nothing
            times = {nx: {"grad": 0.0, "param": 0.0} for nx in times}
        grad = np.array([times[nx]["grad"] + (tied if r in (0, pp - 1) else 0.0)
                         for r, nx in enumerate(held)])  # fmt: skip
        gather = np.array([times[nx]["param"] for nx in held])
        opt = max(costs.optimizer_time(n, lay, self.hw, self.rt, 0, x) for n, x in set(held))
        return grad, gather, opt

    @_memo
    def act(self, tp, pp, vpp, mbs, sp, recompute, schedule, m, cp=1, ep=1):
        """Per rank, activation bytes held at some instant of the schedule (module doc;
        with MoE blocks, each layer at the lesser of a dense and a MoE block's bytes)."""
        _, _, dense, head, _, _, routed = self.layer(tp, mbs, sp, recompute, 0, cp, "ring", ep)
        held = min(dense, routed)
        _, _, smallest, _, last, last_layers = self.ranks(tp, pp, vpp, ep)[:6]
        flight = np.array([
            in_flight_bound(schedule, num_ranks=pp, num_microbatches=m, num_chunks=vpp, rank=r)
            for r in range(pp)
        ], float)  # fmt: skip
        return np.maximum(flight * smallest * held, last * (last_layers * held + head))

    @_memo
    def state(self, tp, dp, zero, cp=1, ep=1, shard=0):
        """Model-state bytes per parameter on a device (ZeRO shards over dp x cp, or the
        ``shard`` group; a routed expert's over dp / ep x cp), the least ZeRO-3's buffers
        hold at any rank's peak (two gathered layers, or a last stage's head unit as its
        forward ends: ``memory.zero3_head_unit_bytes``), and of the two per-parameter
        figures, the gradients' bytes."""
        w_b, g_b, o_b = self.rt.state_bytes(self.req.dtype)

        def per_param(shard):
            return sizes.model_state_breakdown(
                1.0, dp=shard if zero else 1, zero=zero, param_bytes=w_b, grad_bytes=g_b,
                optim_bytes=o_b,
            )  # fmt: skip

        lay = self.proto(tp, 1, dp, 1, False, "none", zero, cp, "ring", ep, shard)
        buffers = zero3_buffer_bytes(self.cfg, lay, self.rt)
        if buffers and self.rt.zero3_grads_in_flight:  # the gathered layers, at least
            buffers = 2 * zero3_gathered_bytes(self.cfg, lay, self.rt)
            buffers += gather_input_bytes(self.cfg, lay, self.rt)
        if buffers:  # or, on a last stage as its forward ends, the head's unit alone
            buffers = min(buffers, zero3_head_unit_bytes(self.cfg, lay, self.rt))
        dense, routed = per_param(shard or dp * cp), per_param(dp // ep * cp)
        return dense["device"], routed["device"], buffers, (dense["grads"], routed["grads"])

    @_memo
    def first_block(self, tp, mbs, sp, z3_dp, cp=1, mode="ring", ep=1, shard=0) -> float:
        """The least a block's backward gains when it recomputes its forward (dense or MoE)."""
        full = self.layer(tp, mbs, sp, "full", z3_dp, cp, mode, ep, shard)
        none = self.layer(tp, mbs, sp, "none", z3_dp, cp, mode, ep, shard)
        return min(full[0].bwd - none[0].bwd, full[5].bwd - none[5].bwd)

    def time(self, c: Candidate) -> float:
        """A lower bound on ``simulate(exact=False).iter_time_s`` (module docstring; a
        chunk's first blocks recomputing: no recomputation's work, each chunk's backward
        re-running at least one block)."""
        m = self.req.global_batch_size // (c.dp * c.micro_batch_size)
        z3_dp = c.dp if c.zero == 3 else 0
        work, fwd0, bwd = self.work(
            c.tp, c.pp, c.vpp, c.micro_batch_size, c.sequence_parallel,
            "none" if c.recompute_layers else c.recompute, z3_dp, c.cp, c.cp_mode, c.ep, c.shard,
        )  # fmt: skip
        if c.recompute_layers:
            more = c.vpp * self.first_block(c.tp, c.micro_batch_size, c.sequence_parallel,
                                            z3_dp, c.cp, c.cp_mode, c.ep, c.shard)  # fmt: skip
            work, bwd = work + more, bwd + more
        # ``schedules.pipeline_span`` from below, at the busiest rank k: what each other
        # rank adds is its (F + B) / v; under 1F1B, after k, at least 2 (F + B) - k's;
        # under ZB-H1 (one chunk) at least its F
        k = int(work.argmax())
        if c.schedule == "1f1b":
            after = np.maximum(2 * work[k + 1 :] - work[k], 0.0)
            pipe = m * float(work[k]) + float(work[:k].sum() + after.sum())
        else:
            adds = fwd0 if c.schedule == "zb-h1" else work / c.vpp
            pipe = m * float(work[k]) + float(adds.sum() - adds.max())
        if c.pp > 1:  # the fewest messages any pacing rank waits on (the middle ranks alike)
            hop = self.hop(c.tp, c.pp, c.dp, c.micro_batch_size, c.sequence_parallel, c.cp)
            pipe += hop * min(pipeline_transfers(c.schedule, r, c.pp, m, c.vpp)
                              for r in (0, 1, c.pp - 1))  # fmt: skip
        grad, gather, opt = self.dp_times(c.tp, c.pp, c.vpp, c.dp, c.zero, c.cp, c.ep, c.shard)
        if not self.rt.overlap_grad_reduce:
            pipe += float(grad.max())
        elif c.vpp == 1:  # streamed during the backward, the rest after it: at least a bucket
            pieces = self.buckets(c.tp, c.pp, c.vpp, c.ep)
            pipe += float(np.maximum(grad - bwd, grad / pieces).max(initial=0.0))
        # every pipeline rank at once (arrays): the busiest rank's exposed gather
        exposed = float(np.max(step.exposed_weight_gather(gather, fwd0, self.rt, self.hw)))
        return SLACK * (pipe + opt + exposed)

    def family_time(self, c: Candidate, plain: float) -> float:
        """``time(c)`` from below for a chunk's first blocks recomputing, given ``plain``,
        the bound of ``c`` recomputing nothing: each rank's work grows by at least a block's
        recomputation per chunk, δ, which adds m δ to the span and hides at most δ more
        of the gradient reduction."""
        m = self.req.global_batch_size // (c.dp * c.micro_batch_size)
        more = c.vpp * self.first_block(c.tp, c.micro_batch_size, c.sequence_parallel,
                                        c.dp if c.zero == 3 else 0, c.cp, c.cp_mode, c.ep,
                                        c.shard)  # fmt: skip
        return plain + SLACK * (m - 1) * more

    def memory(self, c: Candidate) -> float:
        """A lower bound on the peak bytes per device, closed form or replayed (module
        docstring): the fullest pipeline rank (a chunk's first blocks recomputing: every
        block's)."""
        rk = self.ranks(c.tp, c.pp, c.vpp, c.ep)
        params, experts = rk[6], rk[9]
        per_param, per_expert_param, z3_buffers, grads = self.state(c.tp, c.dp, c.zero, c.cp,
                                                                    c.ep, c.shard)  # fmt: skip
        m = self.req.global_batch_size // (c.dp * c.micro_batch_size)
        if c.schedule == "gpipe" or m <= c.pp:  # the gradients may come after the peak
            per_param -= grads[0]  # (``memory.py``): count the activations' alone
            per_expert_param -= grads[1]
        act = self.act(c.tp, c.pp, c.vpp, c.micro_batch_size, c.sequence_parallel, c.recompute,
                       c.schedule, m, c.cp, c.ep)  # fmt: skip
        cp_buf = self.layer(c.tp, c.micro_batch_size, c.sequence_parallel, c.recompute, 0, c.cp,
                            c.cp_mode, c.ep)[4]  # fmt: skip
        fixed = self.hw.framework_overhead_bytes + z3_buffers + cp_buf
        return float((params * per_param + experts * per_expert_param + act).max()) + fixed


def _schedule_of(vpp: int) -> str:
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


# -- the search ----------------------------------------------------------------------------


def search(req: PlanRequest) -> Plan:
    """Rank the layouts of ``req`` (module docstring: best-first branch and bound)."""
    t0 = time.perf_counter()
    bounds = _Bounds(req)
    n_layouts, rejected, heap = _bounded(req, bounds)
    if n_layouts == 0:
        raise ValueError(_no_layout_message(req))
    counts = {"rejected": len(rejected.seen), "simulated": 0}
    entries: list[Entry] = []
    folded: dict[tuple, float] = {}
    budget, compiled, replaying = REPLAY_BUDGET, set(), req.exact
    for seconds, c, res in _fastest_first(req, heap, rejected, counts):
        # A layout that only changes ZeRO stage or recomputation of a better one, at the
        # same predicted time, is the same plan with more memory: fold it into that one.
        fold = c._replace(zero=0, recompute="", cp_mode="", recompute_layers=0, shard=0)
        if folded.get(fold, -1.0) >= seconds * (1 - FOLD):
            continue
        lay = make_layout(c, req)
        sched = (c.schedule, c.pp, lay.num_microbatches, c.vpp)
        units = c.pp * lay.num_microbatches * c.vpp
        replayed = replaying and (sched in compiled or units <= budget)
        if replayed:
            res = simulate(req.model, lay, req.hardware, runtime=req.runtime, exact=True,
                           dp_algo=req.dp_algo, moe_imbalance=req.moe_imbalance)  # fmt: skip
            if sched not in compiled:
                compiled.add(sched)
                budget -= units
            if not res.fits:  # the replayed peak is above the closed form's
                rejected.add(res.iter_time_s, c)
                more = c._replace(recompute_layers=c.recompute_layers + 1)
                searched = req.space.recompute_layers is None and c.recompute_layers > 0
                if searched and more.recompute_layers < largest_chunk(c, req):
                    # the fewest blocks that fit: one more, ranked by its own closed form
                    res = simulate(req.model, make_layout(more, req), req.hardware,
                                   runtime=req.runtime, exact=False, dp_algo=req.dp_algo,
                                   moe_imbalance=req.moe_imbalance)  # fmt: skip
                    counts["simulated"] += 1
                    _ranked(heap, rejected, more, res)
                continue
        replaying = replayed  # the replayed entries are a prefix of the ranking
        folded[fold] = seconds
        entries.append(_entry(req, c, lay, res, seconds, replayed))
        if len(entries) == req.top_k:
            break
    if not entries:
        raise ValueError(_nothing_fits_message(req, bounds))
    entries.sort(key=lambda e: (e.result.iter_time_s, e.result.peak_mem_bytes))
    best_rejected = []
    for seconds, c, res in rejected.fastest():
        if seconds < entries[0].result.iter_time_s:  # it would have won: say by how much
            if res is None:
                lay = make_layout(c, req)
                res = simulate(req.model, lay, req.hardware, runtime=req.runtime, exact=False,
                               dp_algo=req.dp_algo, moe_imbalance=req.moe_imbalance)  # fmt: skip
            best_rejected.append(Rejected(c, res.iter_time_s, res.peak_mem_bytes))
    return Plan(
        request=req,
        entries=tuple(entries),
        n_layouts=n_layouts,
        n_rejected_memory=len(rejected.seen),
        n_simulated=counts["simulated"],
        best_rejected=tuple(best_rejected),
        seconds=time.perf_counter() - t0,
    )


def _bounded(req: PlanRequest, bounds: _Bounds):
    """Every layout with its bounds: (count, the memory-rejected, a heap of the rest)."""
    cap = req.hardware.memory_bytes * (1 + 1e-9)
    rejected = _Rejections()
    heap = []
    n = 0
    group, known = None, {}  # the bounds of this group's layouts (below)
    for c in candidates(req):
        if req.dp_algo is not None and not _runs_algo(req, c):
            continue
        n += 1
        # a chunk's first blocks recomputing: no recomputation's time bound (made larger),
        # every block's memory bound, both of the same group (layouts that differ only in
        # ZeRO and recomputation, enumerated together)
        key = c[:6] + c[7:8] + c[9:12]  # all but ZeRO, recomputation and the shard group
        if key != group:
            group, known = key, {}
        nothing, every = known.get(("none", c.zero, c.shard)), known.get(("full", c.zero, c.shard))
        if c.recompute_layers == FEWEST_BLOCKS and nothing and every:
            lb, mem = bounds.family_time(c, nothing[0]), every[1]
        else:
            lb, mem = bounds.time(c), bounds.memory(c)
            if not c.recompute_layers:
                known[c.recompute, c.zero, c.shard] = (lb, mem)
        if mem > cap:
            rejected.add(lb, c)
        else:  # kind 0: a bound, popped before a simulated time it ties with
            heap.append((lb, 0, 0.0, c, None))
    heapq.heapify(heap)
    return n, rejected, heap


def _runs_algo(req: PlanRequest, c: Candidate) -> bool:
    """Whether ``--dp-algo`` / ``--compress`` runs on this layout (``check_layout``)."""
    try:
        req.dp_algo.check_layout(make_layout(c, req))
    except ValueError:
        return False
    return True


def _fastest_first(req: PlanRequest, heap: list, rejected: _Rejections, counts: dict):
    """Yield (closed-form seconds, layout, result) of the layouts that fit, fastest first
    (ties: least memory first), simulating a layout only when its bound comes up."""
    plain: set[Candidate] = set()  # layouts without recomputation that fit
    while heap:
        _, kind, _, c, res = heapq.heappop(heap)
        if kind == 1:
            yield res.iter_time_s, c, res
            continue
        if c.recompute_layers == FEWEST_BLOCKS:
            nothing = c._replace(recompute="none", recompute_layers=0)
            if nothing in plain:  # it fits recomputing nothing: that layout, made slower
                continue
            c, res, runs = resolve_blocks(req, c, nothing in rejected.seen)
            counts["simulated"] += runs
            if c is not None:
                _ranked(heap, rejected, c, res)
            continue
        else:
            res, runs = simulate(req.model, make_layout(c, req), req.hardware,
                                 runtime=req.runtime, exact=False, dp_algo=req.dp_algo,
                                 moe_imbalance=req.moe_imbalance), 1  # fmt: skip
        counts["simulated"] += runs
        if c.recompute == "none" and res.fits:
            plain.add(c)
        _ranked(heap, rejected, c, res)


def _ranked(heap: list, rejected: _Rejections, c: Candidate, res: Result) -> None:
    """A simulated layout onto the heap by its time (equal times: least memory first), or
    among the rejected when it does not fit."""
    if res.fits:
        tie = float(f"{res.iter_time_s:.12g}")
        heapq.heappush(heap, (tie, 1, res.peak_mem_bytes, c, res))
    else:
        rejected.add(res.iter_time_s, c, res)


class _Rejections:
    """The layouts rejected for memory; remembers the fastest few (by time or bound)."""

    def __init__(self, keep: int = 3):
        self.seen: set[Candidate] = set()
        self.keep, self.heap = keep, []  # max-heap of (-seconds, layout, result)

    def add(self, seconds: float, c: Candidate, res: Result | None = None) -> None:
        self.seen.add(c)
        item = (-seconds, c, res)
        if len(self.heap) < self.keep:
            heapq.heappush(self.heap, item)
        elif item[:2] > self.heap[0][:2]:
            heapq.heapreplace(self.heap, item)

    def fastest(self) -> list[tuple[float, Candidate, Result | None]]:
        return [(-s, c, r) for s, c, r in sorted(self.heap, key=lambda x: x[:2], reverse=True)]


def _entry(
    req: PlanRequest, c: Candidate, lay: Layout, res: Result, screen: float, replayed: bool
) -> Entry:
    days = hours = None
    if req.tokens:
        seconds = req.tokens / res.tokens_per_s
        days, hours = seconds / 86400, seconds * req.n_devices / 3600
    return Entry(c, lay, res, screen, replayed, days, hours)


def _no_layout_message(req: PlanRequest) -> str:
    cfg, n = req.model, req.n_devices
    if req.space.zero_shard_group and any(req.space.zero_shard_group):
        g = req.space.zero_shard_group[0]
        return (
            f"--zero-shard-group {g}: it divides the data-parallel ranks (dp = gpus / (tp x "
            f"pp)) of no layout of --gpus {n} with ZeRO 1-3; use a divisor of one such dp"
        )
    return (
        f"--gpus {n}: no layout of {cfg.n_layers} layers, {cfg.n_heads} heads and global batch "
        f"{req.global_batch_size} is valid (dp = gpus / (tp x pp) must divide "
        f"--global-batch-size); try a --global-batch-size that is a multiple of {n}"
    )


def _nothing_fits_message(req: PlanRequest, bounds: _Bounds) -> str:
    gib = req.hardware.memory_bytes / GiB
    least = None
    for c in candidates(req):
        mem = bounds.memory(c)
        if least is None or mem < least[0]:
            least = (mem, c)
    hint = f"; the leanest ({least[1].label()}) needs {least[0] / GiB:.1f} GiB" if least else ""
    return (
        f"no layout fits in {gib:.1f} GiB per device{hint}; use more --gpus, a smaller "
        "--global-batch-size, or a device with more memory"
    )


# -- estimates -------------------------------------------------------------------------------


def simple_estimate(model: ModelConfig, tokens: float, n: int, peak: float, days: float) -> dict:
    """Narayanan et al. 2021's estimate, time = 8 T P / (n X): the per-device throughput X
    and utilisation X / peak that ``days`` imply (8 = 6 for forward and backward + 2 for
    recomputing the forward)."""
    P = sizes.num_params(model)
    x = 8 * tokens * P / (n * days * 86400)
    return {"params": P, "tflops": x / 1e12, "utilisation": x / peak}


def chinchilla_model(
    compute_flops: float, *, arch: str, vocab_size: int, seq_len: int
) -> tuple[ModelConfig, float]:
    """The compute-optimal model for ``compute_flops`` (6 N D, D = 20 N; Hoffmann et al.
    2022) and its token count. Shape: head size 128, layers = hidden / 128 (GPT-3 175B is
    96 x 12288, LLaMA-7B 32 x 4096), hidden a multiple of 1024 from 4096 up (so tp up to 8
    divides the heads), of 256 below; the candidate closest to N in parameters wins."""
    target = math.sqrt(compute_flops / (6 * TOKENS_PER_PARAM))
    best = None
    for hidden in list(range(256, 4096, 256)) + list(range(4096, 65537, 1024)):
        head = 128 if hidden >= 2048 else 64
        cfg = ModelConfig(
            arch=arch, n_layers=max(2, round(hidden / 128)), hidden=hidden,
            n_heads=hidden // head, vocab_size=vocab_size, seq_len=seq_len,
        )  # fmt: skip
        gap = abs(math.log(sizes.num_params(cfg) / target))
        if best is None or gap < best[0]:
            best = (gap, cfg)
    cfg = best[1]
    return cfg, TOKENS_PER_PARAM * sizes.num_params(cfg)
