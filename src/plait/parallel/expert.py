"""Expert parallelism: the E experts of a MoE layer sharded over the n ranks of an ep group,
tokens moved to their experts and back by all-to-all (issue 28). The group is given as
(topo, axis), as ``context.py``'s ring is: any axis whose group is the ep group (until
``Topology`` has an ep axis, a dp sub-group). Rank j of the group holds experts
[j E/n, (j+1) E/n) (``MoE``'s ``ep=``; ``init_weights`` slices them from the full stack).

Communication (axis: the ep group of n ranks; per MoE layer and micro-batch; M the
assignments this rank routes -- N K dropless, fewer when capacity drops some -- h hidden,
e bytes per activation element):

- forward: one ``all_to_all`` of the per-expert counts (E int64, 8E bytes counted), one
  host read of them (the splits), then one ``all_to_all_v`` of the tokens (M h e bytes
  counted, the rows for other ranks sent) and one back of the experts' outputs (R h e,
  R the rows this rank's experts received).
- backward: the two token exchanges again, reversed (R h e, then M h e): the gradient of
  an all-to-all is the all-to-all with the splits swapped.
So 2 (M + R) h e bytes counted per layer and micro-batch; balanced, R = M and each rank
sends (n-1)/n of them. Nothing with n == 1.

Why it cannot deadlock under NCCL's rules: every rank of the group issues the same
collectives (counts, tokens, outputs; in the backward outputs' then tokens' gradients)
in the same order from the training (or autograd) thread, whatever it routes -- a rank
that sends or receives zero rows still takes part with empty pieces -- and the splits
every rank passes agree, because each rank's receive splits are the send splits its
peers told it in the counts exchange.

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

Order of rows: the sender sorts its rows by global expert, so the rows for rank j are
one contiguous piece; the receiver gets them grouped by source rank, then by its local
expert within, and permutes them to local-expert order (source rank within) for the
experts, and back before returning them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.parallel.data_parallel import DataParallelConfig, model_chunks
from plait.parallel.engine import build_data_parallel
from plait.parallel.held import Held
from plait.topology import Axis, Topology


class _AllToAllV(torch.autograd.Function):
    """Rows exchanged over the ep group; backward: the gradient's rows the other way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, topo, axis):
        ctx.splits, ctx.topo, ctx.axis = (out_splits, in_splits), topo, axis
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        comm.all_to_all_v(out, x, out_splits=out_splits, in_splits=in_splits, topo=topo, axis=axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        comm.all_to_all_v(back, grad.contiguous(), out_splits=in_splits, in_splits=out_splits,
                          topo=ctx.topo, axis=ctx.axis)  # fmt: skip
        return back, None, None, None, None


def exchange_counts(counts: torch.Tensor, *, topo, axis) -> torch.Tensor:
    """counts (E,) rows this rank sends to each global expert -> (n, E/n): row i the rows
    rank i sends to each of this rank's experts."""
    n = topo.size(axis)
    received = torch.empty_like(counts)
    comm.all_to_all_into(received, counts, topo=topo, axis=axis)
    return received.view(n, -1)


def expert_parallel(x: torch.Tensor, counts: torch.Tensor, experts, *, topo, axis) -> torch.Tensor:
    """Run ``experts`` (this rank's E/n, called as ``experts(rows, counts_per_expert)``) on
    the rows routed to them from every rank of the ep group. x (M, C): this rank's rows
    sorted by global expert, ``counts`` (E,) of them per expert, on the device. Returns
    (M, C): each row's expert output, in x's order. Differentiable (module docstring)."""
    n = topo.size(axis)
    E = counts.numel()
    if E % n:
        raise ValueError(f"{E} experts do not split over an ep group of {n}")
    received = exchange_counts(counts, topo=topo, axis=axis)  # (n, E/n)
    both = comm.host_values(torch.cat([counts, received.reshape(-1)]))  # the splits: one read
    sent, got = both[:E], both[E:]
    local = E // n
    in_splits = [sum(sent[j * local : (j + 1) * local]) for j in range(n)]
    matrix = [got[i * local : (i + 1) * local] for i in range(n)]  # [source][local expert]
    out_splits = [sum(row) for row in matrix]
    rows = _AllToAllV.apply(x, out_splits, in_splits, topo, axis)  # by source, then expert
    order = _expert_order(matrix, device=x.device)  # to local expert, then source
    per_expert = [sum(matrix[i][e] for i in range(n)) for e in range(local)]
    y = experts(rows[order], per_expert)
    y = y[torch.argsort(order)]  # back to source order
    return _AllToAllV.apply(y, in_splits, out_splits, topo, axis)


def _expert_order(matrix: list[list[int]], *, device) -> torch.Tensor:
    """Row indices that take rows grouped [source][expert] to [expert][source]."""
    n, local = len(matrix), len(matrix[0])
    starts, at = [], 0
    for i in range(n):
        row = []
        for e in range(local):
            row.append(at)
            at += matrix[i][e]
        starts.append(row)
    pieces = [torch.arange(starts[i][e], starts[i][e] + matrix[i][e], device=device)
              for e in range(local) for i in range(n)]  # fmt: skip
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


# -- --ep in the trainer: groups, and the two gradient engines -----------------------------


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
    keys), and its pipeline chunks as subsets too (buckets are cut per chunk). The engines
    read nothing else of the model at ZeRO 0-2 (stage 3 walks blocks: refused with ep)."""

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


class ExpertDataParallel:
    """The trainer's engine under ``--ep``: the dense parameters' engine over dp (x cp) and
    the experts' over edp, each ``build_data_parallel``'s for the run's ZeRO stage (0-2),
    behind one ``engine.GradientEngine``. Each shards its state over its own group; the
    global |g|^2 is the sum of the two engines' shares (each counts its tensors once).
    ``held_state`` is the union, the experts' placed at their rows of the (E, ...) tensor
    (``Held.rows``), so checkpoints are global-shaped and reshard across ep changes. A
    pipeline stage without MoE layers holds no expert parameters and builds no expert
    engine (it issues nothing on edp)."""

    def __init__(self, model: nn.Module, *, topo: Topology, edp_topo: Topology,
                 cfg: DataParallelConfig, make_optimizer: Callable, owns_grad=None, defer=(),
                 compression=None):  # fmt: skip
        if cfg.zero == 3 or compression is not None:
            raise ValueError("--ep runs with --zero 0, 1 or 2 and the plain all-reduce")
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
