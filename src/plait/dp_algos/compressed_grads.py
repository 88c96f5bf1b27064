"""Compressed gradient reduction over the dp axis: a ``GradReducer`` of its own, beside
``AllReduceGrads``, that sends each gradient through a codec of ``compression.py``.

Communication (axis dp, n = ranks of the reduction: every dp rank under ZeRO 0/1, the dp/K
shard groups under ZeRO 2/3; per tensor of e elements, bytes as ``comm.py`` counts them;
``volume.py`` holds the same formulas for the tests and the simulator):

- ``bf16``: one all-reduce per bucket, 2e bytes per tensor; sent 2 (n-1)/n of it.
- ``int8`` (``compression.Int8Sum``, n <= 127 ranks): per bucket one MAX all-reduce of the
  block scales (4 ceil(e/512) bytes per tensor), then one all-reduce of the int8 levels
  (e bytes per tensor); sent 2 (n-1)/n of each. Summable: the levels of the n ranks add
  up in the all-reduce itself.
- ``qsgd:s``: one all-gather per bucket of every rank's message, n (e + 4 ceil(e/512))
  bytes per tensor counted (the gathered output); sent (n-1) x the message.
- ``topk:ratio``: one all-gather per bucket, n x 8 ceil(ratio e) bytes per tensor; sent
  (n-1) x the message.
- ``powersgd:r``: two all-reduces per bucket, the first of every matrix's P (4 r rows
  bytes) and of the uncompressed tensors (4e), the second of every Q (4 r cols).

Warm-up (``--compress-warmup W``, PyTorch's ``start_powerSGD_iter``): the first W steps
all-reduce the gradient uncompressed, 4e bytes per tensor, as ``AllReduceGrads`` does.
PowerSGD's error and Q start from zero and the seed when compression starts (as
PyTorch's hook); top-k's EF21 estimates follow the gradients during the warm-up (g_i the
rank's own, g their all-reduced sum), so compression starts from the last plain step's
gradients instead of from zero (EF21 started from full gradients, Richtarik et al. 2021);
with ``--ef21-start zero`` they stay at zero until compression starts.

When. Stages 0 and 1 (``CompressedGrads``): as in ``AllReduceGrads``, a bucket's gradients
are encoded and its collective launched asynchronously from the backward hook of its
last gradient on the step's last micro-batch (PowerSGD's first all-reduce and int8's
scales likewise); ``finish()`` waits, decodes and sums in rank order, and runs
PowerSGD's second all-reduce and int8's levels (encoded once the shared scales are
there), bucket by bucket -- but under bf16, QSGD and top-k at most ``in_flight`` (2)
buckets are launched and not yet decoded: launching another first waits for the oldest
and decodes it (``CompressedGrads``), so a rank holds two buckets' messages, not the
whole model's n + 1 times over. ZeRO 2/3 with ``--zero-shard-group`` (``Across``): the
reduce-scatter inside the shard group is unchanged; what crosses the groups -- this
rank's shard of each gradient, in ``finish()`` -- goes through the codec instead of the
plain all-reduce, synchronously, bucket by bucket.

Why this cannot deadlock under NCCL: every collective is issued by the thread that runs
the model (autograd's hooks, in the backward's deterministic order, or ``finish()`` in
bucket order), tensors on ``topo.device``, the same sequence on every rank of the group
(same buckets, same codec, same shapes: message sizes depend only on shapes); no thread
pool, no point-to-point. The window's early completions only wait for a collective that
every rank of the group has issued already, in launch order, the same on every rank.

The result is the same on every rank (all-gathered messages are decoded in rank order;
all-reduced ones are identical), so the replicas stay identical: parameters and
optimizer state are the plain run's kind; only the codecs' error buffers differ per rank,
and checkpoints keep them per replica (``algorithm.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.dp_algos import compression, volume
from plait.dp_algos.config import DPAlgoConfig
from plait.parallel.data_parallel import Bucket, GradReducer
from plait.parallel.flat import FlatLayout
from plait.topology import Axis, Topology


def make_codec(cfg: DPAlgoConfig, *, seed: int):
    name, arg = cfg.codec
    if name == "qsgd":
        return compression.QSGD(arg, seed=seed)
    if name == "topk":
        return compression.TopK(arg, warm_start=cfg.ef21_start == "gradient")
    if name == "powersgd":
        return compression.PowerSGD(arg, seed=seed)
    return None  # bf16: no state, no object; int8: made per reduction (``Compression``)


class _Wire:
    """Encoding and decoding of a bucket's tensors with one codec, shared by both paths.
    ``tensors`` are (key, flat fp32 view) pairs; ``sender`` names this rank in QSGD's
    random stream: its dp and tp coordinates, not its pipeline stage, so the two copies of
    a tied embedding (first and last stage, the same name) draw alike and stay equal."""

    def __init__(self, codec_name: str, codec, *, topo: Topology, sender: str, n: int,
                 warmup: int = 0):  # fmt: skip
        self.name, self.codec, self.topo, self.sender, self.n = codec_name, codec, topo, sender, n
        self.step = 0  # optimizer steps done: QSGD's random stream follows it
        self.warmup = warmup

    # --- warm-up: the plain all-reduce ---------------------------------------------------

    @property
    def warm(self) -> bool:
        """This step is one of ``--compress-warmup``'s plain ones."""
        return self.step < self.warmup

    def plain_start(self, tensors, flat: torch.Tensor):
        """All-reduce ``flat`` (whose views ``tensors`` are) as it is."""
        if self.name == "topk":  # EF21: g_i follows this rank's own gradient
            for key, x in tensors:
                self.codec.follow_local(key, x)
        return comm.all_reduce(flat, topo=self.topo, axis=Axis.DP, async_op=True)

    def plain_finish(self, handle, tensors) -> None:
        comm.wait([handle], topo=self.topo, what="all_reduce", axis="dp")
        if self.name == "topk":  # ... and g their sum
            for key, x in tensors:
                self.codec.follow_total(key, x)

    # --- gather codecs: QSGD, top-k ------------------------------------------------------

    def gather_start(self, tensors):
        floats, smalls = [], []
        for key, x in tensors:
            if self.name == "qsgd":
                gen = self.codec.generator(key, self.step, self.sender, x.device)
                f, s = self.codec.encode(x, gen=gen)
            else:
                f, s = self.codec.encode(key, x)
            floats.append(f)
            smalls.append(s)
        msg = torch.cat([torch.cat(floats).view(torch.uint8), torch.cat(smalls).view(torch.uint8)])
        out = torch.empty(self.n * msg.numel(), dtype=torch.uint8, device=msg.device)
        handle = comm.all_gather_into(out, msg, topo=self.topo, axis=Axis.DP, async_op=True)
        return handle, out, msg

    def gather_finish(self, pending, tensors) -> None:
        handle, out, _ = pending
        comm.wait([handle], topo=self.topo, what="all_gather", axis="dp")
        sizes = [self.codec.parts(x.numel()) for _, x in tensors]
        n_float = sum(f for f, _, _ in sizes)
        rows = out.view(self.n, -1)
        for _, x in tensors:
            if self.name == "qsgd":
                x.zero_()
        for r in range(self.n):  # in rank order: the same sum on every rank
            row = rows[r]
            floats = row[: 4 * n_float].view(torch.float32)
            small_bytes = row[4 * n_float :]
            fo = so = 0
            for (key, x), (nf, ns, dtype) in zip(tensors, sizes):
                width = dtype.itemsize
                f = floats[fo : fo + nf]
                s = small_bytes[so : so + ns * width].view(dtype)
                fo, so = fo + nf, so + ns * width
                if self.name == "qsgd":
                    self.codec.add_decoded(x, f, s)
                else:
                    self.codec.add_to_total(key, f, s, x.numel())
        if self.name == "topk":
            for key, x in tensors:
                x.copy_(self.codec.result(key))

    # --- PowerSGD ------------------------------------------------------------------------

    def power_start(self, tensors, shapes):
        parts = []
        for (key, x), shape in zip(tensors, shapes):
            if self.codec.matrix_shape(shape) is None:
                parts.append(x)
            else:
                parts.append(self.codec.first(key, x.view(shape)).reshape(-1))
        buf = torch.cat(parts) if parts else tensors[0][1].new_zeros(0)
        handle = comm.all_reduce(buf, topo=self.topo, axis=Axis.DP, async_op=True)
        return handle, buf

    def power_finish(self, pending, tensors, shapes) -> None:
        handle, buf = pending
        comm.wait([handle], topo=self.topo, what="all_reduce", axis="dp")
        offset, hats, qs = 0, {}, []
        for (key, x), shape in zip(tensors, shapes):
            mat = self.codec.matrix_shape(shape)
            if mat is None:
                x.copy_(buf[offset : offset + x.numel()])
                offset += x.numel()
                continue
            r = self.codec.r(shape)
            p_sum = buf[offset : offset + mat[0] * r].view(mat[0], r)
            offset += mat[0] * r
            hats[key], q = self.codec.second(key, p_sum)
            qs.append(q.reshape(-1))
        if not qs:
            return
        qbuf = torch.cat(qs)
        comm.all_reduce(qbuf, topo=self.topo, axis=Axis.DP)
        offset = 0
        for (key, x), shape in zip(tensors, shapes):
            mat = self.codec.matrix_shape(shape)
            if mat is None:
                continue
            r = self.codec.r(shape)
            q_sum = qbuf[offset : offset + mat[1] * r].view(mat[1], r)
            offset += mat[1] * r
            x.copy_(self.codec.finish(key, hats[key], q_sum).reshape(-1))

    # --- int8: shared scales (MAX), then the levels (SUM) ------------------------------------

    def int8_start(self, tensors):
        scales = self.codec.scales_of([x for _, x in tensors])
        return comm.all_reduce(scales, topo=self.topo, axis=Axis.DP, op=dist.ReduceOp.MAX,
                               async_op=True), scales  # fmt: skip

    def int8_finish(self, pending, tensors) -> None:
        handle, scales = pending
        comm.wait([handle], topo=self.topo, what="all_reduce", axis="dp")
        levels = self.codec.encode_all(tensors, scales, step=self.step, sender=self.sender)
        comm.all_reduce(levels, topo=self.topo, axis=Axis.DP)
        self.codec.decode_into(levels, scales, [x for _, x in tensors])

    # --- bf16 ----------------------------------------------------------------------------

    def bf16_start(self, flat: torch.Tensor):
        wire = flat.to(torch.bfloat16)
        return comm.all_reduce(wire, topo=self.topo, axis=Axis.DP, async_op=True), wire

    def bf16_finish(self, pending, flat: torch.Tensor) -> None:
        handle, wire = pending
        comm.wait([handle], topo=self.topo, what="all_reduce", axis="dp")
        flat.copy_(wire)


class CompressedGrads(GradReducer):
    """Stages 0 and 1: a bucket's gradients are moved into one flat buffer (``p.grad`` a
    view into it, as ``AllReduceGrads`` does), encoded per tensor, and reduced over the
    dp axis (module docstring); ``finish()`` leaves the summed gradient in the buffer.

    Under bf16, QSGD and top-k (``volume.WINDOWED``) at most ``in_flight`` buckets are
    launched and not yet decoded: launching one more first waits for the oldest (launch
    order) and decodes it into its gradients, as ZeRO-2 bounds its packed inputs. Kept until
    ``finish()`` instead, the messages would add up to the whole model's: at n ranks
    QSGD's gathered ones are n + 1 bytes an element, 16x the fp32 gradients at n = 64.
    Completing is only waiting for a collective every rank has issued, in the same
    (launch) order everywhere, and local arithmetic; nothing is issued. int8 and PowerSGD
    hold only block scales or P factors in flight and complete with a second collective,
    which stays in ``finish()`` (bucket order)."""

    in_flight = volume.IN_FLIGHT

    def __init__(self, model: nn.Module, *, topo, cfg, defer=(), codec_name, codec, names, sender,
                 warmup=0):  # fmt: skip
        super().__init__(model, topo=topo, cfg=cfg, defer=defer)
        self.names = names  # id(parameter) -> name: the codecs' state is kept by name
        self.wire = _Wire(codec_name, codec, topo=topo, sender=sender, n=topo.dp, warmup=warmup)
        self._in_flight: list[Bucket] = []  # windowed buckets launched, not yet decoded

    def _tensors(self, bucket: Bucket):
        views = bucket.layout.views(bucket.flat)
        return [(self.names[id(p)], view) for p, view in zip(bucket.params, views)]

    def _launch(self, bucket: Bucket) -> None:
        wire = self.wire
        windowed = not wire.warm and wire.name in volume.WINDOWED
        while windowed and len(self._in_flight) >= self.in_flight:  # the oldest: decoded
            self._complete(self._in_flight[0])  # before this one's message is made
        self._flatten(bucket)
        if wire.warm:
            bucket.handle = wire.plain_start(self._tensors(bucket), bucket.flat)
        elif wire.name == "bf16":
            bucket.handle = wire.bf16_start(bucket.flat)
        elif wire.name == "int8":
            bucket.handle = wire.int8_start(self._tensors(bucket))
        elif wire.name == "powersgd":
            bucket.handle = wire.power_start(self._tensors(bucket), _shapes(bucket.params))
        else:
            bucket.handle = wire.gather_start(self._tensors(bucket))
        bucket.launched = True
        if windowed:
            self._in_flight.append(bucket)

    def _complete(self, bucket: Bucket) -> None:
        if bucket.handle is None:  # decoded early, to keep the window
            return
        if bucket in self._in_flight:
            self._in_flight.remove(bucket)
        self._finish_wire(bucket)
        bucket.handle = None

    def _finish_wire(self, bucket: Bucket) -> None:
        wire = self.wire
        if wire.warm:
            wire.plain_finish(bucket.handle, self._tensors(bucket))
        elif wire.name == "bf16":
            wire.bf16_finish(bucket.handle, bucket.flat)
        elif wire.name == "int8":
            wire.int8_finish(bucket.handle, self._tensors(bucket))
        elif wire.name == "powersgd":
            wire.power_finish(bucket.handle, self._tensors(bucket), _shapes(bucket.params))
        else:
            wire.gather_finish(bucket.handle, self._tensors(bucket))


class Across:
    """ZeRO 2/3 with shard groups: this rank's gradient shards summed across the groups
    through the codec, in place of HSDP's all-reduce (module docstring). Called by
    ``ReduceScatterGrads`` once per bucket, in bucket order, after its reduce-scatter."""

    def __init__(self, codec_name, codec, *, topo: Topology, names, sender, warmup=0):
        self.names = names
        self.wire = _Wire(codec_name, codec, topo=topo, sender=sender, n=topo.dp, warmup=warmup)

    def __call__(self, row: torch.Tensor, layout, params) -> None:
        wire = self.wire
        views = layout.views(row)  # this rank's real shards (no padding)
        if wire.warm or wire.name == "bf16":  # a flat buffer of the shards, without padding
            dense = FlatLayout.of(views)
            flat = dense.pack(views)
            if wire.warm:
                parts = dense.views(flat)
                tensors = [(self.names[id(p)], x) for p, x in zip(params, parts)]
                wire.plain_finish(wire.plain_start(tensors, flat), tensors)
            else:
                wire.bf16_finish(wire.bf16_start(flat), flat)
            dense.unpack(flat, views)
        elif wire.name == "int8":
            tensors = [(self.names[id(p)], v.reshape(-1)) for p, v in zip(params, views)]
            wire.int8_finish(wire.int8_start(tensors), tensors)
        else:
            tensors = [(self.names[id(p)], v) for p, v in zip(params, views)]
            wire.gather_finish(wire.gather_start(tensors), tensors)


class Compression:
    """What the engine is handed (``build_data_parallel(compression=...)``): builds the
    stage 0/1 reducer or the ZeRO 2/3 cross-group hook around one codec, and keeps the
    codec's state and the step its random stream follows."""

    def __init__(self, cfg: DPAlgoConfig, *, seed: int, names: dict[int, str], sender: str):
        self.codec_name, _ = cfg.codec
        self.codec = make_codec(cfg, seed=seed)
        self.seed = seed
        self.warmup = cfg.compress_warmup
        self.names, self.sender = names, sender
        self.wires: list[_Wire] = []

    def _codec(self, topo: Topology):
        """The codec of a reduction over ``topo``'s dp axis: int8's levels per rank depend
        on how many ranks add theirs up; the others are shared."""
        if self.codec_name == "int8":
            return compression.Int8Sum(max(topo.dp, 1), seed=self.seed)
        return self.codec

    def reducer(self, model, *, topo, cfg, defer=()) -> CompressedGrads:
        r = CompressedGrads(model, topo=topo, cfg=cfg, defer=defer, codec_name=self.codec_name,
                            codec=self._codec(topo), names=self.names, sender=self.sender,
                            warmup=self.warmup)  # fmt: skip
        self.wires.append(r.wire)
        return r

    def across(self, topo: Topology) -> Across:
        a = Across(self.codec_name, self._codec(topo), topo=topo, names=self.names,
                   sender=self.sender, warmup=self.warmup)  # fmt: skip
        self.wires.append(a.wire)
        return a

    def set_step(self, step: int) -> None:
        """The optimizer step (from 0) whose gradients are encoded next."""
        for w in self.wires:
            w.step = step

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {key: flat tensor}}: EF21's estimates, PowerSGD's errors; empty for bf16
        and QSGD (whose randomness is a function of the step)."""
        return self.codec.state() if hasattr(self.codec, "state") else {}


def _shapes(params) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in params]
