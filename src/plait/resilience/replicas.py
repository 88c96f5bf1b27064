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

The gradient norm counts each unit once: on the holder in the first pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.parallel.data_parallel import adamw_zero_state, sq_sum, tensor_bytes
from plait.resilience.generation import Generation, unit_order
from plait.resilience.plan import unit_of
from plait.topology import Axis


def stage_unit_of(name: str, held: frozenset[str]) -> str:
    """The unit of parameter ``name`` on a stage holding ``held`` (its token embedding is
    the tied copy when the stage does not hold the embedding)."""
    if name == "embed.tokens.weight" and "embed" not in held:
        return "tied"
    return unit_of(name)


class ReplicaSync:
    """One replica group's reduction on this rank: the parameters it reduces there and
    whether this rank keeps the result (not for a one-stage pipeline's tied copy)."""

    def __init__(self, topo, params: list[nn.Parameter], keep: list[bool]):
        self.topo, self.params, self.keep = topo, params, keep
        self.flat: torch.Tensor | None = None
        self.handle = None

    def launch(self) -> None:
        self.flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in self.params
            ]
        )
        self.handle = comm.all_reduce(self.flat, topo=self.topo, axis=Axis.DP, async_op=True)

    def complete(self) -> None:
        comm.wait([self.handle], topo=self.topo, what="all_reduce", axis="dp")
        offset = 0
        for p, keep in zip(self.params, self.keep):
            n = p.numel()
            if keep:
                p.grad = self.flat[offset : offset + n].view_as(p)
            offset += n
        self.flat = self.handle = None


class ReplicaEngine:
    """The engine interface (``parallel/engine.py``) over a generation's replica groups.
    Build it through ``factory(generation)``, which ``Trainer.build`` calls as it calls
    ``build_data_parallel``."""

    zero = 0

    def __init__(self, model: nn.Module, *, gen: Generation, make_optimizer: Callable, **_):
        self.model, self.topo = model, gen.topo
        plan, me = gen.plan, gen.worker
        held = plan.units_of(me)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        first_pipeline = gen.plan.pipelines[0].workers
        units = {n: stage_unit_of(n, held) for n, _ in self.named}
        # this rank counts a unit in |g|^2 when it holds it in the first pipeline
        self.counted = [p for n, p in self.named if units[n] != "tied" and me in first_pipeline]
        n_layers = plan.n_layers
        entries: dict[tuple[int, ...], list] = {}
        for n, p in self.named:
            u = units[n]
            ranks = gen.units[u]
            entries.setdefault(ranks, []).append((unit_order(u, n_layers), n, p, True))
            if u == "embed" and "tied" in gen.units and gen.rank in gen.units["tied"]:
                if "tied" not in held and n == "embed.tokens.weight":  # one-stage pipeline
                    entries.setdefault(gen.units["tied"], []).append(
                        (unit_order("tied", n_layers), n, p, False)
                    )
        index = {n: i for i, (n, _) in enumerate(self.named)}
        self.syncs = []
        for ranks in sorted(entries):  # the global order (module docstring)
            if len(ranks) < 2:
                continue
            items = sorted(entries[ranks], key=lambda e: (e[0], index[e[1]]))
            self.syncs.append(
                ReplicaSync(
                    gen.replica_topology(ranks), [e[2] for e in items], [e[3] for e in items]
                )
            )
        self.optimizer = make_optimizer([(n, p, p) for n, p in self.named])
        self.reduced = False  # finish() completed for the current gradients
        self.grad_bytes = 0

    # the interface (parallel/engine.py)

    def finish(self) -> None:
        for s in self.syncs:
            s.launch()
        for s in self.syncs:
            s.complete()
        self.grad_bytes = tensor_bytes(p.grad for _, p in self.named if p.grad is not None)
        self.reduced = True

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

    def optim_state(self, *, template: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        state = self.optimizer.state
        if template:
            for _, p in self.named:
                if not state.get(p):
                    state[p] = adamw_zero_state(p)
        return {n: dict(state[p]) for n, p in self.named if state.get(p)}

    def load_optim_state(self, state: dict) -> None:
        """Nothing to do: ``optim_state(template=True)`` handed out the live tensors."""

    def full_params(self, *, writeback: bool = False):
        return contextlib.nullcontext()

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


def factory(gen: Generation) -> Callable:
    """What ``Part.make_engine`` is: ``build_data_parallel``'s signature, this engine."""

    def make(model, *, topo, cfg, make_optimizer, owns_grad=None, defer=()):
        assert topo is gen.topo, "the engine runs on the generation's topology"
        return ReplicaEngine(model, gen=gen, make_optimizer=make_optimizer)

    return make
