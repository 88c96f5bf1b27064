"""Local SGD (``--dp-algo local-sgd``) and DiLoCo (``--dp-algo diloco``): replicas step
alone and meet every H steps.

Update rules (x_i: replica i's parameters, R replicas, t counts optimizer steps from 1):

- Local SGD (Stich 2019; Lin et al. 2020): every replica takes its own optimizer step on
  its own gradient; when t > W and (t - W) is a multiple of H, x_i <- (1/R) sum_j x_j.
  With ``--local-warmup W`` (post-local SGD), the first W steps are plain data-parallel
  steps instead: the gradient is averaged over the replicas before the optimizer step
  (so all replicas stay equal). With a linear optimizer (``--optimizer sgd``) and H = 1,
  local SGD *is* plain data parallelism (the average of the updates is the update of the
  average gradient); with AdamW it is not, the update being nonlinear in the gradient.
  With ``--sync-optimizer-state`` the optimizer's elementwise state is averaged with the
  parameters at each sync (SGD's momentum m_i <- (1/R) sum_j m_j; AdamW's two moments
  alike; the step counters are equal already): SlowMo's "average the base optimizer
  buffers" (Wang et al. 2020), so that replicas restart from one point *and* one
  direction. The mean momentum is unchanged by it (averaging is linear); what changes is
  the spread of the replicas' next H steps.
- DiLoCo (Douillard et al. 2023): every replica runs H inner AdamW steps from the shared
  point theta; then the outer gradient Delta = (1/R) sum_i (theta - x_i) drives a
  Nesterov-momentum outer step, v <- mu v + Delta, theta <- theta - lr_out (Delta + mu v),
  and every replica restarts from the new theta. Inner optimizer states stay per replica.
  ``--outer-lr 1 --outer-momentum 0`` is local SGD. State: theta (the anchor) and v, the
  same on every replica (8 bytes per parameter piece).

Communication (axis dp, across replicas; P = 4 x this rank's parameter elements -- its
ZeRO piece under ``--zero-shard-group``; counted as ``comm.py`` counts):

- on a synchronisation step: the pieces (local SGD) or the outer gradients (DiLoCo),
  all-reduced in chunks of ``--bucket-mb``: P bytes, 2 (R-1)/R x P sent; otherwise
  nothing. Per step on average: P / H. ``--sync-optimizer-state`` adds the state tensors
  to the same chunked all-reduce, after the pieces: (1 + s) P, s = 1 (SGD with momentum)
  or 2 (AdamW); offloaded state is copied to the device for it.
- local SGD's warm-up steps: the gradient buffers all-reduced, P bytes each step.
- inside a replica, the engine's own traffic (ZeRO within the shard group; none for K=1).

All collectives are issued by the training thread right after the optimizer step (or, in
warm-up, right after the engine's ``finish``), at the same steps on every rank, in chunk
order, on ``topo.device``: the same sequence on every rank of each across group, which is
all NCCL asks; nothing overlaps them (they are rare).
"""

from __future__ import annotations

import torch

from plait import comm
from plait.dp_algos.replicas import Replicas
from plait.topology import Axis


class LocalSGD(Replicas):
    """Parameter averaging every H steps, after an optional warm-up (module docstring)."""

    def is_sync(self, step: int) -> bool:
        t, w = step + 1, self.cfg.local_warmup
        return t > w and (t - w) % self.cfg.sync_every == 0

    def finish_grads(self, step: int) -> None:
        if step >= self.cfg.local_warmup:
            return
        # warm-up: a plain data-parallel step (every replica's loss was divided by its own
        # tokens, so the mean over replicas is the global batch's gradient)
        flats = [b.flat for b in self.engine.grads.buckets]
        for flat in self.sum_across(flats):
            flat.div_(self.num_replicas)

    def after_step(self, step: int) -> None:
        if self.is_sync(step):
            self.average(self.optimizer_state() if self.cfg.sync_optimizer_state else ())

    def optimizer_state(self) -> list[torch.Tensor]:
        """The optimizer's elementwise state of every piece, in the pieces' order (the same
        tensors, in the same order, on every rank of ``across``)."""
        return [t for _, p, _ in self.engine.pieces() for t in self.engine.piece_state(p)]


class DiLoCo(Replicas):
    """H inner steps per replica, then a Nesterov outer step on the mean parameter change
    (module docstring)."""

    def attach(self, engine, model) -> None:
        super().attach(engine, model)
        self.anchor = [piece.detach().clone() for piece in self.pieces]
        self.momentum = [torch.zeros_like(piece) for piece in self.pieces]

    def is_sync(self, step: int) -> bool:
        return (step + 1) % self.cfg.sync_every == 0

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if not self.is_sync(step):
            return
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        runs = self.chunks()
        index = {id(t): i for i, t in enumerate(self.pieces)}
        # outer gradients theta - x_i, summed over the replicas (async, in chunk order)
        flats = [torch.cat([(self.anchor[index[id(t)]] - t).reshape(-1) for t in run])
                 for run in runs]  # fmt: skip
        handles = [comm.all_reduce(f, topo=self.across, axis=Axis.DP, async_op=True) for f in flats]
        for run, flat, handle in zip(runs, flats, handles):
            comm.wait([handle], topo=self.across, what="all_reduce", axis="dp")
            flat.div_(self.num_replicas)
            offset = 0
            for t in run:
                i = index[id(t)]
                delta = flat[offset : offset + t.numel()].view_as(t)
                offset += t.numel()
                v = self.momentum[i].mul_(mu).add_(delta)
                self.anchor[i].sub_(delta.add(v, alpha=mu), alpha=lr)  # Nesterov
                t.copy_(self.anchor[i])
        self.engine.pieces_changed()

    def algo_state(self) -> dict:
        names = [name for name, _, _ in self.engine.pieces()]
        return {
            n: {"anchor": a, "outer_momentum": m}
            for n, a, m in zip(names, self.anchor, self.momentum)
        }

    def fresh_state(self, *, loaded: bool) -> None:
        if not loaded:  # from a plain checkpoint: the loaded weights are the shared point
            with torch.no_grad():
                for a, piece in zip(self.anchor, self.pieces):
                    a.copy_(piece)
