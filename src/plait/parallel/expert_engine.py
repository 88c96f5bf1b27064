"""The trainer under ``--ep n`` (issue 28): the expert-parallel groups and the gradient
engine pair (``expert.py`` moves the tokens).

Gradients and optimizer (``ExpertDataParallel``, ``--ep n`` in the trainer): the ep
groups are carved out of dp -- blocks of n consecutive dp ranks (``ep_groups``, which
reuses ``Topology.shard_groups``) -- and the ranks holding the same place in every block
form the expert-data-parallel group (edp, dp / n ranks: they hold the same experts).
Worked example, dp 4, ep 2 (tp 1): ep groups [0,1] [2,3], edp groups [0,2] [1,3]; rank 2
holds experts [0, E/2) with rank 0. The dense parameters' gradients are reduced over dp as
without ep (4 N_dense bytes per step, ``data_parallel.py`` / ``zero.py``), the experts'
over edp only (4 N_expert / n bytes: each rank holds 1/n of them). Both engines' bucket
collectives are issued by autograd hooks in backward order -- the same order on every
rank, on two groups -- and ``finish``, ``step`` run the dense engine's first, then the
experts'.

ZeRO-3 (``--ep n --zero 3``): each engine shards its own parameters over its own group --
the dense ones over dp (x cp), d = dp ranks, the experts over edp, d = dp / n -- and
gathers them in its own units (``zero_units.py``), built on the same modules: per MoE
block a dense unit (attention, norms, router, shared experts) and an expert unit (this
rank's E/n experts' stacked weights); the embedding and head are dense only. Per step:
8m N_dense bytes gathered over dp and 8m N_expert / n over edp (m micro-batches), and the
units' gradient reduce-scatters, 4 N_dense and 4 N_expert / n. With ep == dp the edp
group is one rank: nothing is issued on edp, the experts' optimizer state is whole, and
in fp32 runs the experts' parameters live in their units' rows (``Unit.resident``: never
gathered, copied or freed); under bf16 / fp16 a unit is "gathered" by a local cast, so
the experts carry the wire's rounding as at ep < dp.

Communication: none of its own -- the two engines' (``data_parallel.py``, ``zero.py``,
``zero_units.py``), in the order below.

Why it cannot deadlock under NCCL's rules. Each rank issues its collectives on three
groups -- dp (dense), edp (experts) and ep (the dispatch, ``expert.py``) -- from the
thread that runs the model, and every rank issues the same sequence of them: the dense
engine is built first, so on every module its hooks were registered first and fire
first. In a MoE block's forward: the dense unit's gather (dp) and its prefetch of the
next dense unit, then the expert unit's gather (edp), then the block's all-to-alls (ep);
in its backward (hooks on the block's output, in registration order) the dense unit's
gather, then the expert unit's, then the dispatch's all-to-alls; each unit's gradient
reduce-scatter when its last gradient arrives (autograd orders a backward
deterministically, the same graph on every rank: an expert with no tokens still takes
part); ``finish`` launches what is left, dense engine first. So the k-th collective a rank
issues is the k-th of the same kind on every rank, and each group's members meet its
collectives in the same order: a collective waits only for earlier ones of its peers,
never for a later one, and no cycle of waits can form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from plait.parallel.data_parallel import DataParallelConfig, model_chunks
from plait.parallel.engine import build_data_parallel
from plait.parallel.held import Held
from plait.topology import Axis, Topology


def ep_groups(topo: Topology, ep: int) -> tuple[Topology, Topology]:
    """(ep, edp): topologies whose dp axis is this rank's ep group (``ep`` consecutive dp
    ranks) and its expert-data-parallel group (the dp / ep ranks at the same place in
    every block; module docstring). Collective over the world (``shard_groups``): every
    rank calls it, in the same order."""
    ep_topo, edp_topo = topo.shard_groups(ep)
    if edp_topo is None:  # ep == dp: every rank holds experts no other rank holds
        edp_topo = Topology(
            rank=topo.rank, place=(0, 0, 0), device=topo.device, stats=topo.stats,
            group_ranks={a: [topo.rank] for a in Axis}, world_group=topo.world_group,
            timeout=topo.timeout,
        )  # fmt: skip
    return ep_topo, edp_topo


def is_expert(p: torch.Tensor) -> bool:
    """A parameter one ep rank holds a share of (``Experts``' stacked weights under ep)."""
    return getattr(p, "expert_shard", None) is not None


class ParamSubset(nn.Module):
    """``module`` as an engine sees it when it owns only the parameters ``keep`` selects:
    ``named_parameters`` / ``parameters`` filtered, under their own names (= checkpoint
    keys), and its pipeline chunks as subsets too (buckets are cut per chunk). ZeRO-3
    builds its units on ``whole``'s modules, of this subset's parameters
    (``zero_units.structure``)."""

    def __init__(self, module: nn.Module, keep: Callable[[torch.Tensor], bool]):
        super().__init__()
        object.__setattr__(self, "_inner", module)  # not a child: its parameters are filtered
        object.__setattr__(self, "_keep", keep)
        chunks = model_chunks(module)
        self.chunks = [self] if chunks == [module] else [ParamSubset(c, keep) for c in chunks]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):  # fmt: skip
        for name, p in self._inner.named_parameters(prefix, recurse, remove_duplicate):
            if self._keep(p):
                yield name, p

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    @property
    def whole(self) -> nn.Module:
        """The module this subset filters (its blocks, embedding: where hooks go)."""
        return self._inner


class ExpertDataParallel:
    """The trainer's engine under ``--ep``: the dense parameters' engine over dp (x cp) and
    the experts' over edp, each ``build_data_parallel``'s for the run's ZeRO stage (0-3;
    stage 3: module docstring), behind one ``engine.GradientEngine``. The dense engine is
    built first: its hooks fire first (the order the module docstring relies on). Each
    shards its state over its own group; the global |g|^2 is the sum of the two engines' shares (each counts its tensors once).
    ``held_state`` is the union, the experts' placed at their rows of the (E, ...) tensor
    (``Held.rows``), so checkpoints are global-shaped and reshard across ep changes. A
    pipeline stage without MoE layers holds no expert parameters and builds no expert
    engine (it issues nothing on edp)."""

    def __init__(self, model: nn.Module, *, topo: Topology, edp_topo: Topology,
                 cfg: DataParallelConfig, make_optimizer: Callable, owns_grad=None, defer=(),
                 compression=None):  # fmt: skip
        if compression is not None:
            raise ValueError("--ep runs with the plain all-reduce")
        common = dict(make_optimizer=make_optimizer, owns_grad=owns_grad, defer=defer)
        self.dense = build_data_parallel(ParamSubset(model, lambda p: not is_expert(p)),
                                         topo=topo, cfg=cfg, **common)  # fmt: skip
        experts = ParamSubset(model, is_expert)
        self.rows = {name: (p.expert_shard[1], p.expert_shard[0], tuple(p.shape))
                     for name, p in experts.named_parameters()}  # fmt: skip
        self.experts = None
        if self.rows:  # HSDP's shard groups cut dp: experts shard over the whole edp group
            self.experts = build_data_parallel(
                experts, topo=edp_topo, cfg=dataclasses.replace(cfg, shard_group=None), **common
            )
        self.engines = [e for e in (self.dense, self.experts) if e is not None]

    def finish(self) -> None:
        for e in self.engines:
            e.finish()

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        return (self.experts if is_expert(p) else self.dense).grad(p)

    def grad_sq_local(self) -> torch.Tensor | float:
        return sum((e.grad_sq_local() for e in self.engines), 0.0)

    def scale_grads_(self, factor: float) -> None:
        for e in self.engines:
            e.scale_grads_(factor)

    def step(self, lr: float) -> None:
        for e in self.engines:
            e.step(lr)

    def zero_grad(self) -> None:
        for e in self.engines:
            e.zero_grad()

    def held_state(self) -> dict[str, Held]:
        out = dict(self.dense.held_state())
        if self.experts is not None:
            for key, held in self.experts.held_state().items():
                first, total, shape = self.rows[key.split("/")[1]]
                if held.shape == shape:  # not a scalar (AdamW's step): rows of (E, ...)
                    held = dataclasses.replace(held, rows=(first, total))
                out[key] = held
        return out

    def state_loaded(self) -> None:
        for e in self.engines:
            e.state_loaded()

    def model_state_bytes(self) -> dict[str, int]:
        parts = [e.model_state_bytes() for e in self.engines]
        return {k: sum(p[k] for p in parts) for k in parts[0]}

    def close(self) -> None:
        for e in self.engines:
            e.close()
