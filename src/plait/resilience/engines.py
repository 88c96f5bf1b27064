"""Gradient synchronisation across pipelines that may differ (a resilient run's engine):
every unit of the model (the embedding, each block, the head) is summed over the ranks
that hold it, one per pipeline, whatever stage it sits on in each.

Communication (axis dp, counted on this rank's topology; N_u = parameters of unit u,
4-byte gradients): after the step's backward, in ``finish()``, one all-reduce per replica
group this rank belongs to -- a group is the set of holders of one or more units; it
reduces the concatenated gradients of those units, 4 x sum N_u bytes. With tied
embeddings and a pipeline of two or more stages, the last stages' copies of the token
embedding form a group of their own (``tied``; a one-stage pipeline takes part in both
groups with its whole gradient and keeps the ``embed`` result). In a dp x pp grid this is
exactly the dp all-reduce of each stage. Nothing in the forward or the optimizer step.

Why it cannot deadlock under NCCL: the replica groups are ordered once, the same way on
every rank (by their member list, ``generation.replica_groups``), and every rank issues
the all-reduces of the groups it belongs to in that order -- a subsequence of one global
order, so no two ranks wait on each other's later collective. They are issued
asynchronously from the training thread and waited on all together; no hooks, no
threads. (Overlap with the backward, as ``data_parallel.py`` has, is left out: this
engine is an experiment at the edge, STYLE rule 11.)

The gradient norm counts each unit once: on the holder in the first pipeline (with tp
groups, each tp rank its shard of it, a weight replicated over the tp group on tp rank 0:
``optim.owns_grad``). With tp groups (``--tp T``) a unit's replica group is per tp rank --
the holders of ``u@r``, tp rank r of every pipeline holding it (``generation.py``) -- so
each all-reduce above moves that shard, 4 x N_u / T bytes, after the trainer's own tp
reductions (``TPGradSync``), in the same global order.

ZeRO inside a replica (``ShardedReplicaEngine``; ``assignment.py``: replicas of K pipelines, each
stage sharded over its K workers, the j-th pipeline holding shard j of every parameter). Per step,
on top of the above with shards in place of whole gradients: the ZeRO engine of
``zero.py`` on the stage group (stage 2: a reduce-scatter per bucket from autograd's
hooks as the last micro-batch's backward completes it; stage 1: the bucketed all-reduce;
stage 3: parameters sharded too, each unit -- a block, the embedding, the head --
all-gathered over the stage group before its forward and again before its backward,
``zero_units.py``, and reduce-scattered as in stage 2), 4 x N_stage bytes; then in ``finish()`` one all-reduce per replica group of the shards
(the holders of ``u/j``: pipeline j of every replica), 4 x sum N_u / K bytes; after the
update, one all-gather per bucket over the stage group, 4 x N_stage bytes (stage 3:
none, the next forward gathers from the updated shards). AdamW's
moments live in shards only: 8 x N_stage / K bytes per worker instead of 8 x N_stage.
Under NCCL: a stage group's collectives are issued by its K ranks in the same bucket
order (the same stage, model and schedule: ``zero.py``'s argument), all of them before
any replica all-reduce of the step, and the replica all-reduces follow the one global
order above; the step's gathers come after the world's statistics all-reduce on every
rank. A closed engine (its generation dropped) updates its shards only, issuing nothing:
that is what recovery's roll-forward needs, and the next generation gathers the
parameters of each stage from the shards (``materialize``) once its state is copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.parallel.data_parallel import adamw_zero_state, sq_sum, tensor_bytes, whole_state
from plait.parallel.engine import GradientEngine
from plait.parallel.flat import FlatLayout
from plait.parallel.held import Held
from plait.parallel.zero import ZeroDataParallel
from plait.resilience.assignment import base_unit, unit_of, with_shard, with_tp
from plait.resilience.generation import Generation, unit_order
from plait.topology import Axis


def stage_unit_of(name: str, held: frozenset[str]) -> str:
    """The unit of parameter ``name`` on a stage holding ``held`` (its token embedding is
    the tied copy when the stage does not hold the embedding)."""
    if name == "embed.tokens.weight" and "embed" not in held:
        return "tied"
    return unit_of(name)


class ReplicaSync:
    """One replica group's reduction on this rank: the parameters it reduces there and
    whether this rank keeps the result (not for a one-stage pipeline's tied copy).
    ``shard(p)``: the tensor reduced for ``p`` in place (ZeRO: this rank's shard of its
    gradient); None: ``p.grad``, whole."""

    def __init__(self, topo, params: list[nn.Parameter], keep: list[bool], shard=None):
        self.topo, self.params, self.keep, self.shard = topo, params, keep, shard
        self.flat: torch.Tensor | None = None
        self.layout: FlatLayout | None = None  # of this step's tensors
        self.handle = None

    def _tensors(self) -> list[torch.Tensor | None]:
        if self.shard is not None:
            return [self.shard(p) for p in self.params]
        return [p.grad for p in self.params]  # None: zeros

    def launch(self) -> None:
        tensors = self._tensors()
        self.layout = FlatLayout.of(self.params if self.shard is None else tensors)
        self.flat = self.layout.pack(tensors, like=self.params[0])
        self.handle = comm.all_reduce(self.flat, topo=self.topo, axis=Axis.DP, async_op=True)

    def complete(self) -> None:
        comm.wait([self.handle], topo=self.topo, what="all_reduce", axis="dp")
        views = self.layout.views(self.flat)
        for p, t, view, keep in zip(self.params, self._tensors(), views, self.keep):
            if keep and self.shard is not None:
                t.view(-1).copy_(view)
            elif keep:  # the gradient lives in the buffer from now on (no copy)
                p.grad = view.view_as(p)
        self.flat = self.handle = self.layout = None


def replica_syncs(gen: Generation, named, *, shard=None) -> list[ReplicaSync]:
    """This rank's replica reductions, in the global order (module docstring): its
    parameters grouped by the ranks that hold the same unit (``shard``: the same shard of
    it, in pipeline ``assignment.shard_index`` of every replica)."""
    assignment, me = gen.assignment, gen.worker
    shard_index = assignment.shard_index(assignment.place(me)[0])
    tp_rank = assignment.tp_rank(me) if assignment.tp > 1 else None
    held = frozenset(base_unit(u) for u in assignment.units_of(me))

    def ranks_of(unit: str):
        return gen.units.get(next(iter(with_shard(with_tp({unit}, tp_rank), shard_index))))

    entries: dict[tuple[int, ...], list] = {}
    tied = ranks_of("tied")
    for n, p in named:
        u = stage_unit_of(n, held)
        entries.setdefault(ranks_of(u), []).append((unit_order(u, assignment.n_layers), n, p, True))
        if u == "embed" and tied is not None and gen.rank in tied:
            if "tied" not in held and n == "embed.tokens.weight":  # one-stage pipeline
                entries.setdefault(tied, []).append(
                    (unit_order("tied", assignment.n_layers), n, p, False)
                )
    index = {n: i for i, (n, _) in enumerate(named)}
    syncs = []
    for ranks in sorted(entries):  # the global order (module docstring)
        if len(ranks) < 2:
            continue
        items = sorted(entries[ranks], key=lambda e: (e[0], index[e[1]]))
        syncs.append(
            ReplicaSync(
                gen.replica_topology(ranks), [e[2] for e in items], [e[3] for e in items], shard
            )
        )
    return syncs


class ReplicaEngine:
    """The trainer's engine interface (``engine.GradientEngine``) over a generation's
    replica groups.
    Build it through ``factory(generation)``, which ``Trainer.build`` calls as it calls
    ``build_data_parallel``."""

    zero = 0

    def __init__(self, model: nn.Module, *, gen: Generation, make_optimizer: Callable,
                 owns_grad=None, **_):  # fmt: skip
        self.model, self.topo = model, gen.topo
        assignment, me = gen.assignment, gen.worker
        held = frozenset(base_unit(u) for u in assignment.units_of(me))
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        first_pipeline = gen.assignment.pipelines[0].workers
        units = {n: stage_unit_of(n, held) for n, _ in self.named}
        # this rank counts a unit in |g|^2 when it holds it in the first pipeline (with tp,
        # a weight replicated over its tp group on tp rank 0 only: ``optim.owns_grad``)
        self.counted = [p for n, p in self.named if units[n] != "tied" and me in first_pipeline
                        and (owns_grad is None or owns_grad(p))]  # fmt: skip
        self.syncs = replica_syncs(gen, self.named)
        self.optimizer = make_optimizer([(n, p, p) for n, p in self.named])
        self.reduced = False  # finish() completed for the current gradients
        self.grad_bytes = 0

    # the interface (``engine.GradientEngine``)

    def finish(self) -> None:
        self._reduce_replicas()
        self.grad_bytes = tensor_bytes(p.grad for _, p in self.named if p.grad is not None)
        self.reduced = True

    def _reduce_replicas(self) -> None:
        for s in self.syncs:
            s.launch()
        for s in self.syncs:
            s.complete()

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        return p.grad

    def grad_sq_local(self) -> torch.Tensor | float:
        return sq_sum(p.grad for p in self.counted if p.grad is not None)

    def scale_grads_(self, factor: float) -> None:
        grads = [p.grad for _, p in self.named if p.grad is not None]
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None
        self.reduced = False

    def _optim_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's live state per parameter name (created as zeros where not stepped yet)."""
        state = self.optimizer.state
        for _, p in self.named:
            if not state.get(p):
                state[p] = adamw_zero_state(p, self.optimizer)
        return {n: state[p] for n, p in self.named}

    def held_state(self) -> dict[str, Held]:
        """Every parameter and its AdamW state whole, as live tensors."""
        return whole_state(self.model, self._optim_state())

    def state_loaded(self) -> None:
        """Nothing to do: ``held_state`` handed out the live tensors."""

    def model_state_bytes(self) -> dict[str, int]:
        params = tensor_bytes(p for _, p in self.named)
        states = [t for s in self.optimizer.state.values() for t in s.values()]
        out = {"params": params, "grads": self.grad_bytes, "optim": tensor_bytes(states)}
        out["total"] = sum(out.values())
        out["host"] = 0
        return out

    def close(self) -> None:
        for s in self.syncs:
            s.flat = s.handle = None

    # what the state copy needs (``transfer.py``), without communication

    def unit_tensors(self, names: list[str]) -> list[torch.Tensor]:
        """The live tensors of the parameters ``names``, each followed by its AdamW
        moments: what a unit's copy moves."""
        state, params = self._optim_state(), dict(self.named)
        return [t for n in names for t in (params[n].data, *(state[n][k] for k in MOMENTS))]

    def adam_step(self) -> float:
        steps = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        return float(steps[0]) if steps else 0.0

    def set_adam_step(self, step: float) -> None:
        for s in self._optim_state().values():
            s["step"].fill_(step)

    def materialize(self) -> None:
        """Nothing: every worker holds its units whole."""


MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedReplicaEngine(ReplicaEngine):
    """ZeRO stage 1, 2 or 3 inside a replica (module docstring): ``zero.py``'s engine on
    the stage group, the replica reductions on its shards."""

    def __init__(self, model: nn.Module, *, gen: Generation, make_optimizer: Callable, cfg,
                 owns_grad=None, defer=()):  # fmt: skip
        self.model, self.topo, self.zero = model, gen.topo, cfg.zero
        assignment, me = gen.assignment, gen.worker
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.inner = ZeroDataParallel(
            model, topo=gen.stage_topology(), make_optimizer=make_optimizer,
            cfg=dataclasses.replace(cfg, shard_group=None), owns_grad=owns_grad, defer=defer,
        )  # fmt: skip
        held = frozenset(base_unit(u) for u in assignment.units_of(me))
        first_replica = {
            w for p in assignment.pipelines[: assignment.shard_group] for w in p.workers
        }
        self.counted = [
            p for n, p in self.named if stage_unit_of(n, held) != "tied" and me in first_replica
        ]
        self.syncs = replica_syncs(gen, self.named, shard=self.inner.grad)
        self.reduced = False
        self.closed = False
        self.grad_bytes = 0

    def finish(self) -> None:
        self.inner.finish()
        self._reduce_replicas()  # on the shards
        self.grad_bytes = self.inner.grads.grad_bytes
        self.reduced = True

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.inner.grad(p)

    def grad_sq_local(self) -> torch.Tensor | float:
        return sq_sum(self.inner.grad(p) for p in self.counted)

    def scale_grads_(self, factor: float) -> None:
        self.inner.scale_grads_(factor)

    def step(self, lr: float) -> None:
        self.inner.update_shards(lr)
        # a closed engine issues nothing (module docstring); ZeRO-3 gathers each unit's
        # parameters in the next forward, from the shards just updated
        if not self.closed and self.zero != 3:
            self.inner.gather_params()

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self.reduced = False

    def held_state(self) -> dict:
        """This worker's shards of the parameters and their AdamW state (``zero.py``)."""
        return self.inner.held_state()

    def state_loaded(self) -> None:
        """The parameters re-gathered over the stage group (collective)."""
        self.inner.state_loaded()

    def model_state_bytes(self) -> dict[str, int]:
        return self.inner.model_state_bytes()

    def close(self) -> None:
        super().close()
        self.inner.close()
        self.closed = True

    def unit_tensors(self, names: list[str]) -> list[torch.Tensor]:
        """This worker's shards of the parameters ``names`` (views into them) and of their
        moments."""
        params, opt = dict(self.named), self.inner.optimizer
        return [
            t
            for n in names
            for t in (opt.shards[params[n]], *(opt.state(params[n])[k] for k in MOMENTS))
        ]

    def adam_step(self) -> float:
        return float(self.inner.optimizer.state(self.named[0][1])["step"]) if self.named else 0.0

    def set_adam_step(self, step: float) -> None:
        for _, p in self.named:
            self.inner.optimizer.state(p)["step"].fill_(step)

    def materialize(self) -> None:
        """Whole parameters from the stage group's shards: one all-gather per bucket
        (ZeRO-3: nothing; the forward gathers each unit from the shards copied in)."""
        if self.zero != 3:
            self.inner.gather_params()


def factory(gen: Generation, *, zero: int = 0) -> Callable[..., GradientEngine]:
    """What ``Part.make_engine`` is: ``build_data_parallel``'s signature, this engine (or
    the sharded one, ZeRO stage ``zero``, when the assignment shards)."""

    def make(model, *, topo, cfg, make_optimizer, owns_grad=None, defer=()) -> GradientEngine:
        assert topo is gen.topo, "the engine runs on the generation's topology"
        if gen.assignment.shard_group > 1:
            return ShardedReplicaEngine(
                model, gen=gen, make_optimizer=make_optimizer,
                cfg=dataclasses.replace(cfg, zero=zero), owns_grad=owns_grad, defer=defer,
            )  # fmt: skip
        return ReplicaEngine(model, gen=gen, make_optimizer=make_optimizer, owns_grad=owns_grad)

    return make
