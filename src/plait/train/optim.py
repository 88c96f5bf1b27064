"""AdamW, the learning-rate schedule, global-norm clipping and dynamic loss scaling.

The schedule is a pure function of the step, so a resumed run needs only the step number.
Clipping and the fp16 overflow check work for any layout: each rank sums the squares of
the gradients it *owns* (a weight replicated on several tp or dp ranks is counted on one
of them only), and one all-reduce over every rank gives the global figures.
"""

from __future__ import annotations

import math

import torch

from plait import comm
from plait.parallel.tensor import shard_spec
from plait.topology import Topology
from plait.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to
    ``lr * min_lr_ratio`` at the last step. ``step`` counts from 0."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup - 1)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def decays(p: torch.Tensor) -> bool:
    """Weight decay for matrices and embeddings, not for biases and norm weights (nanoGPT).
    The one rule: engines that hand the optimizer shards of a parameter ask it about the
    parameter, not the shard."""
    return p.dim() >= 2


def build_adamw(params, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``params``: (name, tensor to update, the parameter it belongs to) -- the
    parameter itself, or this rank's ZeRO shard of it. Weight decay follows ``decays`` of
    the parameter. Fused (one kernel for every tensor) when the tensors live on a GPU,
    multi-tensor (foreach) otherwise. A rehearsal's fake tensors (``plait.rehearse``)
    stand for a GPU's: fused too, which is also the one path that never reads the step
    count on the host (foreach does, and a fake tensor has no value to read)."""
    from torch._subclasses.fake_tensor import is_fake

    decay, no_decay = [], []
    for _, t, p in params:
        (decay if decays(p) else no_decay).append(t)
    on_gpu = any(t.is_cuda or is_fake(t) for _, t, _ in params)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        **({"fused": True} if on_gpu else {"foreach": True}),
    )


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``--optimizer``: AdamW (``build_adamw``), or SGD with ``--momentum`` and coupled
    weight decay -- a linear update, under which local SGD with H = 1 and gossip on the
    complete graph are plain data parallelism (``dp_algos``). Same parameter groups."""
    if cfg.optimizer == "adamw":
        return build_adamw(params, cfg)
    decay, no_decay = [], []
    for _, t, p in params:
        (decay if decays(p) else no_decay).append(t)
    return torch.optim.SGD(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        momentum=cfg.momentum,
        foreach=True,
    )


def owns_grad(p: torch.Tensor, topo: Topology) -> bool:
    """Whether this rank counts ``p``'s gradient in global sums (see module doc)."""
    if getattr(p, "grad_owner", None) is not None:
        return p.grad_owner
    spec = shard_spec(p)
    if topo.tp > 1:
        if spec.dim is None and topo.tp_rank != 0:
            return False
        if spec.dim is not None and topo.tp_rank % spec.replicas:
            return False
    return True


def clip_coef(total_norm: float, max_norm: float) -> float:
    """What global-norm clipping multiplies every gradient by (1.0: no clipping)."""
    if max_norm > 0 and total_norm > max_norm and math.isfinite(total_norm):
        return max_norm / (total_norm + 1e-6)
    return 1.0


class LossScaler:
    """Dynamic loss scaling for fp16: scale the loss, skip the step and halve the scale when
    any gradient overflows, double it after ``growth_interval`` clean steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 200):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale /= 2.0
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self.good_steps = d["scale"], d["good_steps"]


def global_stats(values, topo: Topology) -> list[float]:
    """Sum a few scalars over every rank in one all-reduce, and read them on the host.

    ``values`` are floats or 0-dim tensors (a loss summed on the device, a squared norm):
    they are stacked on ``topo.device`` in float64 -- a NCCL group has no CPU side -- and
    read with one ``tolist`` (an evaluation's loss; a training step's statistics go through
    ``Trainer._reduce_stats``)."""
    t = torch.stack(
        [
            v.detach().to(device=topo.device, dtype=torch.float64)
            if isinstance(v, torch.Tensor)
            else torch.tensor(float(v), dtype=torch.float64, device=topo.device)
            for v in values
        ]
    )
    comm.world_all_reduce(t, topo=topo)
    return t.tolist()
