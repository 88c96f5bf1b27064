"""ZeRO (Rajbhandari et al. 2020): optimizer state (stage 1), gradients (2) and parameters
(3) sharded over the data-parallel ranks; optionally the optimizer on the CPU (ZeRO-Offload)
and sharding within groups of K dp ranks only, replicated across groups (hybrid, HSDP).
This module holds the engine, its gradient reduce-scatter and its sharded optimizer;
which rank holds which range of a parameter, and the rank-major buffers, are
``flat.py``'s; stage 3's parameter units and their hooks are ``zero_units.py``'s.

Communication (axis dp; d = ranks a shard is spread over: K with ``--zero-shard-group K``,
else dp; R = dp / d replicas; N = trainable parameters on this rank, 4 bytes each; m
micro-batches per step; counted bytes as ``comm.py`` counts them -- all-gather its output,
reduce-scatter its input):

- stage 1: backward of the last micro-batch: the stage-0 bucketed all-reduce over all dp
  ranks (``data_parallel.py``), 4N bytes; optimizer step: each rank updates its 1/d of
  every parameter, then one all-gather per bucket over the shard group, 4N bytes.
- stage 2: the backward of every micro-batch: one reduce-scatter per bucket over the shard
  group as each bucket completes, 4N bytes a micro-batch (4mN a step), after which the
  full gradients are freed and the rows summed (HSDP: after the last micro-batch's, one
  all-reduce per bucket over the R replicas, 4N/d bytes); step: one all-gather per
  bucket, 4N bytes. With one micro-batch, the volume of stage 0 on the wire: (d-1)/d x
  4N for each of the reduce-scatter and the all-gather.
- stage 3 (the units' hooks: ``zero_units.py``): one all-gather per unit (the embedding,
  each transformer block, the final norm and head) before its forward and again before
  its backward, every micro-batch: 8mN bytes per step (8m(N + F) with F frozen parameters
  -- a LoRA run's base, which is sharded and gathered like the rest but has no gradient
  to reduce and no optimizer state); the next unit's gather is issued (prefetched) when a
  unit starts, and a unit's full parameters are freed after its forward and after its
  backward. Gradients:
  one reduce-scatter per unit in every micro-batch's backward, 4mN bytes a step (HSDP: +
  an all-reduce of 4N/d after the last). Nothing after the step.
- stages 0 and 1: earlier micro-batches reduce nothing (gradients accumulate unsharded,
  the size of the weights every rank holds anyway); stages 2 and 3 reduce every
  micro-batch's, so that no rank ever holds more than a bucket's full gradient beyond its
  shards (accumulated unsharded: the whole model's fp32 gradient, 700 GB at 175B).
- checkpoints: nothing at a save (each rank writes its own shards, ``held_state``); after
  a load, stages 1-2 re-gather the parameters (one all-gather per bucket, 4N bytes).
- d == 1: nothing is issued for the shard group; R == 1: nothing across replicas.

The sharding of a parameter is defined once, by ``flat.shard_range``: the parameter
flattened, padded to a multiple of d, cut into d equal shards; rank i holds shard i (its
real part, without the padding). It depends only on the parameter's size and d -- not on
which other parameters share its bucket -- so gradient buckets and stage-3 parameter units
can group parameters differently, pipeline stages' tied embedding copies shard alike, and
a checkpoint finds a shard's place in the whole tensor from it (``parallel/held.py``). A bucket's flat buffer is
rank-major (``flat.FlatLayout`` with d rows): row i is rank i's shard of each parameter in
turn, so one reduce-scatter leaves each rank exactly its shards, and one all-gather
rebuilds them all.

Mixed precision (FSDP2's policy): under ``--dtype bf16`` / ``fp16`` stage 3 gathers each
unit in the compute dtype -- half the bytes (counted so) -- from its fp32 shards, which stay
the master weights the optimizer updates, and holds the linear layers' weights in it
(``zero_units.py``: the same numbers autocast computes with). Their gradients arrive in
that dtype and are summed over micro-batches and reduce-scattered in fp32
(``ReduceScatterGrads``). Stages 1-2 gather the updated fp32 parameters themselves.

Order and overlap, and why this cannot deadlock under NCCL. Every collective is issued
with ``async_op=True`` from the thread that runs the model -- the training loop (stage-1/2
parameter gathers after the step, checkpoint gathers), module forward hooks (stage-3
gathers and the prefetch of the next unit) or autograd's hooks (gradient reduce-scatters
as each bucket's last gradient arrives, stage-3 gathers for the backward) -- and its
handle is waited on right before the result is read (``finish()``, or the unit's next use).
So the backward's reduce-scatters and the next unit's gather overlap compute (on GPU they
run on NCCL's stream). Hooks fire in the same order on every rank of a shard group: all of
them run the same model over the same schedule, and autograd orders a backward
deterministically. Hence every rank issues the same collectives in the same order on each
group, which is all NCCL needs; HSDP's replica all-reduce of a bucket is issued when its
last micro-batch's reduce-scatter completes -- in launch order, the same on every rank --
and a compressed one by ``finish()`` in bucket order. A bucket relaunched in the next
micro-batch first completes its previous reduce-scatter (its row is summed in order).
No thread pool is involved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.parallel.data_parallel import (
    AllReduceGrads,
    Bucket,
    DataParallelConfig,
    GradCompression,
    GradReducer,
    adamw_zero_state,
    elementwise_keys,
    frozen_bytes,
    sq_sum,
    tensor_bytes,
)
from plait.parallel.flat import FlatLayout, zero_shard
from plait.parallel.held import Held
from plait.parallel.tensor import shard_spec
from plait.parallel.zero_units import Gather, ParamUnits
from plait.topology import Axis, Topology

# --- stage 2 and 3 gradients: reduce-scatter into shards ----------------------------------


class ReduceScatterGrads(GradReducer):
    """Each bucket's gradients are packed rank-major, freed, and reduce-scattered over the
    shard group into a row holding this rank's shards -- in every micro-batch's backward,
    as the bucket completes, the rows summed in fp32 (``bucket.flat``), so no rank holds
    more than a bucket's full gradient beyond its shards (accumulated unsharded, the
    micro-batches would hold the whole model's fp32 gradient: 25 GiB a rank at 7B, 700 GB
    at 175B). HSDP: after the last micro-batch's, the row is summed over the replicas
    once. After ``finish()``, ``shard[p]`` is the view of ``p``'s shard.

    Gradients are reduced in fp32 whatever the parameter's dtype. A parameter held in the
    compute dtype (stage 3 under bf16 / fp16) gets its gradient from autograd in that dtype
    -- the values autocast's cast would have carried back to an fp32 parameter -- packed
    into fp32 per micro-batch; the micro-batches add up in fp32 in the row.

    A bucket whose hooks do not fire (deferred: a pipeline's tied copies) accumulates in
    ``p.grad`` and goes from ``finish()`` with the last micro-batch's. A parameter without
    a gradient in some micro-batch (an expert no token reached) shifts its bucket's count:
    the bucket then completes later, with what has arrived, and whatever arrives after a
    launch is packed by the next one -- every gradient once; the last launch comes when
    every hook has fired m times, or from ``finish()``.

    At most ``in_flight`` packed inputs exist: packing one more first completes the
    oldest reduce-scatter (``_complete``, launch order), which frees its input. Kept
    until ``finish()`` instead, those inputs would add up to the whole model's fp32
    gradient by the end of the backward; FSDP2 bounds them the same way. And once an
    earlier micro-batch's backward has launched every hooked bucket, all its
    reduce-scatters are completed (FSDP2's ``finalize_backward``): left pending, the last
    units' inputs would be held through the next forward's activation peak (1.5 GiB at
    llama2-7b). The order is the hooks' launch order, the same on every rank of a
    group, so the waits (and HSDP's all-reduce over the replicas) come in the same order
    everywhere; completing is only waiting, and issues nothing but HSDP's all-reduce
    after a bucket's last micro-batch -- in launch order, as the in-flight bound's
    completions do. A compressed sum
    across shard groups (``dp_algos``' ``Across``) is called in bucket order from
    ``finish()``, on the summed rows."""

    grad_dtype = torch.float32
    in_flight = 2

    def __init__(self, model, *, topo, cfg, defer, shard_topo: Topology, across_topo, n, rank,
                 groups=None, across=None):  # fmt: skip
        self.groups = groups
        self.across = across  # HSDP: reduces a shard over the replicas (default all-reduce)
        self.n, self.rank = n, rank  # each bucket's buffer: n rows (``flat.py``)
        super().__init__(model, topo=topo, cfg=cfg, defer=defer)
        self.shard_topo, self.across_topo = shard_topo, across_topo
        self.shards: dict[nn.Parameter, torch.Tensor] = {}
        self.pending: list[Bucket] = []  # launched, not completed: launch order
        self._hooked = sum(not b.deferred for b in self.buckets)
        self._done: dict[int, int] = {}  # micro-batch -> buckets its backward launched

    def _completed(self, bucket: Bucket, last: bool) -> None:
        """Every micro-batch's backward launches the bucket (class docstring); once an
        earlier micro-batch's backward is done with every bucket, its reduce-scatters are
        completed before the next forward."""
        self._launch(bucket, last=last)
        if last:
            return  # ``finish()`` follows
        k = bucket.microbatches
        self._done[k] = self._done.get(k, 0) + 1
        if self._done[k] == self._hooked:
            del self._done[k]
            while self.pending:
                self._complete(self.pending[0])

    def finish(self) -> None:
        """The last launches, every wait, then the compressed sums across shard groups."""
        super().finish()
        if self.across is not None and self.across_topo is not None:
            for bucket in self.buckets:
                self.across(bucket.flat, bucket.layout, bucket.params)

    def _make_buckets(self, params, *, deferred):
        if self.groups is None or deferred:
            return super()._make_buckets(params, deferred=deferred)
        mine = {id(p) for p in params}  # stage 3: one bucket per parameter unit
        runs = [b for g in self.groups if (b := [p for p in g if id(p) in mine])]
        return [Bucket(b, self._layout(b)) for b in runs]

    def _layout(self, params) -> FlatLayout:
        """Rank-major rows: one reduce-scatter leaves each rank its shards."""
        return FlatLayout.of(params, n=self.n, rank=self.rank)

    def _launch(self, bucket: Bucket, last: bool = True) -> None:
        if bucket.handle is not None:  # its previous micro-batch's, still in flight
            self._complete(bucket)
        while len(self.pending) >= self.in_flight:  # the oldest's input goes before this one's
            self._complete(self.pending[0])
        like = torch.empty(0, dtype=self.grad_dtype, device=bucket.params[0].device)
        flat = bucket.layout.pack([p.grad for p in bucket.params], like=like)
        for p in bucket.params:
            p.grad = None  # the full gradient is no longer needed
        shard = torch.empty(
            flat.numel() // self.shard_topo.dp, dtype=flat.dtype, device=flat.device
        )
        handle = comm.reduce_scatter_into(shard, flat, topo=self.shard_topo, axis=Axis.DP,
                                          async_op=True)  # fmt: skip
        bucket.handle = (handle, flat, shard, last)  # the input lives until it is done
        bucket.launched = bucket.launched or last
        self.pending.append(bucket)

    def _complete(self, bucket: Bucket) -> None:
        if bucket.handle is None:  # completed when a later bucket launched
            return
        self.pending = [b for b in self.pending if b is not bucket]
        handle, _, shard, last = bucket.handle
        bucket.handle = None  # the packed input goes
        comm.wait([handle], topo=self.shard_topo, what="reduce_scatter", axis="dp")
        bucket.flat = shard if bucket.flat is None else bucket.flat.add_(shard)
        if not last:
            return
        if self.across_topo is not None and self.across is None:  # HSDP: over the replicas
            comm.all_reduce(bucket.flat, topo=self.across_topo, axis=Axis.DP)
        self.shards.update(zip(bucket.params, bucket.layout.views(bucket.flat)))

    def zero_grad(self) -> None:
        super().zero_grad()
        self.shards.clear()
        self._done.clear()


# --- the optimizer on shards ---------------------------------------------------------------


class ShardedOptimizer:
    """AdamW over this rank's shards: ``shards[p]`` (views into the parameters or into
    the stage-3 rows) with gradients ``grads[p]``. Elementwise, so the same numbers as
    AdamW over whole parameters. Offload: fp32 master shards and AdamW's state in (pinned)
    host memory; gradients go down, updated shards come back."""

    def __init__(self, named, shards: dict, *, make_optimizer: Callable, offload: bool,
                 device: torch.device):  # fmt: skip
        self.named = named
        self.shards, self.offload, self.device = shards, offload, device
        pin = offload and device.type == "cuda"
        self.targets = {}
        for _, p in named:
            t = shards[p]
            if offload:
                t = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                t.copy_(shards[p])
            self.targets[p] = t
        self.optimizer = make_optimizer([(name, self.targets[p], p) for name, p in named])
        for _, p in named:  # state up front: checkpoints load into it, memory is counted
            self.optimizer.state[self.targets[p]] = adamw_zero_state(
                self.targets[p], self.optimizer
            )

    def step(self, lr: float, grads: dict) -> None:
        """One AdamW step of every shard, with ``grads[p]`` (this rank's gradient shards)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for _, p in self.named:  # offload: the gradients go down to the host
            self.targets[p].grad = (
                grads[p].to("cpu", non_blocking=True) if self.offload else grads[p]
            )
        if self.offload:  # the host reads them next
            host_waits_for_copies(self.device)
        self.optimizer.step()
        if self.offload:  # ... and the updated shards come back
            # No wait: the device's stream runs these copies before any kernel that reads
            # the shards, and the host next writes the masters in the next step's
            # optimizer step, after that step's wait (or in ``reload_masters``, a copy
            # queued behind these).
            for _, p in self.named:
                self.shards[p].copy_(self.targets[p], non_blocking=True)
        for t in self.targets.values():
            t.grad = None

    def state(self, p) -> dict[str, torch.Tensor]:
        return self.optimizer.state[self.targets[p]]

    def reload_masters(self) -> None:
        """Offload: copy the shards into the host masters (after a checkpoint has been
        loaded into the parameters; otherwise the masters are the truth)."""
        if self.offload:
            for _, p in self.named:
                self.targets[p].copy_(self.shards[p])

    def nbytes(self) -> dict[str, int]:
        states = tensor_bytes(t for s in self.optimizer.state.values() for t in s.values())
        masters = tensor_bytes(self.targets.values()) if self.offload else 0
        return {"device": 0, "host": states + masters} if self.offload else {"device": states}


def host_waits_for_copies(device: torch.device) -> None:
    """Before the host reads what non-blocking device-to-host copies wrote: wait for an
    event recorded behind them on the stream that queued them -- those copies and what
    preceded them there, not every stream of the device (``torch.cuda.synchronize``).
    Nothing to wait for on the CPU, where copies are done when they return."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        done.synchronize()


# --- the engine ----------------------------------------------------------------------------


class ZeroDataParallel:
    """Stages 1-3 behind the engine interface (``engine.ShardEngine``)."""

    def __init__(self, model: nn.Module, *, topo: Topology, cfg: DataParallelConfig,
                 make_optimizer: Callable, owns_grad=None, defer=(),
                 compression: GradCompression | None = None):  # fmt: skip
        self.model, self.topo, self.cfg, self.zero = model, topo, cfg, cfg.zero
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.owns_grad = owns_grad or (lambda p: True)
        self.shard_topo, self.across_topo = topo.shard_groups(cfg.shard_group or topo.dp)
        self.n = self.shard_topo.dp
        self.rank = topo.dp_rank % self.n
        self.counts_norm = topo.dp_rank // self.n == 0  # the first replica of each shard
        self.units = None
        if self.zero == 3:
            self.units = ParamUnits(model, shard_topo=self.shard_topo, n=self.n, rank=self.rank,
                                    wire_dtype=cfg.gather_torch_dtype, keep=defer)  # fmt: skip
            shards = self.units.shards
        else:
            shards = {p: zero_shard(p.detach(), rank=self.rank, n=self.n) for _, p in self.named}
        if self.zero == 1:
            reducer = compression.reducer if compression is not None else AllReduceGrads
            self.grads = reducer(model, topo=topo, cfg=cfg, defer=defer)
        else:
            groups = [u.params for u in self.units.units] if self.units else None
            across = None
            if compression is not None and self.across_topo is not None:
                across = compression.across(self.across_topo)
            self.grads = ReduceScatterGrads(
                model, topo=topo, cfg=cfg, defer=defer, shard_topo=self.shard_topo,
                across_topo=self.across_topo, n=self.n, rank=self.rank, groups=groups,
                across=across,
            )  # fmt: skip
        self.optimizer = ShardedOptimizer(
            self.named, shards, make_optimizer=make_optimizer,
            offload=cfg.offload_optimizer, device=topo.device,
        )  # fmt: skip
        # How parameters (stages 1-2) and optimizer state are gathered: by gradient bucket,
        # or by unit for stage 3 (its trainable parameters: only they have state).
        groups = [u.trainable for u in self.units.units if u.trainable] if self.units else [
            b.params for b in self.grads.buckets
        ]  # fmt: skip
        self.gather_groups = [(g, FlatLayout.of(g, n=self.n, rank=self.rank)) for g in groups]

    # the interface

    def finish(self) -> None:
        self.grads.finish()
        if self.units is not None:
            self.units.free_frozen()

    def grad(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's shard of ``p``'s reduced gradient (after ``finish()``)."""
        if self.zero == 1:  # all-reduced whole: the shard is a view into it
            return zero_shard(p.grad, rank=self.rank, n=self.n)
        return self.grads.shards[p]

    def _grad_shards(self) -> dict:
        return {p: self.grad(p) for _, p in self.named}

    def grad_sq_local(self) -> torch.Tensor | float:
        if not self.counts_norm:
            return 0.0
        return sq_sum(self.grad(p) for _, p in self.named if self.owns_grad(p))

    def scale_grads_(self, factor: float) -> None:
        if factor == 1.0:
            return
        if self.zero == 1:
            shards = [g for g in self._grad_shards().values() if g.numel()]
        else:
            shards = [b.flat for b in self.grads.buckets]
        torch._foreach_mul_(shards, factor)

    # set for a step whose dp algorithm rewrites the shards after it and then gathers
    # (``DPAlgorithm.rewrites_shards``): the gather here would be overwritten unused
    gather_deferred = False

    def step(self, lr: float) -> None:
        self.update_shards(lr)
        if self.zero in (1, 2) and not self.gather_deferred:
            self.gather_params()

    # the two halves of a step (the resilient engine runs them apart)

    def update_shards(self, lr: float) -> None:
        """One optimizer step of this rank's shards with their reduced gradients (after
        ``finish()``). Issues nothing: stages 1-2 then ``gather_params()``."""
        self.optimizer.step(lr, self._grad_shards())

    gathers_in_flight = 2  # ``gather_params``: the whole buckets held at once

    def gather_params(self) -> None:
        """Whole parameters from every rank's shards (stages 1-2; collective over the shard
        group): one all-gather per bucket, in bucket order on every rank, at most
        ``gathers_in_flight`` of them at once -- issuing one more first unpacks the oldest
        (its wait comes before the next issue on every rank, the same order everywhere).
        Issued all together they held a whole copy of the rank's parameters (175B tp 8
        pp 16: 5.45 GiB) beside them at the step; two 25 MiB buckets now."""
        pending: list = []

        def unpack_oldest() -> None:
            (params, layout), gather = pending.pop(0)
            with torch.no_grad():
                layout.unpack(gather.rows(), [p.detach() for p in params])

        for group in self.gather_groups:  # in bucket order
            if len(pending) >= self.gathers_in_flight:
                unpack_oldest()
            params, layout = group
            shards = [zero_shard(p.detach(), rank=self.rank, n=self.n) for p in params]
            row = layout.pack_row(shards, like=params[0])
            pending.append((group, Gather(row, topo=self.shard_topo)))
        while pending:
            unpack_oldest()

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def held_state(self) -> dict[str, Held]:
        """What this rank holds (``parallel/held.py``), as live tensors: its shard of each
        trainable parameter and of its optimizer state; the frozen parameters (LoRA's
        base) sharded too under stage 3, whole under stages 1-2. A load writes into these:
        then ``state_loaded()``."""
        out, shards = {}, self.units.shards if self.units else {}
        trainable = dict((p, n) for n, p in self.named)
        for name, p in self.model.named_parameters():
            spec = shard_spec(p)
            shard = self.optimizer.shards[p] if p in trainable else shards.get(p)
            if shard is None:  # frozen, stages 1-2: whole on every rank
                out[f"model/{name}"] = Held.whole(p.detach(), spec)
                continue
            out[f"model/{name}"] = Held.zero(shard, shape=p.shape, rank=self.rank, n=self.n,
                                             spec=spec)  # fmt: skip
            if p not in trainable:
                continue
            for key, t in self.optimizer.state(p).items():
                out[f"optim/{name}/{key}"] = (
                    Held.zero(t, shape=p.shape, rank=self.rank, n=self.n, spec=spec)
                    if t.dim() else Held.whole(t)
                )  # fmt: skip
        return out

    def state_loaded(self) -> None:
        """After a checkpoint was loaded into ``held_state``'s tensors: the shards are new
        (offloaded masters re-read them; stages 1-2 re-gather the parameters)."""
        self.shards_changed()

    def held_of(self, p: nn.Parameter, t: torch.Tensor) -> Held:
        """What this rank holds of a tensor shaped like ``p`` when it holds ``t``, a tensor
        shaped like its shard of ``p`` (``dp_algos`` state): for checkpoints."""
        return Held.zero(t.reshape(-1), shape=p.shape, rank=self.rank, n=self.n,
                         spec=shard_spec(p))  # fmt: skip

    def shards(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, this rank's shard of it: the tensor the optimizer updates)."""
        return [(name, p, self.optimizer.shards[p]) for name, p in self.named]

    def shards_changed(self) -> None:
        """After the shards were written (``dp_algos``): stages 1-2 re-gather the
        parameters over the shard group; offloaded masters take the new values."""
        self.optimizer.reload_masters()
        if self.zero in (1, 2):
            self.gather_params()

    def shard_state(self, p: nn.Parameter) -> list[torch.Tensor]:
        """The optimizer's elementwise state of this rank's shard of ``p``
        (``elementwise_keys`` order; on the host under offload), zeros if not stepped yet."""
        state = self.optimizer.state(p)
        keys = elementwise_keys(self.optimizer.optimizer)
        for k in keys:
            if k not in state:
                state[k] = torch.zeros_like(self.optimizer.targets[p])
        return [state[k] for k in keys]

    def model_state_bytes(self) -> dict[str, int]:
        params = self.units.nbytes() if self.units else tensor_bytes(p for _, p in self.named)
        if self.units is None:  # a LoRA run's base, held whole (stage 3: in the units)
            params += frozen_bytes(self.model)
        optim = self.optimizer.nbytes()
        # gradients as of the last finish(): they are freed between steps
        out = {"params": params, "grads": self.grads.grad_bytes, "optim": optim["device"]}
        out["total"] = sum(out.values())
        out["host"] = optim.get("host", 0)
        return out

    def close(self) -> None:
        self.grads.remove_hooks()
        if self.units is not None:
            self.units.remove_hooks()
