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


def param_groups(named_params, weight_decay: float, decays=None) -> list[dict]:
    """Decay matrices (and embeddings); not biases or norm weights -- as nanoGPT does.
    ``decays(t)`` overrides that rule (ZeRO passes flat shards, which keep their
    parameter's rule)."""
    rule = decays or (lambda p: p.dim() >= 2)
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad or decays is not None:  # shards are plain tensors
            (decay if rule(p) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(named_params, cfg: TrainConfig, decays=None) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(named_params, cfg.weight_decay, decays),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
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


def grad_sq_sum(params, topo: Topology) -> torch.Tensor:
    """Sum of squares of the owned gradients on this rank (a float64 scalar); the caller
    adds the dp-rank condition when gradients are replicated over dp."""
    total = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None and owns_grad(p, topo)]
    if grads:
        norms = torch._foreach_norm(grads, 2)
        total += torch.stack([n.double() for n in norms]).pow(2).sum()
    return total


def clip_coef(total_norm: float, max_norm: float) -> float:
    """What global-norm clipping multiplies every gradient by (1.0: no clipping)."""
    if max_norm > 0 and total_norm > max_norm and math.isfinite(total_norm):
        return max_norm / (total_norm + 1e-6)
    return 1.0


def clip_(params, total_norm: float, max_norm: float) -> None:
    coef = clip_coef(total_norm, max_norm)
    if coef != 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)


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


def global_stats(local: list[float], topo: Topology) -> list[float]:
    """All-reduce (sum) a few float64 scalars over every rank in one call."""
    t = torch.tensor(local, dtype=torch.float64)
    comm.world_all_reduce(t, topo=topo)
    return t.tolist()


def adamw_state(optimizer: torch.optim.Optimizer, named_params) -> dict[str, dict]:
    """AdamW's state keyed by parameter name (what the checkpoint stores)."""
    out = {}
    for name, p in named_params:
        st = optimizer.state.get(p)
        if st:
            out[name] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def init_adamw_state(optimizer: torch.optim.Optimizer, named_params) -> dict[str, dict]:
    """Create AdamW's (zero) state ahead of the first step, so a checkpoint can load into it."""
    for _, p in named_params:
        if p.requires_grad and not optimizer.state.get(p):
            optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
    return adamw_state(optimizer, named_params)
