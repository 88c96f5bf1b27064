"""The data-parallel engine: one interface over plain data parallelism (``data_parallel.py``)
and ZeRO stages 1-3 (``zero.py``), and the factory that picks one for a run.

Communication: see the engine's module (``data_parallel.py`` for stage 0, ``zero.py`` for
stages 1-3); this module issues nothing itself.

The interface is typed: ``GradientEngine`` is what the trainer drives (also implemented
by the resilient engines, ``resilience/engines.py``), ``ShardEngine`` adds what
``dp_algos`` use, and ``GradCompression`` (defined in ``data_parallel.py``, so that no
engine imports this module) is what a ``dp_algos`` codec hands the engines.
The engines implement them structurally (no inheritance, so that a renamed method is an
error and not a silent fallback to the protocol's stub; ``tests/test_engine_protocol.py``
checks every member and its signature). In use (the trainer uses nothing else)::

    engine = build_data_parallel(
        model, topo=topo, cfg=DataParallelConfig.from_layout(layout),
        make_optimizer=partial(optim.build_adamw, cfg=tcfg),  # [(name, tensor, param)] -> AdamW
        owns_grad=partial(optim.owns_grad, topo=topo),        # counted once in |g|^2?
        defer=tp_grad_sync.partial + tp_grad_sync.replicated_kv + tied_copies)
    for step in ...:
        runner.train_step(...)        # hooks launch the last micro-batch's buckets
        tp_grad_sync.finish()         # complete the deferred gradients (full, local)
        engine.finish()               # launch the rest; wait; gradients now reduced
        sq = engine.grad_sq_local()   # this rank's share of |g|^2 (a device scalar)
        engine.scale_grads_(c)        # unscale (fp16) / clip
        engine.step(lr)               # AdamW (+ ZeRO parameter gathers)
        engine.zero_grad()
    checkpoint.save(..., state=engine.held_state())   # what this rank holds, as it is
    checkpoint.load(..., state=engine.held_state())   # resume: loaded in place ...
    engine.state_loaded()                             # ... stages 1-2 re-gather
    # dp_algos (replicas that differ) average and mix what the optimizer updates:
    for name, p, shard in engine.shards(): ...    # write into ``shard`` ...
    engine.shards_changed()                       # ... then ZeRO 1/2 re-gather
    engine.held_of(p, shard_shaped)               # checkpoints: its place in the whole

``make_optimizer`` receives (name, tensor to update, parameter) triples: the parameter
itself (stage 0) or this rank's shard of it (stages 1-3), so that rules about parameters
(weight decay) are asked of the parameter. ``engine.grad(p)`` is the tensor that holds
this rank's (reduced) gradient of ``p`` after ``finish()``: the full ``p.grad`` for stage
0, its dp shard for stages 1-3. ``engine.model_state_bytes()``: what this rank holds for
parameters, gradients and optimizer state, measured from the tensors
(``sizes.model_state_breakdown`` predicts it). Build the engine once the model is on its
device: stages 1-2 keep views into the parameters, stage 3 moves them into buffers of its
own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from plait.parallel.data_parallel import (
    DataParallel,
    DataParallelConfig,
    GradCompression,
)
from plait.parallel.held import Held
from plait.parallel.zero import ZeroDataParallel
from plait.topology import Topology

__all__ = [
    "DataParallelConfig",
    "GradCompression",
    "GradientEngine",
    "ShardEngine",
    "build_data_parallel",
]


@runtime_checkable
class GradientEngine(Protocol):
    """What the trainer drives each step and at checkpoints (module docstring)."""

    def finish(self) -> None:
        """Launch what the backward's hooks did not, wait: the gradients are reduced."""

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's (reduced) gradient of ``p`` after ``finish()``: whole or its shard."""

    def grad_sq_local(self) -> torch.Tensor | float:
        """This rank's share of |g|^2 (a device scalar; 0 where another rank counts it)."""

    def scale_grads_(self, factor: float) -> None:
        """Multiply the gradients in place (fp16 unscaling, clipping)."""

    def step(self, lr: float) -> None:
        """The optimizer step (stages 1-2: then the parameters' all-gather)."""

    def zero_grad(self) -> None:
        """Free the gradients."""

    def held_state(self) -> dict[str, Held]:
        """What this rank holds of each parameter (``model/<name>``) and optimizer state
        (``optim/<name>/<key>``), as live tensors (``parallel/held.py``): a checkpoint
        saves them as they are and loads into them."""

    def state_loaded(self) -> None:
        """After a load into ``held_state``'s tensors (stages 1-2 re-gather: collective)."""

    def model_state_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optim", "total", "host"}: bytes this rank holds."""

    def close(self) -> None:
        """Remove the hooks; the engine issues nothing more."""


@runtime_checkable
class ShardEngine(GradientEngine, Protocol):
    """An engine whose shards -- what the optimizer updates on this rank: each parameter
    (stage 0) or this rank's shard of it (1-3) -- ``dp_algos`` average and mix."""

    owns_grad: Callable[[torch.Tensor], bool]  # counted once in |g|^2 (and the distance)

    def shards(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, this rank's shard of it)."""

    def shards_changed(self) -> None:
        """After the shards were written: the parameters follow (stages 1-2 re-gather)."""

    def shard_state(self, p: nn.Parameter) -> list[torch.Tensor]:
        """The optimizer's elementwise state of ``p``'s shard (zeros if not stepped yet)."""

    def held_of(self, p: nn.Parameter, t: torch.Tensor) -> Held:
        """What this rank holds of a tensor shaped like ``p`` when it holds ``t``, shaped like
        its shard of ``p`` (``parallel/held.py``; checkpoints of ``dp_algos`` state)."""


# The hook that sums this rank's gradient shards across ZeRO shard groups in place:
# (this rank's row of a bucket, the bucket's layout, its parameters).
def build_data_parallel(
    model: nn.Module,
    *,
    topo: Topology,
    cfg: DataParallelConfig,
    make_optimizer: Callable,
    owns_grad: Callable[[torch.Tensor], bool] | None = None,
    defer=(),
    compression: GradCompression | None = None,
) -> ShardEngine:
    """The engine for ``cfg.zero`` over ``model`` (one chunk, or a module holding this
    rank's chunks). Collective over the world when hybrid sharding creates its groups.

    ``make_optimizer(triples)`` builds the optimizer (AdamW; its state must be elementwise
    so that it can be sharded) over (name, tensor, parameter) triples (module docstring).
    ``owns_grad(p)``: whether this rank counts ``p``'s gradient in the global norm (a
    tp-replicated weight on one tp rank, a tied copy once); None counts every parameter.
    Both come from the trainer so that ``parallel`` needs nothing from ``plait.train``.
    ``defer``: parameters whose gradients another component completes after the
    backward (``data_parallel.py``). ``compression``: a ``dp_algos`` gradient codec that
    replaces the dp all-reduce (stages 0-1) or the all-reduce across shard groups (2-3).
    """
    engine = DataParallel if cfg.zero == 0 else ZeroDataParallel
    return engine(model, topo=topo, cfg=cfg, make_optimizer=make_optimizer, owns_grad=owns_grad,
                  defer=defer, compression=compression)  # fmt: skip
