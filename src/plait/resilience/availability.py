"""Training throughput under failures, modelled for a large run: plait's in-place recovery
against checkpoint-and-restart and against redundant computation (Bamboo, Thorpe et al.
2023) -- the comparison the Oobleck paper (Jang et al. 2023) draws -- with step times,
stage times, memory and the throughput of every template combination from the simulator.

Communication: none (a model).

Failures arrive at rate lambda = 1 / MTBF for the whole cluster; each takes out one node
(``tp`` devices, one pipeline stage). For each strategy, the useful fraction of the
failure-free throughput X (tokens/s of the base layout):

- **checkpoint and restart**: every tau seconds the run stops for C (the state, 12 bytes
  a parameter -- fp32 weights and AdamW's two moments -- over the storage bandwidth);
  each failure loses on average tau / 2 of work plus R (restart: reschedule, start,
  communicators) plus the load (C again). tau is Young's optimum sqrt(2 C / lambda);
  fraction = 1 - C / tau - lambda (tau / 2 + R + C), floored at 0 (first order, Daly 2006).
- **in-place (plait, Oobleck)**: each failure stalls everyone for detection + new
  communicators + the state copy (one stage's state, 12 bytes a parameter of it, over one
  device's link) + half a step (the step in flight is redone), and once more (new
  communicators + copy) when the replacement joins after the repair time M. Meanwhile
  lambda M nodes are missing on average (Little's law) and the survivors run the best
  template combination for what is left: capacity X(N - lambda M) / X(N), interpolated
  between whole node counts, from ``templates.choose`` over simulated templates.
- **redundant computation (Bamboo)**: every stage also runs its successor's forward, so
  that the successor's failure needs no copy: the step grows by m stage forwards beyond
  what the pipeline bubble hides, and each device holds two stages' model state (when that
  does not fit, the base layout takes twice the stages). A failure stalls for detection
  + new communicators; until the repair the predecessor runs two stages, which makes its
  pipeline -- and, since replicas synchronise every step, the whole run -- slower by m
  stage times while any node is missing (probability 1 - exp(-lambda M)).

What is left out, for all three alike: two failures close enough to overlap (rare below
one failure a minute), the planning time (milliseconds), stragglers, and network
congestion during copies. ``Assumptions`` holds every constant with its default's reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.model.sizes import num_params
from plait.resilience.templates import build_templates, choose

STATE_BYTES = 12  # per parameter in a checkpoint / state copy: fp32 weight + AdamW's m, v


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    storage_gbs: float = 100.0  # GB/s to and from the checkpoint store, whole cluster
    restart_s: float = 600.0  # restart without the load: scheduler, processes, NCCL, warm-up
    detect_s: float = 2.0  # a crash seen by its peers (a communication error) and reported
    reform_s: float = 20.0  # new communicators for every group at this scale
    link_gbs: float = 50.0  # GB/s into one device for the state copy (400 Gb/s)
    repair_s: float = 1800.0  # until a replacement node joins
    fault_tolerance: int = 1  # F of the in-place strategy (pipelines kept >= F + 1)


@dataclass(frozen=True)
class Point:
    mtbf_s: float
    checkpoint: float  # fraction of the failure-free throughput
    in_place: float
    redundant: float


class Model:
    """The three strategies for one model, layout and hardware (module docstring)."""

    def __init__(self, model: ModelConfig, layout: Layout, hw, a: Assumptions = Assumptions()):
        from plait.sim import simulate
        from plait.sim.costs import layer_cost
        from plait.sim.runtime import get_runtime

        self.model, self.layout, self.hw, self.a = model, layout, hw, a
        base = simulate(model, layout, hw, exact=False)
        self.step_s, self.tokens_per_s = base.iter_time_s, base.tokens_per_s
        self.nodes = layout.dp * layout.pp  # one node = one stage of tp devices
        params = num_params(model)
        self.checkpoint_s = STATE_BYTES * params / (a.storage_gbs * 1e9)
        self.copy_s = STATE_BYTES * params / (layout.tp * layout.pp) / (a.link_gbs * 1e9)
        # in-place: the best template combination for every node count
        rows = layout.global_batch_size // layout.dp
        self.templates = {
            s: t
            for s, t in build_templates(
                model, layout, hw, max_nodes=self.nodes // (a.fault_tolerance + 1), rows=rows
            ).items()
            if t.fits
        }
        self._capacity: dict[int, float] = {}
        # redundant computation: a successor's forward per micro-batch, and its memory
        lc = layer_cost(model, layout, hw, get_runtime("plait"))
        m = layout.num_microbatches
        rc_layout, rc = layout, base
        mem = base.memory
        if base.peak_mem_bytes + mem.weights + mem.grads + mem.optimizer > base.mem_capacity_bytes:
            rc_layout = layout.replace(pp=2 * layout.pp, dp=layout.dp // 2)
            rc = simulate(model, rc_layout, hw, exact=False)
        stage_layers = model.n_layers / rc_layout.pp
        forward = m * stage_layers * lc.fwd
        re = lc.recompute * layout.recomputed_share(model.n_layers)  # --recompute-layers
        stage = m * stage_layers * (lc.fwd + lc.bwd_input + lc.bwd_weight + re)
        hidden = rc.breakdown.get("bubble", 0.0)
        self.rc_step_s = rc.iter_time_s + max(0.0, forward - hidden)
        self.rc_degraded_s = stage  # one node running two stages: its pipeline's extra time
        self.rc_layout = rc_layout

    def capacity(self, missing: float) -> float:
        """Throughput with ``missing`` nodes gone, as a fraction of all nodes' (templates)."""
        lo = math.floor(missing)
        frac = missing - lo
        return (1 - frac) * self._thr(self.nodes - lo) + frac * self._thr(self.nodes - lo - 1)

    def _thr(self, n: int) -> float:
        if n not in self._capacity:
            sizes = choose(n, self.templates, min_pipelines=self.a.fault_tolerance + 1,
                           max_pipelines=self.layout.global_batch_size)  # fmt: skip
            full = choose(self.nodes, self.templates, min_pipelines=self.a.fault_tolerance + 1,
                          max_pipelines=self.layout.global_batch_size)  # fmt: skip
            thr = sum(self.templates[s].throughput for s in sizes or ())
            self._capacity[n] = thr / sum(self.templates[s].throughput for s in full)
        return self._capacity[n]

    def point(self, mtbf_s: float) -> Point:
        a, lam, T = self.a, 1.0 / mtbf_s, self.step_s
        C = self.checkpoint_s
        tau = math.sqrt(2 * C / lam)
        checkpoint = max(0.0, 1 - C / tau - lam * (tau / 2 + a.restart_s + C))
        stall = a.detect_s + a.reform_s + self.copy_s + T / 2 + a.reform_s + self.copy_s
        in_place = max(0.0, 1 - lam * stall) * self.capacity(lam * a.repair_s)
        p_missing = 1 - math.exp(-lam * a.repair_s)
        rc_step = self.rc_step_s + p_missing * self.rc_degraded_s
        redundant = max(0.0, 1 - lam * (a.detect_s + a.reform_s)) * T / rc_step
        return Point(mtbf_s, checkpoint, in_place, redundant)
