"""Megatron-style tensor parallelism (+ sequence parallelism): the layers the model is built from.

Communication (axis tp, t = tp size; per transformer layer and micro-batch of b sequences of
s tokens, hidden h, e bytes per activation element; bytes as ``comm.py`` counts them: an
all-reduce counts its tensor, an all-gather its output, a reduce-scatter its input, so each
line below moves b*s*h*e counted bytes per call):

- without sequence parallelism, forward: 2 all-reduces (g after attention's output
  projection and after the MLP's second GEMM), 2*b*s*h*e bytes; backward: 2 all-reduces
  of the input gradient (f before q/k/v -- one for the three -- and before the MLP's first
  GEMM(s)), 2*b*s*h*e bytes.
- with sequence parallelism (``--sequence-parallel``) each f becomes an all-gather of the
  sequence shards forward / reduce-scatter backward, and each g a reduce-scatter forward /
  all-gather backward: forward 2 all-gathers + 2 reduce-scatters, backward 2 reduce-scatters
  + 2 all-gathers, 4*b*s*h*e bytes each way. The all-reduce's ring cost is exactly one
  all-gather plus one reduce-scatter, so the traffic is the same; activations outside the
  GEMMs (norms, dropout, residual) are stored and computed 1/t each. The column groups
  (q/k/v, the MLP's first GEMMs or a MoE block's router, the head) keep their input as
  this rank's sequence shard, not gathered (``keeping_shard``), and the backward
  all-gathers it again: 2 more all-gathers of b*s*h*e a layer, 1 for the head -- none
  in the blocks under ``--recompute full``, whose checkpoint re-runs the forward's
  gathers instead.
- embedding (vocabulary-parallel): forward 1 all-reduce of b*s*h*e (sequence parallel: a
  reduce-scatter; backward then 1 all-gather of b*s*h*e).
- head: forward nothing (sequence parallel: 1 all-gather of b*s*h*e); backward 1
  all-reduce of b*s*h*e (sequence parallel: a reduce-scatter).
- vocabulary-parallel cross-entropy, forward: 2 all-reduces, the per-token max (4*b*s
  bytes) then the target logit and the sum of exponentials together (8*b*s bytes); no
  backward communication. The logits are never gathered.
- per optimizer step (``TPGradSync.finish``): 1 all-reduce of 4*(R + K) bytes, R the
  tp-replicated parameters that saw only a sequence shard (sequence parallelism: norms,
  row-parallel biases, learned positions) and K the full size of the key/value weights that
  are replicated because there are fewer key/value heads than tp ranks; with LoRA adapters
  (``model/lora.py``) R also holds each adapter's tp-replicated factor. Nothing when all
  are empty.
- why it cannot deadlock: every collective here is issued on the tp group by the main
  thread's forward or by autograd's backward, in the order of the block's operations --
  a group's re-gather when the backward reaches its row-parallel exit (issued there
  without waiting, on every rank at the same point of the same graph: after the exit's
  own collective, before any other tp call of the block's backward) or, without an exit
  to start it, when the first op that saved the input runs -- and every tp rank builds
  the same graph (same layers, shapes and flags), so every rank issues the same calls in
  the same order; none is conditional on data one rank alone holds. An issued re-gather
  is waited on by the first op that unpacks the input, before the group's own
  reduce-scatter is issued.
- with t == 1 nothing is issued; ``--recompute full`` repeats the forward's collectives
  inside the backward.
- e is the residual stream's dtype for what enters a tp region (f, the sequence-parallel
  all-gather, the embedding's reduction, the head's entry) and the compute dtype for what
  leaves it (g): both the compute dtype under ``--dtype bf16|fp16``, except that
  ``--fp32-residual`` keeps the stream, and so the entries, in fp32 (4 bytes).

Every weight has a ``ShardSpec``: which dimension is split over tp and how. ``tp_shard``
cuts a full weight into the shard a tp rank holds; the initialiser, the checkpoint code and
the Hugging Face converter all use it, so a tp=2 run starts from exactly the tp=1 weights.
A vocabulary that tp does not divide is padded (Megatron-style) with zero rows at its end;
the checkpoint still holds the unpadded tensor and the loss ignores the padded entries.

Randomness: dropout outside tp regions (the replicated residual stream) draws from the
default generator, identical on every tp rank; dropout inside a tp region (attention
probabilities of this rank's heads, or anything on a sequence shard) draws a per-shard
stream (``tp_shard_rng``).

Shape letters: B batch, T tokens per sequence, C hidden, N tokens (B*T), V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.parallel.flat import FlatLayout
from plait.topology import Axis, Topology

SEQ_DIM = 1  # sequence parallelism splits activations (B, T, C) along T
IGNORE_INDEX = -100  # a target that takes no loss: F.cross_entropy's default (data.sampler's)


@dataclass(frozen=True)
class ShardSpec:
    """``dim`` is split into ``tp // replicas`` parts; tp rank r holds part ``r // replicas``.

    ``dim=None``: replicated on every tp rank. ``replicas > 1`` serves key/value heads when
    there are fewer of them than tp ranks: each head is then held by ``replicas`` ranks.
    ``size``: the true (unpadded) length of ``dim`` when it may be padded with zeros up to a
    multiple of the parts (the vocabulary); None: it must divide evenly.
    """

    dim: int | None = None
    replicas: int = 1
    size: int | None = None


REPLICATED = ShardSpec()


def vocab_spec(vocab_size: int) -> ShardSpec:
    """Rows split over tp, padded to a multiple of tp (embedding and output head)."""
    return ShardSpec(dim=0, size=vocab_size)


def set_shard(p: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    p.shard_spec = spec
    return p


def shard_spec(p: torch.Tensor) -> ShardSpec:
    return getattr(p, "shard_spec", REPLICATED)


def local_size(n: int, spec: ShardSpec, tp: int) -> int:
    """Length of the split dimension on one tp rank: ``local_size(257, vocab_spec(257), 4)``
    is 65 (the vocabulary padded to 260)."""
    parts = tp // spec.replicas
    if spec.size is not None:
        return math.ceil(n / parts)
    if n % parts:
        raise ValueError(f"dimension of size {n} not divisible by {parts}")
    return n // parts


def tp_shard(full: torch.Tensor, spec: ShardSpec, *, tp_rank: int, tp: int) -> torch.Tensor:
    """The one sharding function: the slice of ``full`` that ``tp_rank`` of ``tp`` holds."""
    if spec.dim is None or tp == 1:
        return full
    parts = tp // spec.replicas
    n = full.shape[spec.dim]
    local = local_size(n, spec, tp)
    if local * parts != n:  # padded: zero rows appended at the end of the dimension
        pad = list(full.shape)
        pad[spec.dim] = local * parts - n
        full = torch.cat([full, full.new_zeros(pad)], dim=spec.dim)
    return full.narrow(spec.dim, (tp_rank // spec.replicas) * local, local)


def full_shape(local_shape: torch.Size, spec: ShardSpec, tp: int) -> tuple[int, ...]:
    """The unpadded full shape of a tensor whose shard has ``local_shape``."""
    shape = list(local_shape)
    if spec.dim is not None:
        shape[spec.dim] = (
            spec.size if spec.size is not None else shape[spec.dim] * (tp // spec.replicas)
        )
    return tuple(shape)


def tp_gather(local: torch.Tensor, spec: ShardSpec, *, topo: Topology) -> torch.Tensor:
    """Inverse of ``tp_shard``: the full tensor, from every tp rank's shard (collective)."""
    if spec.dim is None or topo.tp == 1:
        return local
    parts = comm.all_gather(local.contiguous(), topo=topo, axis=Axis.TP, dim=spec.dim)
    if spec.replicas > 1:
        chunks = parts.chunk(topo.tp, dim=spec.dim)[:: spec.replicas]
        parts = torch.cat(chunks, dim=spec.dim)
    if spec.size is not None:
        parts = parts.narrow(spec.dim, 0, spec.size)
    return parts


# --- the conjugate pairs ----------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, topo=ctx.topo, axis=Axis.TP)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, topo):
        x = x.contiguous()
        comm.all_reduce(x, topo=topo, axis=Axis.TP)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_seq(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    return comm.all_gather(x, topo=topo, axis=Axis.TP, dim=SEQ_DIM)


def _start_gather_seq(x: torch.Tensor, topo: Topology):
    """``_all_gather_seq`` issued without waiting: (the (t, ...) rows, the work handle)."""
    rows = torch.empty((topo.tp, *x.shape), dtype=x.dtype, device=x.device)
    return rows, comm.all_gather_into(rows, x, topo=topo, axis=Axis.TP, async_op=True)


def _finish_gather_seq(rows: torch.Tensor, work, topo: Topology) -> torch.Tensor:
    comm.wait([work], topo=topo, what="all_gather", axis="tp")
    return comm.joined(rows, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    return comm.reduce_scatter(x, topo=topo, axis=Axis.TP, dim=SEQ_DIM)


class _SequenceParallel(torch.autograd.Function):
    """Sequence-parallel f and g, each the other's conjugate: f (``gather``) all-gathers the
    sequence shards forward and reduce-scatters the gradient back; g the reverse."""

    @staticmethod
    def forward(ctx, x, topo, gather: bool):
        ctx.topo, ctx.gather = topo, gather
        return _all_gather_seq(x, topo) if gather else _reduce_scatter_seq(x, topo)

    @staticmethod
    def backward(ctx, grad):
        topo = ctx.topo
        return (_reduce_scatter_seq if ctx.gather else _all_gather_seq)(grad, topo), None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather of the last dimension forward; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo, ctx.local = topo, x.shape[-1]
        return comm.all_gather(x, topo=topo, axis=Axis.TP, dim=x.dim() - 1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.topo.tp_rank * ctx.local
        return grad.narrow(-1, start, ctx.local).contiguous(), None


def copy_to_tp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """f: identity forward, all-reduce backward (entering a tp region)."""
    return x if topo.tp == 1 else _CopyToTP.apply(x, topo)


def reduce_from_tp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """g: all-reduce forward, identity backward (leaving a tp region)."""
    return x if topo.tp == 1 else _ReduceFromTP.apply(x, topo)


def gather_from_sp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """(B, T/t, C) -> (B, T, C): all-gather forward, reduce-scatter backward."""
    return x if topo.tp == 1 else _SequenceParallel.apply(x, topo, True)


def reduce_scatter_to_sp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """(B, T, C) partial sums -> (B, T/t, C): reduce-scatter forward, all-gather backward."""
    return x if topo.tp == 1 else _SequenceParallel.apply(x, topo, False)


def gather_from_tp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """(..., n/t) -> (..., n): all-gather forward, split backward (no communication)."""
    return x if topo.tp == 1 else _GatherFromTP.apply(x, topo)


def enter_tp(x: torch.Tensor, topo: Topology, sequence_parallel: bool) -> torch.Tensor:
    """Into a tp region: f, or with sequence parallelism the all-gather of the shards."""
    return gather_from_sp(x, topo) if sequence_parallel else copy_to_tp(x, topo)


def leave_tp(x: torch.Tensor, topo: Topology, sequence_parallel: bool) -> torch.Tensor:
    """Out of a tp region: g, or with sequence parallelism the reduce-scatter into shards."""
    return reduce_scatter_to_sp(x, topo) if sequence_parallel else reduce_from_tp(x, topo)


class _SavedShard:
    """One sequence-parallel entry into a tp region (``keeping_shard``): the ops inside that save
    the all-gathered input -- or a compute-dtype cast of it (``compute_input``), or a view
    spanning it -- for their backward keep this rank's sequence shard instead, and the
    backward all-gathers it again when the first of them runs (Megatron-LM's column-
    parallel linear with sequence parallelism; Korthikanti et al. 2022 count the shard).
    Held a block: q/k/v's input and the MLP's, T h e / t each where they were T h e, 7/8
    of it gone at tp 8. The re-gather is built once per backward and dtype and dropped
    when the last op that saved it has taken it.

    Overlapped where the region's owner says where its backward starts
    (``prefetch_from``, given the tensor that leaves the tp region: the o projection's or
    the MLP's partial output): when that tensor's gradient is computed -- after the exit's
    own collective, before the row-parallel layer's backward -- the re-gather is issued
    asynchronously, and runs while that layer's GEMMs (and the attention core's or the
    activation's backward) do; the first op that unpacks the input waits for it. Megatron-
    LM overlaps the same gather with one GEMM, the column layer's input gradient; this
    starts it a layer earlier. Without an owner's tensor the gather is issued on demand."""

    __slots__ = ("topo", "shard", "spans", "held", "packs", "alive", "rebuilt", "taken",
                 "hooks", "pending")  # fmt: skip

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, topo: Topology):
        self.topo, self.shard, self.spans = topo, shard, [full]
        self.held: dict[torch.dtype, torch.Tensor] = {}  # the shard in each saved dtype
        self.packs: dict[torch.dtype, int] = {}
        self.alive: dict[torch.dtype, int] = {}  # saved references not yet let go
        self.rebuilt: dict[torch.dtype, torch.Tensor] = {}
        self.pending: dict[torch.dtype, tuple] = {}  # issued re-gathers: (rows, work)
        self.taken: dict[torch.dtype, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def __enter__(self) -> _SavedShard:
        _REGIONS.append(self)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
        _REGIONS.pop()
        self.shard, self.spans, self.hooks = None, [], None  # only the packed shards stay

    def pack(self, t: torch.Tensor):
        if not any(_spans(t, full) for full in self.spans):
            # detached: a saved output returned as itself holds its own grad_fn, a cycle
            # through C++ that nothing collects -- an op on a branch the loss never reaches
            # (the router's z statistics) would keep its saved tensors for good
            return t.detach()
        held = self.held.get(t.dtype)
        if held is None:
            held = self.held[t.dtype] = self.shard.to(t.dtype).contiguous()
        self.packs[t.dtype] = self.packs.get(t.dtype, 0) + 1
        self.alive[t.dtype] = self.alive.get(t.dtype, 0) + 1
        return _Regather(self, t.dtype, t.shape)

    def release(self, dtype: torch.dtype) -> None:
        """One saved reference let go (autograd frees a node's saved tensors once its
        backward is done, or a zero-bubble W's): with the last, the shard goes too. The
        region itself lives as long as the graph (``prefetch_from``'s hook), so without
        this every block's shards stayed until the whole backward was done."""
        self.alive[dtype] -= 1
        if not self.alive[dtype]:
            self.held.pop(dtype, None)
            self.rebuilt.pop(dtype, None)

    def prefetch_from(self, y: torch.Tensor) -> None:
        """Issue the backward's re-gathers when ``y``'s gradient is computed (class doc)."""
        if self.held and y.requires_grad:
            y.register_hook(self._prefetch)

    def _prefetch(self, grad: torch.Tensor) -> None:
        for dtype, shard in self.held.items():  # (in the order packed: the same on every rank)
            if dtype not in self.rebuilt and dtype not in self.pending:
                self.pending[dtype] = _start_gather_seq(shard, self.topo)

    def rebuild(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        full = self.rebuilt.get(dtype)
        if full is None:
            issued = self.pending.pop(dtype, None)
            full = self.rebuilt[dtype] = (
                _all_gather_seq(self.held[dtype], self.topo)
                if issued is None
                else _finish_gather_seq(*issued, self.topo)
            )
        self.taken[dtype] = self.taken.get(dtype, 0) + 1
        if self.taken[dtype] % self.packs[dtype] == 0:  # the last op to take it
            del self.rebuilt[dtype]
        return full.view(shape)


class _Regather:
    """What a saved all-gathered input is packed into: its region, dtype and shape."""

    __slots__ = ("region", "dtype", "shape")

    def __init__(self, region: _SavedShard, dtype: torch.dtype, shape: torch.Size):
        self.region, self.dtype, self.shape = region, dtype, shape

    def __del__(self):
        self.region.release(self.dtype)


def _unpack(packed):
    if isinstance(packed, _Regather):
        return packed.region.rebuild(packed.dtype, packed.shape)
    return packed


def _spans(t: torch.Tensor, full: torch.Tensor) -> bool:
    """Whether ``t`` holds exactly ``full``'s elements (itself, or a contiguous view)."""
    return (
        t.dtype == full.dtype
        and t.numel() == full.numel()
        and t.is_contiguous()
        and t.storage_offset() == full.storage_offset()
        and t.untyped_storage()._cdata == full.untyped_storage()._cdata
    )


_REGIONS: list[_SavedShard] = []  # the entries whose ops are being built (innermost last)


def keeping_shard(shard: torch.Tensor, full: torch.Tensor, topo: Topology,
                  sequence_parallel: bool):  # fmt: skip
    """A context for the ops that read ``full = enter_tp(shard)`` (q, k and v; the MLP's
    first GEMMs; a head). Under sequence parallelism what they save of the all-gathered
    input is this rank's shard, gathered again in the backward (``_SavedShard``: one more
    all-gather of T h e an entry, issued by autograd in graph order, the same on every tp
    rank). Not where another saved-tensor hook already decides what is kept --
    ``--recompute full``'s checkpoint keeps only the block's input, and re-runs the
    forward's all-gather in the backward -- nor inside a torch.compile'd graph, whose
    partitioner chooses (it keeps the gathered input): there, and without sequence
    parallelism, a ``nullcontext``. (Two steps, not one context that also gathers: the
    gather breaks a compiled graph, and a context object built before the break cannot be
    carried across it.) ``with ... as kept``: the region (None where it stands aside), whose
    ``prefetch_from`` the owner calls with the tensor leaving the tp region."""
    if (
        not sequence_parallel
        or topo.tp == 1
        or torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ):
        return contextlib.nullcontext()
    return _SavedShard(shard, full, topo)


def compute_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the linear layers under autocast read it: cast to the autocast dtype once,
    here (each ``F.linear`` would cast it and save its own copy), or as it is outside
    autocast. Where x is the input a ``keeping_shard`` region gathered, the ops saving the
    cast keep the shard (cast) too."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or not x.is_floating_point():
        return x
    y = x.to(torch.get_autocast_dtype(device))
    if _REGIONS and y is not x and any(_spans(x, full) for full in _REGIONS[-1].spans):
        _REGIONS[-1].spans.append(y)
    return y


def sequence_shard(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    """This tp rank's slice of a replicated (B, T, ...) tensor along T (no gradient path)."""
    if topo.tp == 1:
        return x
    if x.shape[SEQ_DIM] % topo.tp:
        raise ValueError(
            f"--sequence-parallel needs the sequence length ({x.shape[SEQ_DIM]}) divisible "
            f"by --tp {topo.tp}"
        )
    return x.chunk(topo.tp, dim=SEQ_DIM)[topo.tp_rank]


# --- random streams -------------------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads tp ranks over the seed space


def _default_stream_draw() -> int:
    """One draw from the default CPU generator. Under ``plait rehearse``'s fake tensors a
    drawn tensor has no value to read, so the draw runs on a real one: the generator
    advances as in the real program, and the recomputation's replay redraws it."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


@contextlib.contextmanager
def tp_shard_rng(topo: Topology):
    """Run the body on this tp rank's own random stream, then resume the default one.

    The stream's seed mixes one draw from the default generator (which every tp rank draws
    identically) with the tp rank. So the default stream stays in lockstep across tp ranks
    (replicated regions see identical dropout masks), each shard gets its own masks, and
    activation recomputation -- which replays the default generator's state -- redraws the
    same masks. With tp == 1 the default stream is used unchanged.
    """
    if topo.tp == 1:
        yield
        return
    base = _default_stream_draw()
    seed = (base ^ ((topo.tp_rank * _GOLDEN) & (2**63 - 1))) % 2**63
    cuda = topo.device.type == "cuda"
    with torch.random.fork_rng(devices=[topo.device] if cuda else [], device_type="cuda"):
        torch.manual_seed(seed)
        yield


class TPDropout(nn.Module):
    """Dropout whose mask comes from the per-shard stream when ``sharded`` (the activation
    is a tp or sequence shard), else from the default stream shared by the tp ranks."""

    def __init__(self, p: float, *, topo: Topology, sharded: bool):
        super().__init__()
        self.p, self.topo, self.sharded = p, topo, sharded

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if not self.sharded:
            return F.dropout(x, self.p, training=True)
        with tp_shard_rng(self.topo):
            return F.dropout(x, self.p, training=True)


# --- layers ---------------------------------------------------------------------------------


def mark_sequence_parallel(p: nn.Parameter) -> nn.Parameter:
    """Flag a tp-replicated parameter that sees only this rank's sequence shard: its
    gradient is a partial sum that ``TPGradSync`` all-reduces over tp."""
    p.sequence_parallel = True
    return p


def mark_tp_partial(p: nn.Parameter) -> nn.Parameter:
    """Flag a tp-replicated parameter whose gradient each tp rank computes only a part of
    (a LoRA factor beside a split weight, ``model/lora.py``): ``TPGradSync`` sums it."""
    p.tp_partial = True
    return p


def _is_partial(p: torch.Tensor) -> bool:
    return getattr(p, "sequence_parallel", False) or getattr(p, "tp_partial", False)


_CASTS: dict | None = None  # layer -> its weight in the compute dtype, for one step


@contextlib.contextmanager
def weight_casts():
    """One optimizer step's forwards and backwards (the runners wrap each step in it):
    under autocast, each parallel linear layer's weight is cast to the compute dtype once
    and that copy is shared by every micro-batch. Autocast's own cache lives for one
    autocast context, which a step enters once per micro-batch; the matmul of each
    micro-batch then saves its own copy for the backward, so a pipeline stage with k
    micro-batches in flight (1F1B's warm-up: up to pp) held k compute-dtype copies of its
    weights -- 16 x 2.7 GiB on the first stage of GPT-3 175B at tp 8 pp 16 (``plait
    rehearse``). Same values (the same cast of the same weight), same gradients: the
    copy's backward adds each micro-batch's gradient into the weight's in turn."""
    global _CASTS
    outer, _CASTS = _CASTS, {}
    try:
        yield
    finally:
        _CASTS = outer


def _weight(layer: nn.Module) -> torch.Tensor:
    """The weight a parallel linear layer multiplies by (within ``weight_casts``, under
    autocast: its one compute-dtype copy of the step).

    Two optional strategies are attached to a built layer by the modules that own them,
    rather than as constructor flags: ``weight_quant`` (``model/quant.py``, quantisation-
    aware training) maps this rank's weight shard to its fake-quantised value, and
    ``lora`` (``model/lora.py``) is a module whose output, computed from the same input
    as the layer, is added to the layer's (still partial, for a row-parallel layer)
    product. Neither adds a collective to the forward or backward.
    """

    return step_cast(layer, layer.weight, layer.weight.device.type, layer.weight_quant)


def _linear(layer: nn.Module, x: torch.Tensor, bias) -> torch.Tensor:
    """A parallel linear layer's product ``x W^T + bias`` with its step's weight
    (``_weight``), or -- a fake-quantised weight that ZeRO-3 gathers per use --
    ``quantised_linear``."""
    w = layer.weight
    if layer.weight_quant is not None and getattr(w, "gathered_per_use", False):
        return quantised_linear(x, w, bias, layer.weight_quant)
    return F.linear(x, _weight(layer), bias)


def quantised_linear(x, weight, bias, quant) -> torch.Tensor:
    """``F.linear(x, quant(weight), bias)`` for a weight ZeRO-3 gathers for each use
    (``zero_units``), without keeping its quantised copy: the product's backward
    re-quantises the weight, gathered again by then, at the scales the forward found. A
    step's copy of every layer (``_StepQuant``) -- or the quantised weight ``F.linear``
    would save for its backward -- held the whole model on every rank: LLaMA-2 7B at
    ``--dp 64 --zero 3 --qat int8`` rehearsed 32.7 GiB against 19.5 without QAT.
    Collectives: the scales' (``FakeQuant.scales``) in each forward, as fp32's own path."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return _QuantisedLinear.apply(x, weight, bias, quant, dtype)


class _QuantisedLinear(torch.autograd.Function):
    """``quantised_linear``: saves the input and the (gathered) weight, not the quantised
    weight; the backward makes that again, then the input's gradient and the weight's,
    straight through the quantiser at the kept scales (``FakeQuant.grad``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, quant, dtype):
        scales = quant.scales(weight)
        wq = quant.quantize(weight, scales)
        if dtype is not None:  # autocast's casts, made here (the backward runs without it)
            x, wq = x.to(dtype), wq.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, wq, bias)
        ctx.quant, ctx.scales, ctx.dtype = quant, scales, wq.dtype
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        with torch.no_grad():
            wq = ctx.quant.quantize(weight, ctx.scales).to(ctx.dtype)
        gx = grad @ wq if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.needs_input_grad[1]:
            gwq = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            gw = ctx.quant.grad(weight, ctx.scales, gwq)
        if ctx.needs_input_grad[2]:
            gb = grad.reshape(-1, grad.shape[-1]).sum(0)
        return gx, gw, gb, None, None


def step_cast(key, weight: torch.Tensor, device: str, quant=None) -> torch.Tensor:
    """``weight`` -- fake-quantised by ``quant`` if given (``model/quant.FakeQuant``) -- in
    the autocast dtype, made once within a step's ``weight_casts`` under ``key`` and
    shared by every micro-batch (the parallel linear layers' weights, ``_weight``; MoE's
    stacked expert weights, ``moe.Experts``); outside a step's casts, or outside autocast
    unless quantised, as it is.

    A quantised weight's copy is made without autograd too (``_StepQuant``): sharing one
    graph of the quantiser between micro-batches failed in the second one's backward, its
    saved tensors freed by the first's (``--qat`` with more than one micro-batch under
    bf16)."""
    # Under torch.compile the cast is part of the block's graph (autocast's own, fused, and
    # recomputed in the backward from the fp32 weight rather than saved): the step's dict
    # stays out of it -- reading it would make dynamo guard on its length, one recompile
    # per block until the recompile limit sends every block back to eager.
    casts = None if torch.compiler.is_compiling() else _CASTS
    autocast = torch.is_autocast_enabled(device)
    if casts is None or (quant is None and not autocast):
        return weight if quant is None else quant(weight)
    cast = casts.get(key)
    if cast is None:
        dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
        if quant is not None:  # (in fp32 too: one copy a step, not a graph per use)
            cast = _StepQuant(dtype, weight, quant)
        elif weight.dtype == dtype:
            cast = weight
        else:  # a parameter: copied outside autograd, each use routes back
            cast = _StepCopy.of(dtype, [weight])
        casts[key] = cast
    return cast if isinstance(cast, torch.Tensor) else cast.use()


def column_linears(layers, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of several ``ColumnParallelLinear`` layers reading one input ``x``, which
    has already entered the tp region (q, k and v; llama's gate and up).

    Under autocast ``x`` is cast to the compute dtype here, once: each ``F.linear`` would
    otherwise cast it and save its own copy for the backward (an fp32 norm output under
    ``--fp32-residual``: two or three extra copies of h elements a token a block).

    Within a step's ``weight_casts``, where each of these weights is held as a compute-dtype
    copy for the step anyway, the layers run as one GEMM: their weights (and biases) are
    concatenated and cast once a step -- the same bytes the separate casts would hold, in
    one tensor -- and the product is split into the layers' outputs (views). On a GPU that
    is one GEMM where there were two or three, and one cast each way; Megatron-LM's fused
    QKV and gate-up projections do the same with one parameter, while plait keeps the
    layers' own parameters (checkpoints, Hugging Face files, LoRA, tensor-parallel shards).
    A torch.compile'd block concatenates the fp32 weights in its graph instead
    (``_fused_weight``). LoRA'd layers stay in the group: their updates are added into the
    product's rows (``_AdaptedColumns``; in a compiled block, added out of place). The
    outputs are views of one product, which any of them that the backward saves keeps
    whole: a caller that replaces some (rotary on q and k) gives the others their own
    storage (``model/transformer.py``). Not fused: outside autocast or a step's casts
    (fp32, evaluation), a layer with ``weight_quant``, or biases on some layers only.
    Weights already held in the compute dtype (ZeRO-3's gathered units) are not copied: where they lie side by side in their
    unit's buffer (``zero_units.Unit``) the GEMM reads the rows spanning them
    (``_adjacent_rows``), otherwise -- and inside a torch.compile'd block, where a
    concatenation would be a copy the step keeps -- the layers run apart."""
    autocast = torch.is_autocast_enabled(x.device.type)
    x = compute_input(x)
    fused = _fused_weight(layers) if autocast else None
    if fused is None:
        return [layer(x, entered=True) for layer in layers]
    weight, bias = fused
    rows = [layer.weight.shape[0] for layer in layers]
    adapted = [(i, layer.lora) for i, layer in enumerate(layers) if layer.lora is not None]
    if adapted and torch.compiler.is_compiling():
        # in a graph each update is added out of place: what the backward keeps is the
        # partitioner's choice, not the product's views, and no in-place add is cloned
        outs = list(F.linear(x, weight, bias).split(rows, dim=-1))
        for i, lora in adapted:
            outs[i] = outs[i] + lora(x)
        return outs
    if adapted:
        factors = [f for _, lora in adapted for f in (lora.A, lora.B)]
        scales = tuple((i, lora.scale) for i, lora in adapted)
        y = _AdaptedColumns.apply(x, weight, bias, tuple(rows), scales, *factors)
    else:
        y = F.linear(x, weight, bias)
    return list(y.split(rows, dim=-1))


class _AdaptedColumns(torch.autograd.Function):
    """The fused product of ``column_linears`` with LoRA updates added to some layers' rows
    (``model/lora.py``: ``scale * B (A x)``), as one output. Written out so that the update
    lands in the product's own rows: as separate layers the adapted outputs would be new
    tensors while the others stay views of the product, which the attention's saved views
    then keep whole (11% more activations rehearsed, llama, LoRA on up, tp 2 with sequence
    parallelism), and an in-place add under autograd clones the whole product's gradient in
    the backward (CopySlices). Saved for the backward, as the separate layers save: x where
    a weight or factor needs a gradient, the fused weight (the step's cast, held anyway)
    where x does, the factors and each adapter's ``scale * A x`` (r a token). Gradients:
    the product's own, plus each adapter's through its rows; the factors' in their own
    dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, scales, *factors):
        y = F.linear(x, weight, bias)
        outs = y.split(rows, dim=-1)
        us = []
        for (i, scale), a, b in zip(scales, factors[0::2], factors[1::2]):
            u = F.linear(x, a.to(x.dtype)) * scale
            outs[i].add_(F.linear(u, b.to(x.dtype)))
            us.append(u)
        ctx.rows, ctx.scales = rows, scales
        # as F.linear saves: the weight for x's gradient, x for the weights' (a frozen base
        # reading an input that needs no gradient keeps neither)
        need_x, need_w = ctx.needs_input_grad[:2]
        need_a = need_w or any(ctx.needs_input_grad[5::2])
        ctx.save_for_backward(x if need_a else None, weight if need_x else None, *factors, *us)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, *rest = ctx.saved_tensors
        n = len(ctx.scales)
        factors, us = rest[: 2 * n], rest[2 * n :]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_f = ctx.needs_input_grad[5:]
        flat_g = gy.reshape(-1, gy.shape[-1])
        flat_x = None if x is None else x.reshape(-1, x.shape[-1])
        gx = gy @ weight if need_x else None
        gw = flat_g.t() @ flat_x if need_w else None
        gb = flat_g.sum(0) if need_b else None
        outs = gy.split(ctx.rows, dim=-1)
        grads = []
        for j, ((i, scale), a, b, u) in enumerate(
            zip(ctx.scales, factors[0::2], factors[1::2], us)
        ):
            g = outs[i]
            gu = (g @ b.to(g.dtype)) * scale  # through B, then the scale
            ga = gu.reshape(-1, gu.shape[-1]).t() @ flat_x if need_f[2 * j] else None
            gb_ = g.reshape(-1, g.shape[-1]).t() @ u.reshape(-1, u.shape[-1])
            if need_x:  # in place: no second (..., h) temporary
                gx.view(-1, gx.shape[-1]).addmm_(gu.reshape(-1, gu.shape[-1]), a.to(gu.dtype))
            grads += [None if ga is None else ga.to(a.dtype),
                      gb_.to(b.dtype) if need_f[2 * j + 1] else None]  # fmt: skip
        return (gx, gw, gb, None, None, *grads)


def _fused_weight(layers) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The concatenation of ``layers``' weights and biases ``column_linears`` multiplies by,
    or None where it runs them apart: in eager mode the step's compute-dtype copy (cached
    in ``weight_casts``); inside a torch.compile'd block the fp32 concatenation, which the
    graph casts itself as it casts a lone weight (inductor fuses the two into one kernel;
    a llama block, CPU, bf16: the tensors saved for the backward have the unfused graph's
    bytes)."""
    if len(layers) < 2:
        return None
    device = layers[0].weight.device.type
    dtype = torch.get_autocast_dtype(device)
    biased = {layer.bias is not None for layer in layers}
    if len(biased) != 1 or any(
        layer.weight_quant is not None
        or (layer.spec.size is not None and layer.bias is None)  # a vocabulary head
        for layer in layers
    ):
        return None
    with_bias = biased == {True}
    held = {layer.weight.dtype == dtype for layer in layers}
    if held == {True}:  # ZeRO-3's gathered units: no copy, or run apart
        if torch.compiler.is_compiling():
            return None
        weight = _adjacent_rows([layer.weight for layer in layers])
        bias = _adjacent_rows([layer.bias for layer in layers]) if with_bias else None
        if weight is None or (with_bias and bias is None):
            return None
        return weight, bias
    if held != {False}:
        return None
    if torch.compiler.is_compiling():
        weight = torch.cat([layer.weight for layer in layers])
        return weight, torch.cat([layer.bias for layer in layers]) if with_bias else None
    if _CASTS is None:
        return None
    key = tuple(layers)
    got = _CASTS.get(key)
    if got is None:
        weight = _StepCopy.of(dtype, [layer.weight for layer in layers])
        bias = None
        if with_bias:
            bias = _StepCopy.of(dtype, [layer.bias for layer in layers])
        got = _CASTS[key] = (weight, bias)
    weight, bias = got
    return weight.use(), None if bias is None else bias.use()


def _adjacent_rows(tensors) -> torch.Tensor | None:
    """The concatenation of ``tensors`` along their first dimension where they already lie
    one after another in one storage (ZeRO-3's gathered unit buffers, ``zero_units``: a
    view spanning them, through ``_Rows``), else None."""
    first = tensors[0]
    if not all(t.is_contiguous() for t in tensors):
        return None
    # one storage: the same storage object (a fake tensor's, under ``plait rehearse``, has
    # no data pointer to compare)
    storage, end = first.untyped_storage(), first.storage_offset() + first.numel()
    for t in tensors[1:]:
        if (
            t.dtype != first.dtype
            or t.shape[1:] != first.shape[1:]
            or t.untyped_storage() is not storage
            or t.storage_offset() != end
        ):
            return None
        end += t.numel()
    return _Rows.apply(*tensors)


class _Rows(torch.autograd.Function):
    """Adjacent tensors (``_adjacent_rows``) as one tensor of their rows, a view of their
    storage; the backward hands each its rows of the gradient (views, no copy)."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.rows = [t.shape[0] for t in tensors]
        first = tensors[0]
        return first.as_strided((sum(ctx.rows), *first.shape[1:]), first.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.rows)


class _StepCopy:
    """A step's compute-dtype copy of parameters (``weight_casts``): ``torch.cat(tensors)
    .to(dtype)`` as the separate casts would move it -- each tensor cast straight into its
    rows (read 4, write 2 bytes an fp32 element, where a concatenation and then a cast
    would also write and read an fp32 copy) -- made once a step, outside autograd.

    Each use (``use()``: a layer's forward in one micro-batch) is an autograd node of its
    own, ``_UseCopy``, whose backward casts that micro-batch's gradient back in one kernel
    and hands each tensor its rows. One node made by the cast and shared by every
    micro-batch (this was autograd's ``ToCopyBackward`` / a concatenation's) was made in
    the step's first forward, and the autograd engine, which runs the ready node made
    last first, ran it only after everything else of every later micro-batch's backward:
    each layer's compute-dtype weight gradient was held to the backward's end (LLaMA-2 7B
    pp 4 under full recomputation: 2.8 GiB on stage 0, ``plait rehearse``), and no
    parameter's gradient was final before it, so a data-parallel reduction could not start
    until the last micro-batch's backward had ended."""

    def __init__(self, copy: torch.Tensor, tensors: list[torch.Tensor]):
        self.copy, self.tensors = copy, tensors

    @classmethod
    def of(cls, dtype: torch.dtype, tensors: list[torch.Tensor]) -> _StepCopy:
        with torch.no_grad():
            if len(tensors) == 1:
                return cls(tensors[0].to(dtype), tensors)
            rows = [t.shape[0] for t in tensors]
            out = tensors[0].new_empty((sum(rows), *tensors[0].shape[1:]), dtype=dtype)
            for part, t in zip(out.split(rows), tensors):
                part.copy_(t)
        return cls(out, tensors)

    def use(self) -> torch.Tensor:
        return _UseCopy.apply(self.copy, *self.tensors)


class _UseCopy(torch.autograd.Function):
    """One use of a ``_StepCopy``: the copy itself forward (a view of it), its gradient
    cast back to each tensor's dtype and split into their rows backward."""

    @staticmethod
    def forward(ctx, copy, *tensors):
        ctx.dtypes, ctx.rows = [t.dtype for t in tensors], [t.shape[0] for t in tensors]
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        if len(ctx.rows) == 1:
            return None, grad.to(ctx.dtypes[0])
        if len(set(ctx.dtypes)) == 1:
            return (None, *grad.to(ctx.dtypes[0]).split(ctx.rows))
        return (None, *(g.to(d) for g, d in zip(grad.split(ctx.rows), ctx.dtypes)))


class _StepQuant:
    """A step's fake-quantised copy of a weight in the compute dtype (``step_cast``): the
    scales of the weight and its quantised value, made once a step without autograd (the
    scales' tensor-parallel all-reduce, where a scheme has one, is the forward's, once a
    step). Each use is an autograd node of its own (``_UseQuant``), whose backward gives
    the quantiser's gradient at the step's scales (``FakeQuant.grad``): straight through
    the rounding, stopped by the clamp -- the bits of a graph made in the forward, with
    nothing of it held between a micro-batch's forward and backward but the scales (a
    few floats a row). Collectives: none beyond the scales' (the backward takes the kept
    scales)."""

    def __init__(self, dtype: torch.dtype, weight: torch.Tensor, quant):
        self.weight, self.quant = weight, quant
        with torch.no_grad():
            self.scales = quant.scales(weight)
            self.copy = quant.quantize(weight, self.scales).to(dtype)

    def use(self) -> torch.Tensor:
        return _UseQuant.apply(self.copy, self.weight, self)


class _UseQuant(torch.autograd.Function):
    """One use of a ``_StepQuant``: the copy forward (a view), the quantiser's gradient
    backward."""

    @staticmethod
    def forward(ctx, copy, weight, step):
        ctx.step = step
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        step = ctx.step
        return None, step.quant.grad(step.weight, step.scales, grad), None


GEMM_ALIGN = 128  # output features a vocabulary head's GEMM is padded to a multiple of


def vocab_linear(x: torch.Tensor, weight: torch.Tensor, *, align: bool | None = None):
    """``F.linear(x, weight)`` for a vocabulary head (weight: V rows, this rank's slice):
    on CUDA its GEMMs run with the rows padded by zeros to a multiple of ``GEMM_ALIGN``,
    and the padded columns are cut off the result (a view). cuBLAS's fast tensor-core
    kernels need every matrix's leading dimension 16-byte aligned: GPT-2's 50,257 is not,
    and its head's three GEMMs fell back to sm75-era kernels on an H200 -- 15.5 ms of a
    47 ms step, more than the model's twelve blocks (``benchmarks/gpu_profile.py``).
    Megatron-LM pads the parameter (``--make-vocab-size-divisible-by 128``); here only the
    product is padded, so checkpoints, Hugging Face files and the loss keep the true
    vocabulary, and the weight's gradient is the padded one's first V rows. Under autocast
    the weight is cast first (the pad copies the compute-dtype weight, 0.1% of the
    logits' bytes). ``align``: force it on or off (default: on CUDA)."""
    n = weight.shape[0]
    pad = -n % GEMM_ALIGN
    if not pad or not (weight.is_cuda if align is None else align):
        return F.linear(x, weight)
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        weight = weight.to(torch.get_autocast_dtype(device))
    return F.linear(x, F.pad(weight, (0, 0, 0, pad))).narrow(-1, 0, n)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output features: each tp rank computes its slice of y.

    ``sequence_parallel``: x arrives as a sequence shard and is all-gathered (else f).
    ``gather_output``: all-gather y's slices into the full y (else y stays split).
    ``spec``: how the weight rows split (key/value replication, vocabulary padding).
    ``lora`` / ``weight_quant``: see ``_weight`` (set after construction, default None).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        topo: Topology,
        bias: bool,
        spec: ShardSpec | None = None,
        sequence_parallel: bool = False,
        gather_output: bool = False,
    ):
        super().__init__()
        self.topo, self.sequence_parallel, self.gather_output = (
            topo,
            sequence_parallel,
            gather_output,
        )
        self.spec = spec or ShardSpec(dim=0)
        self.out_features = out_features
        if self.spec.size is None and out_features % (topo.tp // self.spec.replicas):
            raise ValueError(f"{out_features} output features do not split over tp={topo.tp}")
        local_out = local_size(out_features, self.spec, topo.tp)
        self.weight = set_shard(nn.Parameter(torch.empty(local_out, in_features)), self.spec)
        self.bias = set_shard(nn.Parameter(torch.empty(local_out)), self.spec) if bias else None
        self.lora, self.weight_quant = None, None  # see _weight

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return enter_tp(x, self.topo, self.sequence_parallel)

    def keeping(self, shard: torch.Tensor, full: torch.Tensor):
        """``keeping_shard`` for this layer's group (``full = self.enter(shard)``): the ops
        in the ``with`` block that save the all-gathered input keep the sequence shard."""
        return keeping_shard(shard, full, self.topo, self.sequence_parallel)

    def autocast_params(self) -> list[nn.Parameter]:
        """The parameters only ``F.linear`` reads, which autocast computes with in the
        compute dtype anyway: ZeRO-3 may hold them gathered in it (``zero_units.py``)."""
        quantised = self.weight_quant is not None  # fake-quantised from the fp32 weight
        return [p for p in (None if quantised else self.weight, self.bias) if p is not None]

    def forward(self, x, *, entered: bool = False):  # (..., in) -> (..., out / tp)
        """``entered=True``: x already went through ``self.enter`` -- several column-parallel
        layers reading one input (q, k, v) share one f / all-gather."""
        if not entered:
            full = self.enter(x)
            with self.keeping(x, full):
                return self.forward(compute_input(full), entered=True)
        if self.spec.size is not None and self.bias is None:  # a vocabulary head
            y = vocab_linear(x, _weight(self))
        else:
            y = _linear(self, x, self.bias)
        if self.lora is not None:  # this rank's slice of the low-rank update
            y = y + self.lora(x)
        if self.gather_output:
            y = gather_from_tp(y, self.topo)
            if y.shape[-1] != self.out_features:  # drop the vocabulary padding
                y = y.narrow(-1, 0, self.out_features)
        return y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input features; x arrives already split, the partial
    products are summed across tp (g; with sequence parallelism a reduce-scatter into
    sequence shards), then the replicated bias is added. ``lora`` / ``weight_quant``: see
    ``_weight``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        topo: Topology,
        bias: bool,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.topo, self.sequence_parallel = topo, sequence_parallel
        if in_features % topo.tp:
            raise ValueError(f"{in_features} input features do not split over tp={topo.tp}")
        w = nn.Parameter(torch.empty(out_features, in_features // topo.tp))
        self.weight = set_shard(w, ShardSpec(dim=1))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None and sequence_parallel and topo.tp > 1:
            mark_sequence_parallel(self.bias)
        self.lora, self.weight_quant = None, None  # see _weight

    def autocast_params(self) -> list[nn.Parameter]:
        """As ``ColumnParallelLinear``'s: the weight (the bias is added after the tp
        reduction, outside ``F.linear``, in the dtype it is held in)."""
        return [self.weight] if self.weight_quant is None else []

    def forward(self, x, *, prefetch: _SavedShard | None = None):  # (..., in / tp) -> (..., out)
        """``prefetch``: the region its block entered (``keeping_shard``), whose re-gather the
        backward issues before this layer's (``_SavedShard.prefetch_from``)."""
        y = _linear(self, x, None)
        if self.lora is not None:  # a partial sum like the product: reduced with it
            y = y + self.lora(x)
        if prefetch is not None:
            prefetch.prefetch_from(y)
        y = leave_tp(y, self.topo, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each tp rank owns a contiguous slice of the (padded) vocabulary; ids outside it look
    up zeros, and the partial embeddings are summed across tp (with sequence parallelism,
    reduce-scattered into sequence shards: (B, T) -> (B, T/t, C))."""

    def __init__(
        self, vocab_size: int, hidden: int, *, topo: Topology, sequence_parallel: bool = False
    ):
        super().__init__()
        self.topo, self.sequence_parallel = topo, sequence_parallel
        spec = vocab_spec(vocab_size)
        self.local_vocab = local_size(vocab_size, spec, topo.tp)
        self.vocab_start = topo.tp_rank * self.local_vocab
        self.weight = set_shard(nn.Parameter(torch.empty(self.local_vocab, hidden)), spec)

    def forward(self, ids, dtype: torch.dtype | None = None):
        """(B, T) -> (B, T, C), or (B, T/t, C) under sequence parallelism; in ``dtype``
        when given (the compute dtype of a bf16 / fp16 residual stream). The cast comes
        before the sum over tp, which then moves ``dtype``: exact, since each token's row
        is non-zero on one tp rank only, so every layout rounds the same fp32 row once."""
        if self.topo.tp == 1:
            out = F.embedding(ids, self.weight)
            return out if dtype is None else out.to(dtype)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if dtype is not None:
            out = out.to(dtype)
        return leave_tp(out, self.topo, self.sequence_parallel)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary; the full logits are never gathered."""

    @staticmethod
    def forward(ctx, logits, targets, topo, vocab_start, valid_vocab):
        # logits (N, V/t), targets (N,); the maths in float32
        local_v, input_dtype = logits.shape[-1], logits.dtype
        # bf16 / fp16 logits: the fp32 copy is this function's own, so the steps below run
        # in place on it, as Megatron's do -- one fp32 buffer at the loss's peak beside the
        # input, not two (an fp32 input is the caller's: left as it is)
        own = logits.dtype != torch.float32
        logits = logits.float()
        if valid_vocab is not None and vocab_start + local_v > valid_vocab:
            # padded vocabulary entries never win and take no probability
            pad_from = max(valid_vocab - vocab_start, 0)
            logits = logits if own else logits.clone()
            logits[:, pad_from:] = -math.inf
        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, topo=topo, axis=Axis.TP, op=dist.ReduceOp.MAX)
        max_ = logits_max.unsqueeze(-1)
        shifted = logits.sub_(max_) if own else logits - max_
        local = targets - vocab_start
        outside = (local < 0) | (local >= local_v)
        local = local.clamp(0, local_v - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(outside, 0.0)
        exp = shifted.exp_()
        stacked = torch.stack([picked, exp.sum(dim=-1)])
        comm.all_reduce(stacked, topo=topo, axis=Axis.TP)
        picked, sum_exp = stacked[0], stacked[1]
        loss = sum_exp.log() - picked
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local, outside)
        ctx.input_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - one_hot(target), scaled per token
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, topo: Topology, valid_vocab: int | None = None
) -> torch.Tensor:
    """Per-token loss (N,) in float32 from vocabulary-split logits (N, V/tp).

    ``valid_vocab``: the real vocabulary size when the model's is padded for tp; padded
    entries are excluded. A target equal to ``IGNORE_INDEX`` (instruction data's context
    tokens) has loss 0 and no gradient, as in ``F.cross_entropy``.
    """
    local_v = logits.shape[-1]
    if (topo.tp == 1 and logits.dtype == torch.float32
            and (valid_vocab is None or valid_vocab >= local_v)):  # fmt: skip
        return F.cross_entropy(logits, targets, reduction="none", ignore_index=IGNORE_INDEX)
    # bf16 / fp16 logits, even on one rank: the function's steps run in place on its own
    # fp32 copy, one fp32 buffer at the loss's peak where cross_entropy on a cast holds
    # two (its input and log-softmax's output: 0.49 GiB more for llama2-7b at 4,096
    # tokens, 4.2 GB for a 128k vocabulary at 8,192)
    loss = _VocabParallelCrossEntropy.apply(
        logits, targets, topo, topo.tp_rank * local_v, valid_vocab
    )
    return loss.masked_fill(targets == IGNORE_INDEX, 0.0)  # its gradient is then 0 too


# --- gradients that tp ranks hold only in part ----------------------------------------------


class TPGradSync:
    """Completes, over tp, the gradients each tp rank computes only a part of:

    - parameters marked by ``mark_sequence_parallel`` (replicated, but under sequence
      parallelism each rank saw only its sequence shard) or by ``mark_tp_partial`` (a
      LoRA factor beside a split weight): summed over tp;
    - key/value weights replicated because there are fewer key/value heads than tp ranks
      (``ShardSpec.replicas > 1``): each copy got the gradient of its own rank's query heads
      only, so the copies of one head are summed. Rather than a process group per replica
      set (Topology stays the single owner of groups), each rank writes its gradient into
      its head's slot of a zero buffer shaped like the full weight and one all-reduce over
      tp sums every slot; K is small (that is why it is replicated).

    Everything goes into one flat all-reduce per optimizer step. Call ``finish()`` after the
    last micro-batch's backward, before the dp gradient sync (both are sums, so the order
    does not change the result; before keeps the gradients whole when dp shards them).
    """

    def __init__(self, params, *, topo: Topology):
        self.topo = topo
        params = [p for p in params if p.requires_grad]
        self.partial = [p for p in params if _is_partial(p)]
        self.replicated_kv = [p for p in params if shard_spec(p).replicas > 1]

    @property
    def active(self) -> bool:
        return self.topo.tp > 1 and bool(self.partial or self.replicated_kv)

    def finish(self) -> None:
        if not self.active:
            return
        # One flat buffer: each partial gradient, then each key/value weight's slots (one
        # per head shard, tp // replicas of them), this rank's slot holding its gradient.
        partial, kv, tp, tp_rank = self.partial, self.replicated_kv, self.topo.tp, self.topo.tp_rank
        num_slots = [tp // shard_spec(p).replicas for p in kv]
        layout = FlatLayout([p.numel() for p in partial] +
                            [s * p.numel() for s, p in zip(num_slots, kv)])  # fmt: skip
        flat = layout.pack([p.grad for p in partial] + [None] * len(kv), like=(partial + kv)[0])
        views = layout.views(flat)
        dests = views[: len(partial)]
        for p, s, view in zip(kv, num_slots, views[len(partial) :]):
            slot = view.view(s, -1)[tp_rank // shard_spec(p).replicas]
            if p.grad is not None:
                slot.copy_(p.grad.reshape(-1))
            dests.append(slot)
        comm.all_reduce(flat, topo=self.topo, axis=Axis.TP)
        for p, dest in zip(partial + kv, dests):
            self._assign(p, dest)

    @staticmethod
    def _assign(p: torch.Tensor, flat: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = flat.view_as(p).clone()
        else:
            p.grad.copy_(flat.view_as(p))
