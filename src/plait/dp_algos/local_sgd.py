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
- Compressed syncs (``--compress bf16|int8``; Basu et al. 2019's Qsparse-local-SGD,
  Streaming DiLoCo's quantised outer gradients, Douillard et al. 2025): local SGD keeps
  the anchor theta (the point of the last sync, the same on every replica) and a sync
  becomes theta <- theta + C((1/R) sum_j (x_j - theta)), x_i <- theta, where C is the
  codec's sum (``Replicas.mean_changes``); DiLoCo's outer gradient goes through C alike.
  The change since the last sync is small next to the weights, so its rounding is too:
  int8's per-element error is at most 1/s of the block's largest change (s = 127 // R),
  and unbiased. No error feedback: what is lost is zero-mean (int8) or a relative 2^-8
  (bf16), not a systematic bias to carry forward.
- DiLoCo (Douillard et al. 2023): every replica runs H inner AdamW steps from the shared
  point theta; then the outer gradient Delta = (1/R) sum_i (theta - x_i) drives a
  Nesterov-momentum outer step, v <- mu v + Delta, theta <- theta - lr_out (Delta + mu v),
  and every replica restarts from the new theta. Inner optimizer states stay per replica.
  ``--outer-lr 1 --outer-momentum 0`` is local SGD. State: theta (the anchor) and v, the
  same on every replica (8 bytes per parameter shard).

Communication (axis dp, across replicas; P = 4 x this rank's parameter elements -- its
ZeRO shard under ``--zero-shard-group``; counted as ``comm.py`` counts):

- on a synchronisation step: the shards (local SGD) or the outer gradients (DiLoCo),
  all-reduced in chunks of ``--bucket-mb``: P bytes, 2 (R-1)/R x P sent; otherwise
  nothing. Per step on average: P / H. With ``--compress bf16`` the change since the last
  sync (local SGD: x_i - anchor; DiLoCo: the outer gradient) travels in bfloat16, P / 2
  bytes; with ``--compress int8`` as ``compression.Int8Sum`` levels, P / 4 bytes plus one
  fp32 scale per 512 elements of each tensor, all-reduced with MAX just before (two
  all-reduces per chunk, in chunk order). ``--sync-optimizer-state`` adds the state tensors
  to the same chunked all-reduce, after the shards: (1 + s) P, s = 1 (SGD with momentum)
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

from plait.dp_algos.algorithm import Replicas


class LocalSGD(Replicas):
    """Parameter averaging every H steps, after an optional warm-up (module docstring)."""

    def finish_grads(self, step: int) -> None:
        if step >= self.cfg.local_warmup:
            return
        # warm-up: a plain data-parallel step (every replica's loss was divided by its own
        # tokens, so the mean over replicas is the global batch's gradient)
        flats = [b.flat for b in self.engine.grads.buckets]
        for flat in self.sum_across(flats):
            flat.div_(self.num_replicas)

    def attach(self, engine, model) -> None:
        super().attach(engine, model)
        # a compressed sync sends x_i - anchor, the change since the last sync
        self.anchor = [p.detach().clone() for p in self.shards] if self.cfg.compress else None

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if self.anchor is not None and step == self.cfg.local_warmup - 1:
            for a, t in zip(self.anchor, self.shards):  # the warm-up's end: the shared point
                a.copy_(t)
            return
        if not self.is_sync(step):
            return
        if self.anchor is None:
            self.average(self.optimizer_state() if self.cfg.sync_optimizer_state else ())
            return
        means = self.mean_changes(self.shards, self.anchor, step)
        for a, t, mean in zip(self.anchor, self.shards, means):
            a.add_(mean)
            t.copy_(a)
        self.engine.shards_changed()

    def algo_state(self) -> dict:
        if self.anchor is None:
            return {}
        return {n: {"anchor": a} for n, a in zip(self.shard_names, self.anchor)}

    def optimizer_state(self) -> list[torch.Tensor]:
        """The optimizer's elementwise state of every shard, in the shards' order (the same
        tensors, in the same order, on every rank of ``across``)."""
        return [t for _, p, _ in self.engine.shards() for t in self.engine.shard_state(p)]


class DiLoCo(Replicas):
    """H inner steps per replica, then a Nesterov outer step on the mean parameter change
    (module docstring)."""

    def attach(self, engine, model) -> None:
        super().attach(engine, model)
        self.anchor = [shard.detach().clone() for shard in self.shards]
        self.momentum = [torch.zeros_like(shard) for shard in self.shards]

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if not self.is_sync(step):
            return
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        # the outer gradient: the replicas' mean of theta - x_i (as --compress asks)
        outer = self.mean_changes(self.anchor, self.shards, step)
        for t, a, v, delta in zip(self.shards, self.anchor, self.momentum, outer):
            v.mul_(mu).add_(delta)
            a.sub_(delta.add(v, alpha=mu), alpha=lr)  # Nesterov
            t.copy_(a)
        self.engine.shards_changed()

    def algo_state(self) -> dict:
        return {
            n: {"anchor": a, "outer_momentum": m}
            for n, a, m in zip(self.shard_names, self.anchor, self.momentum)
        }
