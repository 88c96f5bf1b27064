"""Data parallelism (``--zero 0``): gradients averaged over the dp axis in buckets that
overlap the backward, and the gradient paths (``GradReducer``) and helpers the ZeRO
stages share (``zero.py`` holds stages 1-3).

Communication (axis dp, d = dp size, N = trainable parameters on this rank, 4-byte
gradients, B = bucket bytes, default 25 MiB): in the backward of a step's *last*
micro-batch, one all-reduce per bucket -- ceil(4N / B) all-reduces (more where a bucket
boundary falls between chunks, or for deferred gradients, below) of 4N bytes in all (a
ring all-reduce sends 2 (d-1)/d x 4N bytes per rank on the wire). Each starts,
asynchronously, the moment the last gradient of its bucket has been accumulated, so it
overlaps the rest of the backward; ``finish()`` waits. Earlier micro-batches communicate
nothing (gradients accumulate in place), nor do the forward and the optimizer step.
With d == 1 nothing is issued.

Averaging is exact whatever d is: the loss is divided by the *global* token count, so the
sum over dp of the local gradients is the gradient of the global mean loss.

Buckets. Each model chunk's trainable parameters, in reverse registration order (the
order the backward produces their gradients), are cut into buckets of about B bytes.
For stage 0 (and 1) every bucket owns one flat gradient buffer (``flat.FlatLayout``): the
last micro-batch's gradients are moved into it as the bucket launches and each ``p.grad``
becomes a view into it, so the optimizer reads what was all-reduced (no second copy).
*Deferred* parameters -- those whose gradient another component completes after the
backward (``TPGradSync``'s sequence-parallel and replicated key/value weights, the
pipeline's tied embedding copies) -- go into buckets of their own that are launched by
``finish()``; complete them before calling it.

The last micro-batch is detected per bucket, not by loop index, so any runner works: a
bucket has finished one micro-batch's backward when the post-accumulate-grad hook of
every one of its parameters has fired once; the ``num_microbatches``-th time launches
its collective. Runners must run, per step and per chunk, exactly ``num_microbatches``
backward passes that reach every trainable parameter (true of the local runner and of
every pipeline schedule, split backward included); anything not launched by the hooks
-- an unused parameter, a deferred bucket -- is launched by ``finish()``.

The engine interface the trainer drives (``engine.GradientEngine`` / ``ShardEngine``),
and the factory that picks the engine for a ZeRO stage, are in ``engine.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from plait import comm
from plait.layout import DEFAULT_BUCKET_MB
from plait.parallel.flat import FlatLayout
from plait.parallel.held import Held
from plait.parallel.tensor import REPLICATED, shard_spec
from plait.topology import Axis, Topology


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """How gradients, optimizer state and parameters are spread over the dp axis."""

    zero: int = 0  # 0: replicate everything; 1: shard optimizer state; 2: + grads; 3: + params
    shard_group: int | None = None  # shard within groups of this many dp ranks (HSDP)
    offload_optimizer: bool = False  # optimizer state and update in CPU memory
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient bucket size (stage 3: one per layer)
    num_microbatches: int = 1  # backward passes per chunk and step (gradient accumulation)
    gather_dtype: str = "fp32"  # stage 3: weights gathered in the compute dtype (zero.py)

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.bucket_mb <= 0:
            raise ValueError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.gather_dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"--dtype {self.gather_dtype!r}: choose one of fp32, bf16, fp16")
        if self.num_microbatches < 1:
            raise ValueError("num_microbatches must be at least 1")
        if self.zero == 0 and (self.shard_group is not None or self.offload_optimizer):
            raise ValueError("--zero-shard-group and --offload-optimizer need --zero 1, 2 or 3")

    @classmethod
    def from_layout(cls, layout) -> DataParallelConfig:
        return cls(
            zero=layout.zero,
            shard_group=layout.zero_shard_group,
            offload_optimizer=layout.offload_optimizer,
            bucket_mb=layout.bucket_mb,
            num_microbatches=layout.num_microbatches,
            gather_dtype=layout.dtype,
        )

    @property
    def gather_torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            self.gather_dtype
        ]

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


# --- buckets ------------------------------------------------------------------------------


def model_chunks(model: nn.Module) -> list[nn.Module]:
    """The pipeline chunks inside ``model`` (each ``Transformer``, outermost), else [model]."""
    from plait.model.transformer import Transformer

    if isinstance(model, Transformer):
        return [model]
    chunks = getattr(model, "chunks", None)  # a pipeline stage keeps them in a plain list
    if (
        isinstance(chunks, list | tuple)
        and chunks
        and all(isinstance(c, nn.Module) for c in chunks)
    ):
        return list(chunks)
    found = [m for m in model.modules() if isinstance(m, Transformer)]
    outer = [m for m in found if not any(m is not o and _contains(o, m) for o in found)]
    return outer or [model]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def split_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` in reverse order, cut into runs of at least ``bucket_bytes`` (the last
    may be smaller): the backward produces gradients roughly last-parameter first."""
    buckets, bucket, size = [], [], 0
    for p in reversed(params):
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class Bucket:
    """Parameters whose gradients are reduced by one collective, and its progress.
    ``layout``: where each gradient sits in the flat buffer the collective moves."""

    def __init__(self, params: list[nn.Parameter], layout: FlatLayout, *, deferred: bool = False):
        self.params, self.layout = params, layout
        self.deferred = deferred
        self.fired = 0  # gradient hooks fired in the current micro-batch's backward
        self.microbatches = 0  # micro-batches whose backward this bucket has completed
        self.launched = False
        self.handle = None  # the in-flight collective
        self.flat: torch.Tensor | None = None  # this step's reduced gradients, flat
        self.index = 0  # position among the reducer's buckets


def weak_method(obj, name: str, *bound):
    """``getattr(obj, name)(*bound, *args)`` through a weak reference. For hooks stored on
    parameters: those live on the C++ side, where a strong reference back to the engine
    (which holds the parameters) would be a cycle the garbage collector cannot see."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        return None if target is None else getattr(target, name)(*bound, *args)

    return call


class GradReducer:
    """Base of the gradient paths: buckets, the hooks that count micro-batches, and the
    launch of each bucket's collective on the last one (module docstring). Subclasses
    implement ``_launch`` and ``_complete``, and say in ``hooks_alone`` whether their
    hooks do more than launch early (ZeRO-3's pace its in-flight units): without it, a dp
    group of one rank registers none -- ``finish`` launches every bucket, and the backward
    skips a Python call per parameter per micro-batch.

    Gradient storage lives only from the backward to ``zero_grad()``, as with PyTorch's
    ``zero_grad(set_to_none=True)``: kept across the forward it would add to the
    activation peak. Accumulation micro-batches accumulate in autograd's own ``p.grad``;
    the last one's gradients are copied into the bucket's flat buffer as it launches."""

    hooks_alone = True  # hooks even in a dp group of one rank (class docstring)

    def __init__(self, model: nn.Module, *, topo: Topology, cfg: DataParallelConfig, defer=()):
        self.topo, self.cfg = topo, cfg
        deferred = {id(p) for p in defer}
        self.buckets: list[Bucket] = []
        seen: set[int] = set()
        for chunk in model_chunks(model):
            params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            self.buckets += self._make_buckets(
                [p for p in params if id(p) not in deferred], deferred=False
            )
            self.buckets += self._make_buckets(
                [p for p in params if id(p) in deferred], deferred=True
            )
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
        self.buckets += self._make_buckets(rest, deferred=False)
        for i, bucket in enumerate(self.buckets):
            bucket.index = i
        self._hooks = []
        hooks = self.hooks_alone or self.topo.size(Axis.DP) > 1
        for bucket in self.buckets if hooks else ():
            if bucket.deferred:
                continue
            hook = weak_method(self, "_grad_ready", bucket.index)
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))
        self.grad_bytes = 0  # of the last finish(): the gradients this rank held

    def _make_buckets(self, params, *, deferred: bool) -> list[Bucket]:
        runs = split_buckets(params, self.cfg.bucket_bytes)
        return [Bucket(b, self._layout(b), deferred=deferred) for b in runs]

    def _layout(self, params: list[nn.Parameter]) -> FlatLayout:
        """Where a bucket's gradients sit in its flat buffer: one after another."""
        return FlatLayout.of(params)

    def _grad_ready(self, index: int, _param) -> None:
        bucket = self.buckets[index]
        bucket.fired += 1
        if bucket.fired < len(bucket.params):
            return
        bucket.fired = 0
        bucket.microbatches += 1
        self._completed(bucket, last=bucket.microbatches == self.cfg.num_microbatches)

    def _completed(self, bucket: Bucket, last: bool) -> None:
        """A micro-batch's backward is done with ``bucket``: launch it on the last one."""
        if last and not bucket.launched:
            self._launch(bucket)

    def finish(self) -> None:
        """Launch every bucket the hooks did not, wait for all, complete the gradients."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            self._complete(bucket)
            bucket.launched, bucket.handle = False, None
            bucket.fired = bucket.microbatches = 0
        self.grad_bytes = tensor_bytes(b.flat for b in self.buckets)

    @property
    def launched_by_hooks(self) -> int:
        """Buckets in flight before ``finish()`` (tests: the overlap happened)."""
        return sum(b.launched for b in self.buckets)

    def zero_grad(self) -> None:
        """Free this step's gradients."""
        for bucket in self.buckets:
            bucket.flat = None
            for p in bucket.params:
                p.grad = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _launch(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def _complete(self, bucket: Bucket) -> None:
        raise NotImplementedError

    @staticmethod
    def _flatten(bucket: Bucket) -> None:
        """Move the bucket's gradients into one flat buffer ``bucket.flat``; each ``p.grad``
        becomes a view into it (a parameter without a gradient gets zeros)."""
        params = bucket.params
        bucket.flat = bucket.layout.pack([p.grad for p in params], like=params[0])
        for p, view in zip(params, bucket.layout.views(bucket.flat)):
            p.grad = view.view_as(p)  # autograd's tensor is freed: the gradient lives here


class AllReduceGrads(GradReducer):
    """Stage 0 and 1: a bucket's gradients are moved into one flat buffer (``p.grad``
    becomes a view into it) that is all-reduced asynchronously over ``topo``'s dp axis.
    Its hooks only launch a bucket early, which a dp group of one has no use for."""

    hooks_alone = False

    def _launch(self, bucket: Bucket) -> None:
        self._flatten(bucket)
        bucket.handle = comm.all_reduce(bucket.flat, topo=self.topo, axis=Axis.DP, async_op=True)
        bucket.launched = True

    def _complete(self, bucket: Bucket) -> None:
        comm.wait([bucket.handle], topo=self.topo, what="all_reduce", axis="dp")


AcrossGroups = Callable[[torch.Tensor, FlatLayout, list[nn.Parameter]], None]


class GradCompression(Protocol):
    """A ``dp_algos`` gradient codec as the engines take it (``compression=``): defined
    here, beside the reducer it replaces, so that the engines need not import ``engine.py``
    (which imports them for its factory)."""

    def reducer(self, model: nn.Module, *, topo: Topology, cfg: DataParallelConfig,
                defer=()) -> GradReducer:  # fmt: skip
        """The gradient path of stages 0-1 in place of ``AllReduceGrads``."""

    def across(self, topo: Topology) -> AcrossGroups:
        """The sum across shard groups (stages 2-3 with hybrid sharding) over ``topo``'s dp
        axis, in place of the plain all-reduce."""


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def frozen_bytes(model: nn.Module) -> int:
    """Bytes of the parameters nothing trains (a LoRA run's base): held, no gradient, no
    optimizer state."""
    return tensor_bytes(p for p in model.parameters() if not p.requires_grad)


def sq_sum(tensors) -> torch.Tensor | float:
    """Sum of squares of ``tensors``, a float64 scalar on their device (per-tensor norms
    first, as the single-process reference clips); 0.0 when there is nothing to sum.
    Stays on the device: the trainer reads it once per step with the other statistics."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(tensors, 2)
    return torch.stack(norms).double().pow(2).sum()  # (each norm cast alike: the same sum)


def adamw_zero_state(t: torch.Tensor, optimizer=None) -> dict[str, torch.Tensor]:
    """AdamW's state before its first step, as ``torch.optim.AdamW`` creates it: ``step`` a
    float32 scalar on ``t``'s device when ``optimizer`` is fused or capturable (its kernels
    read the step there: fused AdamW on CUDA fails on a host step), on the host otherwise."""
    on_device = optimizer is not None and any(
        g.get("fused") or g.get("capturable") for g in optimizer.param_groups
    )
    return {
        "step": torch.zeros((), dtype=torch.float32, device=t.device if on_device else "cpu"),
        "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format),
    }


def zero_state(optimizer, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state ``optimizer`` keeps for ``t``, zeroed (a checkpoint loads into it): AdamW's,
    or SGD's momentum buffer (none without momentum)."""
    if isinstance(optimizer, torch.optim.SGD):
        if not optimizer.defaults.get("momentum"):
            return {}
        return {"momentum_buffer": torch.zeros_like(t, memory_format=torch.preserve_format)}
    return adamw_zero_state(t, optimizer)


def whole_state(model: nn.Module, optim: dict[str, dict[str, torch.Tensor]]) -> dict[str, Held]:
    """``held_state`` of a rank that holds ``model``'s parameters and the optimizer state
    ``optim`` ({name: {key: tensor}}) whole: ``model/<name>`` and ``optim/<name>/<key>``."""
    out = {}
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        out[f"model/{name}"] = Held.whole(p.detach(), spec)
        for key, t in optim.get(name, {}).items():
            out[f"optim/{name}/{key}"] = Held.whole(t, spec if t.dim() else REPLICATED)
    return out


def elementwise_keys(optimizer) -> tuple[str, ...]:
    """The state ``optimizer`` keeps per element of a tensor (not its scalar step):
    SGD's momentum buffer (none without momentum) or AdamW's two moments."""
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",) if optimizer.defaults.get("momentum") else ()
    return ("exp_avg", "exp_avg_sq")


class DataParallel:
    """Stage 0: every rank holds the whole model, its gradients and AdamW's state; the
    gradients are all-reduced over dp (module docstring)."""

    zero = 0

    def __init__(self, model: nn.Module, *, topo: Topology, cfg: DataParallelConfig,
                 make_optimizer: Callable, owns_grad=None, defer=(),
                 compression: GradCompression | None = None):  # fmt: skip
        self.model, self.topo, self.cfg = model, topo, cfg
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.owns_grad = owns_grad or (lambda p: True)
        reducer = compression.reducer if compression is not None else AllReduceGrads
        self.grads = reducer(model, topo=topo, cfg=cfg, defer=defer)
        self.optimizer = make_optimizer([(n, p, p) for n, p in self.named])

    # the interface (``engine.ShardEngine``)

    def finish(self) -> None:
        self.grads.finish()

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        return p.grad

    def grad_sq_local(self) -> torch.Tensor | float:
        # Gradients are replicated over dp: one dp rank counts them.
        if self.topo.dp_rank != 0:
            return 0.0
        return sq_sum(p.grad for _, p in self.named if self.owns_grad(p))

    def scale_grads_(self, factor: float) -> None:
        if factor != 1.0:
            torch._foreach_mul_([b.flat for b in self.grads.buckets], factor)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def held_state(self) -> dict[str, Held]:
        """Every parameter and its optimizer state whole (its tp shard), as live tensors;
        state the optimizer has not created yet is created as zeros to load into."""
        state = self.optimizer.state
        for _, p in self.named:
            if not state.get(p):
                state[p] = zero_state(self.optimizer, p)
        return whole_state(self.model, {n: state[p] for n, p in self.named})

    def state_loaded(self) -> None:
        """Nothing to do: ``held_state`` handed out the live tensors."""

    # this rank's shards of the parameters (``dp_algos`` average and mix them)

    def shards(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, the tensor the optimizer updates): here the parameter whole."""
        return [(n, p, p.detach()) for n, p in self.named]

    def shards_changed(self) -> None:
        """Nothing to rebuild: the shards are the parameters."""

    def shard_state(self, p: nn.Parameter) -> list[torch.Tensor]:
        """The optimizer's elementwise state of ``p``'s shard (``elementwise_keys`` order),
        created as zeros if the optimizer has not stepped it yet."""
        if not self.optimizer.state.get(p):
            self.optimizer.state[p] = zero_state(self.optimizer, p)
        state = self.optimizer.state[p]
        return [state[k] for k in elementwise_keys(self.optimizer)]

    def held_of(self, p: nn.Parameter, t: torch.Tensor) -> Held:
        """What this rank holds of a tensor shaped like ``p`` when it holds ``t`` (shaped like
        ``p``'s shard: here ``p`` whole)."""
        return Held.whole(t.reshape(p.shape), shard_spec(p))

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients (as of the last ``finish()``:
        they are freed between steps) and optimizer state."""
        params = tensor_bytes(p for _, p in self.named) + frozen_bytes(self.model)
        states = [t for s in self.optimizer.state.values() for t in s.values()]
        out = {"params": params, "grads": self.grads.grad_bytes, "optim": tensor_bytes(states)}
        out["total"] = sum(out.values())
        out["host"] = 0
        return out

    def close(self) -> None:
        self.grads.remove_hooks()
