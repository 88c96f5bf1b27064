"""ZeRO stage 3's parameters (``zero.py`` holds the engine): each parameter lives as this
rank's shard, in its unit's row; a unit -- the embedding, each transformer block, the
final norm and head -- is gathered whole before it runs and freed after, forward and
backward, by module and autograd hooks.

Communication (axis dp, over the shard group of d ranks; N trainable and F frozen
parameters on this rank, w bytes each on the wire: 4, or 2 under ``--dtype bf16`` /
``fp16``; m micro-batches per step; an all-gather counted as its output): one all-gather
per unit before its forward and again before its backward, every micro-batch, 2wm(N + F)
bytes per step (8m(N + F) in fp32); the next unit's gather is issued (prefetched) when a
unit starts, in forward order in the forward and in reverse order in the backward.
Nothing else (checkpoints read and write the shards, ``zero.py``): the gradients'
reduce-scatters are ``zero.py``'s. ``Gather`` is also the all-gather of rank-major rows
that stages 1-2 use for their parameters (``zero.py``). d == 1: nothing is issued (the
row is the whole unit; with no wire dtype to round to, the parameters live in the row
for good).
Under ``--ep`` two engines each build units of their own parameters on the same modules
(``structure``): the dense ones gathered over dp, the experts over edp; the order of
their gathers, and why it cannot deadlock, is ``expert_engine.py``'s.

Why it cannot deadlock under NCCL: every gather is issued with ``async_op=True`` from the
thread that runs the model (a forward pre-hook, or a tensor hook as the backward reaches
the unit's output) and waited on right before the
unit is used. All ranks of a shard group run the same model over the same schedule, and
autograd orders a backward deterministically, so they issue the same gathers in the same
order. An unused prefetch is waited on before it is dropped.

Memory: a unit's full parameters are flat buffers (``unit.buffers``, each parameter a
view into one, ``flat.FlatLayout``) whose storage is resized to zero while the unit is not
gathered; with frozen parameters (LoRA) a unit is freed once its trainable gradients and
its input's gradient are in. Under ``--dtype bf16`` / ``fp16`` the parameters only
``F.linear`` reads (``compute_dtype_params``) are held in the compute dtype -- FSDP2's
``param_dtype``: autocast would multiply by a compute-dtype copy of them anyway, so the
numbers are the same and the copy is gone, and so is the whole-model set of such copies
that autocast kept for the backward -- and the others (norms, embeddings) in fp32, read as
before; a block's gathered bytes are about half of fp32's. Checkpoints hold the fp32
shards (the masters), never a gathered unit.
"""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.parallel.data_parallel import model_chunks, tensor_bytes, weak_method
from plait.parallel.flat import FlatLayout, resize_storage, zero_shard
from plait.topology import Axis, Topology

# --- asynchronous gathers of rank-major rows ---------------------------------------------


class Gather:
    """An all-gather of every rank's row in flight: ``rows()`` waits and returns them,
    (n * row,), in ``dtype`` (the wire dtype: the row is cast to it first). ``start=False``
    makes it idle until ``start()``: a unit names its gather before the buffers exist, so
    they are the unit's from their allocation (``plait rehearse`` files them as buffers)."""

    def __init__(self, row: torch.Tensor, *, topo: Topology, dtype: torch.dtype | None = None,
                 start: bool = True):  # fmt: skip
        self.topo, self.row, self.dtype = topo, row, dtype
        self.src = self.out = self.handle = None
        if start:
            self.start()

    def start(self) -> None:
        row, dtype = self.row, self.dtype
        self.src = row if dtype in (None, row.dtype) else row.to(dtype)
        self.out = torch.empty(self.topo.dp * row.numel(), dtype=self.src.dtype, device=row.device)
        self.handle = comm.all_gather_into(self.out, self.src, topo=self.topo, axis=Axis.DP,
                                           async_op=True)  # fmt: skip
        self.row = None

    def rows(self) -> torch.Tensor:
        comm.wait([self.handle], topo=self.topo, what="all_gather", axis="dp")
        self.handle = self.src = None
        return self.out


# --- stage 3 parameters: gathered per unit, on demand --------------------------------------


def initial_value(p: nn.Parameter, device: torch.device) -> torch.Tensor:
    """``p``'s value on ``device``: its own, or -- for a parameter whose initialisation was
    deferred, as a ZeRO-3 model's is (``Trainer.build``; ``transformer.defer_init``, then
    ``hollow``) -- the initial value its ``init_value`` makes now (this rank's tp shard of
    the parameter)."""
    make = p.__dict__.pop("init_value", None)
    if make is not None:
        return make().to(device)
    return p.detach()


class Unit:
    """Parameters gathered and freed together (a block, the embedding, the norm + head).

    ``low``: the ids of parameters held gathered in ``compute_dtype`` (module docstring,
    Memory); the others are held in their own dtype (fp32)."""

    def __init__(self, name: str, params: list[nn.Parameter], *, n: int, rank: int,
                 compute_dtype: torch.dtype | None = None, low=frozenset(),
                 device: torch.device | None = None):  # fmt: skip
        self.name, self.params = name, params
        self.device = device if device is not None else params[0].device
        self.layout = FlatLayout.of(params, n=n, rank=rank)  # the rows gathered
        # one parameter at a time: a model built on meta is initialised here, shard by
        # shard (``initial_value``), and never exists whole
        shards = (zero_shard(initial_value(p, self.device), rank=rank, n=n) for p in params)
        like = torch.empty(0, dtype=params[0].dtype, device=self.device)
        self.row = self.layout.pack_row(shards, like=like)
        held = [compute_dtype if id(p) in low else p.dtype for p in params]
        # A shard group of one (``--ep`` with ep == dp: the experts' edp group) with no
        # wire dtype to round to (fp32 runs): the row is the whole unit, laid out as
        # ``_hold`` would lay it out (n == 1: one parameter after another), so the
        # parameters live in it for good -- never gathered, copied or freed; the
        # optimizer updates them. Under bf16 / fp16 the unit is still "gathered" by a
        # local cast, so that its parameters carry the wire's rounding as at n > 1.
        self.resident = n == 1 and compute_dtype in (None, self.row.dtype)
        if self.resident:
            self.buffers, self.slices = [self.row], self.layout.views(self.row)
            for p, view in zip(params, self.slices):
                p.data = view.view_as(p)
            self.nbytes = [self.row.untyped_storage().nbytes()]
        else:
            self._hold(params, held)  # from now on each p lives in a buffer of ``buffers``
            self.free_storage()  # ... which exists only while gathered
        self.gathered = self.resident
        self.pending: Gather | None = None
        self.trainable = [p for p in params if p.requires_grad]  # their gradients free it
        self.fired = 0
        # With frozen parameters (LoRA), the trainable gradients may all be in while the
        # frozen weights still carry the input gradient: then the unit also waits for the
        # gradient of its input (if that needs one) before it is freed.
        self.frozen = len(self.trainable) < len(params)
        self.grads_in = False
        self.waits_input = False
        self.next_forward: Unit | None = None
        self.next_backward: Unit | None = None

    def _hold(self, params, dtypes) -> None:
        """One flat buffer per dtype, each parameter a view into its dtype's buffer: the
        matrices one after another in unit order, then LoRA's factors, then the vectors. A
        module's q, k and v weights (llama's gate and up) then sit side by side, as do
        their biases, so that ``tensor.column_linears`` multiplies by the rows spanning
        them with no copy."""
        device = self.device
        self.buffers, self.slices = [], [None] * len(params)
        for dtype in dict.fromkeys(dtypes):
            idx = [i for i, d in enumerate(dtypes) if d == dtype]
            idx.sort(key=lambda i: (params[i].dim() < 2, hasattr(params[i], "lora_factor")))
            whole = FlatLayout.of([params[i] for i in idx])
            buf = torch.empty(whole.numel, dtype=dtype, device=device)
            self.buffers.append(buf)
            for i, view in zip(idx, whole.views(buf)):
                self.slices[i] = view
                params[i].data = view.view_as(params[i])
                # held only while its unit is gathered: nothing may keep a function of
                # it through the step (``tensor.quantised_linear``)
                params[i].gathered_per_use = True
        self.nbytes = [b.untyped_storage().nbytes() for b in self.buffers]

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the unit's parameters while gathered."""
        return sum(self.nbytes)

    def allocate(self) -> None:
        for buf, nbytes in zip(self.buffers, self.nbytes):
            resize_storage(buf, nbytes)

    def free_storage(self) -> None:
        for buf in self.buffers:
            resize_storage(buf, 0)


def structure(chunk: nn.Module) -> nn.Module:
    """The module whose submodules the units' hooks go on: ``chunk`` itself, or -- for a
    parameter subset (``expert_engine.ParamSubset``: an engine that owns only the dense
    parameters, or only the experts) -- the chunk it filters."""
    return getattr(chunk, "whole", chunk)


def _units_of(chunk: nn.Module, **kw) -> list[tuple[Unit, nn.Module, nn.Module]]:
    """(unit, entry module, exit module) of one chunk, in forward order of first use.

    A ``Transformer`` chunk: one unit per block. A chunk holding an untied model's
    embedding and head has two more, in the order they run: the embedding (gathered
    around its forward and backward, as a block is) and the final norm with the head
    (entered at the norm, left when the chunk returns) -- as FSDP2 wraps them in
    torchtitan, so that neither is held through the other's blocks (held as one, they
    stayed gathered through the whole forward and the whole backward: 0.73 GiB at 7B,
    3.1 GiB at a 128k vocabulary). Otherwise the other parameters (embedding, final norm,
    head, a tied embedding copy) form one unit, entered at the embedding (or, on a chunk
    without one, at the final norm) and left when the chunk returns -- a tied embedding is
    used at both ends. Any other module: one unit for all of it. Frozen
    parameters (a LoRA run's base) belong to units too: sharding them is what ZeRO-3
    offers fine-tuning; only their gradients and optimizer state do not exist. ``kw``:
    ``Unit``'s (shard count, rank, and what is held in the compute dtype).

    A parameter subset (``structure``) has the same units holding only its parameters,
    hooked on the same modules; a unit left empty is not made (under ``--ep``: the dense
    engine's block units and embedding, the experts' engine's one unit per MoE block).
    """
    whole = structure(chunk)
    mine = {id(p) for p in chunk.parameters()}
    params = [(name, p) for name, p in whole.named_parameters() if id(p) in mine]
    blocks = getattr(whole, "blocks", None)
    if blocks is None:
        return [(Unit("chunk", [p for _, p in params], **kw), whole, whole)] if params else []
    out, tail = [], []
    rest = [(name, p) for name, p in params if not name.startswith("blocks.")]
    pre, post = getattr(whole, "pre", False), getattr(whole, "post", False)
    tied = getattr(getattr(whole, "cfg", None), "tied_embeddings", True)
    if rest and pre and post and not tied:  # the embedding, and the final norm and head
        embed = [p for name, p in rest if name.startswith("embed.")]
        head = [p for name, p in rest if not name.startswith("embed.")]
        if embed:
            out.append((Unit("embed", embed, **kw), whole.embed, whole.embed))
        if head:
            tail.append((Unit("head", head, **kw), whole.norm, whole))
    elif rest:
        entry = whole.embed if pre else getattr(whole, "norm", whole)
        exit_ = whole if post else whole.embed
        out.append((Unit("rest", [p for _, p in rest], **kw), entry, exit_))
    for key, block in blocks.items():
        ps = [p for p in block.parameters() if id(p) in mine]
        if ps:
            out.append((Unit(f"blocks.{key}", ps, **kw), block, block))
    return out + tail


def compute_dtype_params(model: nn.Module, keep=()) -> set[int]:
    """Ids of the parameters that every module holding them reads only through
    ``F.linear`` (their ``autocast_params()``: the parallel linear layers' weights, the
    column-parallel biases, LoRA's factors) -- autocast multiplies by a compute-dtype copy
    of them anyway -- less ``keep`` (those whose gradient another component completes in
    ``p.grad``: it must stay fp32)."""
    listed, held = set(), {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            held.setdefault(id(p), []).append(module)
        if hasattr(module, "autocast_params"):
            listed |= {(id(module), id(p)) for p in module.autocast_params()}
    kept = {id(p) for p in keep}
    return {
        pid for pid, mods in held.items()
        if pid not in kept and all((id(m), pid) in listed for m in mods)
    }  # fmt: skip


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ParamUnits:
    """Stage 3: parameters live as this rank's shards (``unit.row``); a unit's full
    parameters exist only between its gather and its free (module docstring)."""

    def __init__(self, model: nn.Module, *, shard_topo: Topology, n: int, rank: int,
                 wire_dtype: torch.dtype | None = None, keep=()):  # fmt: skip
        self.shard_topo, self.wire_dtype = shard_topo, wire_dtype
        self.units: list[Unit] = []
        self._hooks = []
        low = set()  # held in the compute dtype (the wire's, when it is not fp32)
        if wire_dtype not in (None, torch.float32):
            low = compute_dtype_params(structure(model), keep)  # (a subset: its model's)
        for chunk in model_chunks(model):
            found = _units_of(chunk, n=n, rank=rank, compute_dtype=wire_dtype, low=low,
                              device=shard_topo.device)  # fmt: skip
            kinds: dict[str, list[Unit]] = {}  # "embed", "blocks", "head" or "rest"
            for u, _, _ in found:
                kinds.setdefault(u.name.split(".")[0], []).append(u)
            embed, blocks, head, rest = (
                kinds.get(k, []) for k in ("embed", "blocks", "head", "rest")
            )
            whole = structure(chunk)
            pre, post = getattr(whole, "pre", True), getattr(whole, "post", True)
            fwd = embed + (rest if pre else []) + blocks + head + (rest if post and not pre else [])
            top = head + (rest if post else [])  # the backward starts at the loss
            bwd = top + blocks[::-1] + embed + (rest if pre and not post else [])
            for order, attr in ((fwd, "next_forward"), (bwd, "next_backward")):
                for a, b in zip(order, order[1:]):
                    setattr(a, attr, b)
            for unit, entry, exit_ in found:
                i = len(self.units)  # hooks name units by index (see ``weak_method``)
                self.units.append(unit)
                self._hooks += [
                    entry.register_forward_pre_hook(weak_method(self, "_forward_pre", i)),
                    exit_.register_forward_hook(weak_method(self, "_forward_post", i)),
                ]
                hook = weak_method(self, "_grad_ready", i)
                for p in unit.trainable:
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    @property
    def shards(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's shard on this rank: a view into its unit's row."""
        out = {}
        for unit in self.units:
            out.update(zip(unit.params, unit.layout.views(unit.row)))
        return out

    # gather / free

    def _start(self, unit: Unit) -> None:
        unit.pending = Gather(unit.row, topo=self.shard_topo, dtype=self.wire_dtype, start=False)
        unit.pending.start()

    def prefetch(self, unit: Unit | None) -> None:
        if unit is not None and not unit.gathered and unit.pending is None:
            self._start(unit)

    def gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        if unit.pending is None:
            self._start(unit)
        try:  # the gathered rows stay the unit's pending buffer until copied out of
            flat = unit.pending.rows()
            unit.allocate()
            unit.layout.unpack(flat, unit.slices)
        finally:
            unit.pending = None
        unit.gathered = True

    def free(self, unit: Unit) -> None:
        if unit.resident:
            return
        if unit.pending is not None:  # an unused prefetch: let it finish, drop the result
            unit.pending.rows()
            unit.pending = None
        unit.free_storage()
        unit.gathered = False

    # hooks

    def _forward_pre(self, i: int, module, args) -> None:
        unit = self.units[i]
        self.gather(unit)
        self.prefetch(unit.next_forward)
        x = args[0] if args else None
        if unit.frozen and isinstance(x, torch.Tensor) and x.requires_grad and not _in_backward():
            unit.waits_input = True
            x.register_hook(weak_method(self, "_input_grad", i))

    def _forward_post(self, i: int, module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(weak_method(self, "_backward_pre", i))
        if not _in_backward():  # (a recomputed forward keeps its parameters)
            self.free(self.units[i])

    def _backward_pre(self, i: int, grad) -> None:
        unit = self.units[i]
        self.free_frozen(but=unit)  # a frozen unit's backward ends where the next begins
        self.gather(unit)
        self.prefetch(unit.next_backward)

    def _grad_ready(self, i: int, _param) -> None:
        unit = self.units[i]
        unit.fired += 1
        if unit.fired == len(unit.trainable):  # this micro-batch's backward is done with it
            unit.fired = 0
            unit.grads_in = True
            self._release(unit)

    def _input_grad(self, i: int, _grad) -> None:
        unit = self.units[i]
        unit.waits_input = False
        self._release(unit)

    def _release(self, unit: Unit) -> None:
        if unit.grads_in and not unit.waits_input:
            unit.grads_in = False
            self.free(unit)

    def free_frozen(self, but: Unit | None = None) -> None:
        """Free the gathered units no gradient frees: all frozen ones (``but`` aside) and,
        at the end of the backward (``but`` None), any with frozen parameters."""
        for unit in self.units:
            if (
                unit.gathered
                and unit is not but
                and (not unit.trainable or but is None and unit.frozen)
            ):
                unit.grads_in = unit.waits_input = False
                self.free(unit)

    def nbytes(self) -> int:
        return tensor_bytes(u.row for u in self.units)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
