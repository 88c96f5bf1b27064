"""The parts one training step is made of, as ``simulate`` adds them up.

Each function here is one term of the step (``simulate.py``'s docstring has the whole
timeline) for one device: a layer's micro-batch with its exposed tensor-parallel and
ZeRO-3 communication, the messages between pipeline stages, the tied embedding's
gradient exchange, the loss / gradient-norm all-reduce, and how much of a weight
all-gather the next step's first forward hides. ``simulate`` composes them over the
schedule; the planner's lower bounds (``plan.py``) compose the same functions over the
busiest rank, so a bound can never disagree with the simulator about what a term costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.sim import collectives, costs
from plait.sim import expert as ep_sim
from plait.sim.hardware import Hardware
from plait.sim.memory import stage_params
from plait.sim.runtime import Runtime


@dataclass(frozen=True)
class LayerStep:
    """One layer and micro-batch on one device: ``costs.LayerCost`` plus the exposed part
    of ZeRO-3's gathers and reduce-scatter (``zero3_fwd``, ``zero3_bwd``)."""

    cost: costs.LayerCost
    zero3_fwd: float
    zero3_bwd: float

    @property
    def fwd(self) -> float:
        """F: compute, exposed tp collectives, cp exchanges and expert dispatch, exposed
        ZeRO-3 gather."""
        c = self.cost
        return c.fwd + c.fwd_tp + c.fwd_cp + c.fwd_ep + self.zero3_fwd

    @property
    def bwd_input(self) -> float:
        """BI: input gradients, recomputation, their tp collectives, cp exchanges and expert
        dispatch, exposed ZeRO-3."""
        c = self.cost
        return (c.bwd_input + c.recompute + c.bwd_tp + c.recompute_tp + c.bwd_cp + c.bwd_ep
                + self.zero3_bwd)  # fmt: skip

    @property
    def bwd_weight(self) -> float:
        return self.cost.bwd_weight

    @property
    def bwd(self) -> float:
        return self.bwd_input + self.bwd_weight

    @property
    def parts(self) -> tuple[float, float, float, float, float]:
        """(compute, exposed tp, exposed ZeRO-3, exposed cp, exposed ep) seconds of F + B
        together."""
        c = self.cost
        compute = c.fwd + c.bwd_input + c.recompute + c.bwd_weight
        return (compute, c.fwd_tp + c.bwd_tp + c.recompute_tp, self.zero3_fwd + self.zero3_bwd,
                c.fwd_cp + c.bwd_cp, c.fwd_ep + c.bwd_ep)  # fmt: skip


def layer_step(
    model: ModelConfig, layout: Layout, hw: Hardware, rt: Runtime, moe: bool = False
) -> LayerStep:
    """A layer's micro-batch with ZeRO-3's traffic (``costs.zero_layer_comm``), hidden
    behind the layer's own compute where the runtime prefetches the gathers. ``moe``: a
    MoE block (``sim/expert.py``), whose routed experts ZeRO-3 gathers over their edp
    group."""
    lc = costs.layer_cost(model, layout, hw, rt, moe=moe)
    dense = stage_params(model, layout, 1, False, False, moe_layers=int(moe))
    z3_fwd, z3_bwd = costs.zero_layer_comm(model, dense, layout, hw, rt)
    if moe:
        ef, eb = costs.zero_layer_comm(model, ep_sim.expert_params(model, layout), layout, hw,
                                        rt, experts=True)  # fmt: skip
        z3_fwd, z3_bwd = z3_fwd + ef, z3_bwd + eb
    if rt.overlap_param_gather:  # what outlasts the compute, and what slows it
        z3_fwd = collectives.hidden_behind(z3_fwd, lc.fwd, hw)
        z3_bwd = collectives.hidden_behind(z3_bwd, lc.bwd_input + lc.bwd_weight + lc.recompute,
                                           hw)  # fmt: skip
    return LayerStep(lc, z3_fwd, z3_bwd)


def stage_messages(
    model: ModelConfig, layout: Layout, hw: Hardware
) -> tuple[tuple[float, float], ...]:
    """Per pipeline rank: seconds of an activation sent to the next stage and of a
    gradient sent to the previous one (``costs.pp_message_time`` on the link between
    them; the ring wraps around for interleaved chunks)."""
    p = layout.pp
    return tuple(
        tuple(
            costs.pp_message_time(model, layout, hw, costs.pp_boundary_link(hw, layout, r, peer))
            for peer in ((r + 1) % p, (r - 1) % p)
        )
        for r in range(p)
    )


def tied_sync(model: ModelConfig, layout: Layout, hw: Hardware, rt: Runtime) -> float:
    """The first and last stages' all-reduce of a tied embedding's gradient copies."""
    p = layout.pp
    if not model.tied_embeddings or p == 1:
        return 0.0
    nbytes = model.vocab_size * model.hidden / layout.tp * rt.grad_comm_bytes(layout.dtype)
    return collectives.all_reduce_time(nbytes, 2, costs.pp_boundary_link(hw, layout, 0, p - 1))


def stats_bytes(layout: Layout, model: ModelConfig | None = None, replicas: int = 1) -> int:
    """The step's statistics vector (``Trainer._reduce_stats``): loss, bubble, a |g|^2 for
    each of ``replicas`` (1, or every replica where they differ: ``--dp-algo``), every
    rank's peak memory and the allocator's retries, 8 bytes each: 8 (3 + R + W); with a
    MoE ``model`` its routing table too (``moe.stats_table``: L (E + 4) more)."""
    table = model.n_layers * (model.moe_experts + 4) if model is not None and model.moe else 0
    return 8 * (3 + replicas + layout.world_size + table)


def stats_time(layout: Layout, hw: Hardware) -> float:
    """The step's statistics (``stats_bytes``) all-reduced over every rank: a sync point
    before the optimizer step."""
    world = layout.world_size
    if world == 1:
        return 0.0
    return collectives.all_reduce_time(stats_bytes(layout), world,
                                       collectives.group_link(hw, world, 1))  # fmt: skip


def exposed_weight_gather(seconds, first_forward, rt: Runtime, hw: Hardware):
    """The part of the ZeRO-1/2 weight all-gather the step waits for: all of it, or where
    the runtime overlaps it with the next step's first forward what outlasts that forward
    and what it slows (``collectives.hidden_behind``). Floats, or arrays of them (the
    planner's pipeline ranks at once)."""
    if rt.overlap_param_gather:
        return collectives.hidden_behind(seconds, first_forward, hw)
    return seconds
