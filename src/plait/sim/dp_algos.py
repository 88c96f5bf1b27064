"""The price of ``--dp-algo`` / ``--compress`` on a cluster: bytes, messages, latency and
seconds per step of the data-parallel communication, for ``simulate`` and ``plan``.

Bytes come from ``dp_algos.volume`` (the formulas the runtime's counts are tested
against); seconds from the alpha-beta models of ``collectives`` on the link the group
spans, compute from ``costs``.
Per pipeline rank, with N its parameters (its tp shard of its layers), K the dp ranks of a
replica (``--zero-shard-group`` under ZeRO, else 1), R = dp / K replicas, and the link
``collectives.group_link`` gives a group of R ranks spaced tp x K apart:

- plain all-reduce: ``costs.dp_comm_time``, unchanged.
- compression (every dp rank under ZeRO 0/1; across the R shard groups, on the 1/K shard,
  under ZeRO 2/3, after the unchanged reduce-scatter inside each group): bf16 and
  PowerSGD all-reduce (PowerSGD's P round overlaps the backward like a bucket, its Q
  round does not; int8's scales overlap, its levels do not), QSGD and top-k all-gather R
  messages. The codecs' own work is charged as exposed time: memory-bound streams at the elementwise rate (QSGD: encode 9 bytes
  per element -- read the gradient, write levels, draw a uniform -- and decode 9 bytes per
  element per sender; top-k: 36 -- the residual 12, a radix select of the magnitudes in
  four 8-bit passes 16, and the estimate's update 8; bf16: the two casts 12; PowerSGD:
  error feedback 24) and PowerSGD's three GEMMs per matrix (M'Q, M'^T P^, P^ Q^T) timed
  by ``costs.gemm_time`` in fp32.
- local SGD, DiLoCo: the engine inside a replica (ZeRO over its K ranks, nothing for K =
  1) every step; every H steps an all-reduce of the 4N/K-byte shards across the R
  replicas, plus DiLoCo's outer step (7 fp32 streams of the shard); charged per step as
  1/H of that, exposed (nothing overlaps it). A compressed sync (``--compress bf16``:
  2N/K bytes and the two casts; ``int8``: N/K bytes of levels plus a scale per 512
  elements in a second all-reduce, the encode and decode streams) adds local SGD's anchor
  arithmetic (8 fp32 streams). ZeRO 1/2 over K > 1 ranks gather the weights after the
  sync instead of after the optimizer step (``DPAlgorithm.rewrites_shards``), once.
- gossip: every step, d messages of 4N/K bytes leave the rank together (one batch, one
  NIC: latency + d x 4N/K / bandwidth of the link to the neighbours), and the mixing
  reads d + 1 copies and writes one; Gossip-PGA replaces one step in H by an all-reduce.

Memory each algorithm adds per device: what it keeps through a step (``state_bytes``):
DiLoCo's anchor and outer momentum 8N/K, a compressed local SGD sync's 4N/K anchor,
EF21's two estimates 8N (top-k), PowerSGD's error 4N (per shard under ZeRO 2/3); and its
sync's buffers after the optimizer step (``sync_bytes``), which add to the peak only where
they outgrow the step's own (``added_at_peak``): DiLoCo's 4N/K outer gradients, local
SGD's 4N/K packed shards while averaging, gossip's d receive buffers, the packed chunk and
its mix (one ``--bucket-mb`` chunk each). And a gradient codec's buffers as the backward
launches a bucket (``codec_buffers``, at ``memory.codec_launch_moments``): its messages in
flight -- under QSGD and top-k n + 1 of them a bucket, two buckets at most -- and its
encode's working set.
"""

from __future__ import annotations

import math

from plait.dp_algos import graphs, volume
from plait.dp_algos.config import DPAlgoConfig, compress_group, replicas_of
from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.sim import collectives, costs
from plait.sim.hardware import Hardware
from plait.sim.runtime import Runtime

QSGD_ENCODE, QSGD_DECODE, TOPK_WORK, BF16_CASTS, EF_STREAMS = 9, 9, 36, 12, 24
OUTER_STEP_STREAMS = 7 * 4  # DiLoCo: read anchor, shard, momentum, delta; write three
# a compressed local SGD sync: the change x - anchor (read two, write one), anchor += mean
# (read two, write one), the shard <- anchor (read one, write one)
ANCHOR_STREAMS = 8 * 4
INT8_DECODE = 5  # read the summed level (1 byte), write the fp32 mean (4)


def rank_shapes(model: ModelConfig, layout: Layout, chunks, params: float) -> list[tuple]:
    """Tensor shapes one tp rank of a pipeline rank holds: every block's weight matrices
    (their tp shards, as ``model/transformer.py`` builds them), the embedding and head
    (and GPT-2's position embedding), and the rest (norms, biases, positions) as one flat tensor. ``chunks``: (layers,
    first, last) of each virtual stage on the rank; ``params``: its parameter count."""
    t, h, f = layout.tp, model.hidden, model.ffn_hidden
    kv = model.kv_dim
    kv_t = kv // t if model.n_kv_heads >= t else kv  # replicated when fewer heads than tp
    per_layer = [(h // t, h), (kv_t, h), (kv_t, h), (h, h // t)]
    if model.arch == "gpt2":
        per_layer += [(f // t, h), (h, f // t)]
    else:
        per_layer += [(f // t, h), (f // t, h), (h, f // t)]
    shapes = []
    vocab = (math.ceil(model.vocab_size / t), h)
    for layers, first, last in chunks:
        shapes += per_layer * layers
        if first:
            shapes.append(vocab)
            if model.arch == "gpt2":  # the learned positions, whole on every tp rank
                shapes.append((model.seq_len, h))
        if last and (not model.tied_embeddings or not first):
            shapes.append(vocab)
    rest = params - sum(a * b for a, b in shapes)
    if rest > 0:
        shapes.append((int(rest),))
    return shapes


def shard_shapes(shapes, k: int) -> list[tuple]:
    """This rank's ZeRO shards of ``shapes`` over k ranks: flat, ceil(e / k) elements."""
    if k == 1:
        return shapes
    return [(math.ceil(math.prod(s) / k),) for s in shapes]


def comm_time(
    model: ModelConfig,
    layout: Layout,
    hw: Hardware,
    rt: Runtime,
    algo: DPAlgoConfig,
    *,
    chunks,
    params: float,
) -> dict:
    """Seconds per step of one pipeline rank's data-parallel work under ``algo``:
    {"grad": overlappable with the backward (streamed per bucket), "param": ZeRO's
    gathers after the step, "sync": exposed after the optimizer step (amortised over the
    algorithm's period), "bytes_sent", "messages", "latency": per step on average}."""
    if algo.algo == "allreduce" and algo.compress is None:
        base = costs.dp_comm_time(params, layout, hw, rt)
        vol = volume.mean_volume(algo, shapes=[(int(params),)], n=layout.dp)
        link = collectives.group_link(hw, layout.dp, layout.tp)
        latency = 2 * collectives.ring_latency(layout.dp, link, "all_reduce")
        return {**base, "sync": 0.0, "bytes_sent": vol.sent, "messages": 0, "latency": latency}
    shapes = rank_shapes(model, layout, chunks, params)
    if algo.grad_codec is not None:
        return _compressed(model, layout, hw, rt, algo, shapes, params)
    r, k = replicas_of(layout)
    inner = costs.dp_comm_time(params, layout.replace(dp=k, zero_shard_group=None), hw, rt)
    if k == 1:
        inner = {"grad": 0.0, "param": 0.0}
    shards = shard_shapes(shapes, k)
    shard_bytes = 4 * sum(math.prod(s) for s in shards)
    link = collectives.group_link(hw, r, layout.tp * k)
    vol = volume.mean_volume(algo, shapes=shards, n=r)
    average = collectives.all_reduce_time(shard_bytes, r, link)
    if algo.algo in ("local-sgd", "diloco"):
        h = algo.sync_every
        elems = shard_bytes / 4
        rounds = 1
        if algo.sync_optimizer_state:  # AdamW's two moments travel with the parameters
            work = collectives.all_reduce_time(3 * shard_bytes, r, link)
        elif algo.sync_codec is None:
            work = collectives.all_reduce_time(shard_bytes, r, link)
        else:  # the change since the last sync, encoded: bf16, or int8 levels + scales
            sync = volume.sync_volume(algo, shards, r)
            if algo.sync_codec == "bf16":
                work = collectives.all_reduce_time(sync.counted["all_reduce"], r, link)
                work += costs.stream_time(hw, BF16_CASTS * elems)
            else:
                scales = volume.block_scale_bytes(shards)
                work = collectives.all_reduce_time(sync.counted["all_reduce"] - scales, r, link)
                work += collectives.all_reduce_time(scales, r, link)
                work += costs.stream_time(hw, (QSGD_ENCODE + INT8_DECODE) * elems)
                rounds = 2
            if algo.algo == "local-sgd":
                work += costs.stream_time(hw, ANCHOR_STREAMS * elems)
        if algo.algo == "diloco":
            work += costs.stream_time(hw, OUTER_STEP_STREAMS * elems)
        latency = rounds * 2 * collectives.ring_latency(r, link, "all_reduce") / h
        return {
            **inner,
            "sync": work / h,
            "bytes_sent": vol.sent,
            "messages": 0,
            "latency": latency,
        }
    # gossip
    p2p = hw.intra_node if r * layout.tp * k <= hw.devices_per_node else hw.inter_node
    p2p = p2p.op("p2p")
    rounds = volume._period(algo, r)
    total = lat = 0.0
    for step in range(rounds):
        if algo.global_avg_every and (step + 1) % algo.global_avg_every == 0:
            total += average
            lat += 2 * collectives.ring_latency(r, link, "all_reduce")
            continue
        _, send_to = graphs.neighbours(algo.topology, r, 0, step)
        d = len(send_to)
        mix = costs.stream_time(hw, (d + 2) * shard_bytes)
        total += p2p.latency + d * shard_bytes / p2p.bandwidth + mix
        lat += p2p.latency
    return {
        **inner,
        "sync": total / rounds,
        "bytes_sent": vol.sent,
        "messages": vol.messages,
        "latency": lat / rounds,
    }


def _compressed(model, layout, hw, rt, algo, shapes, params) -> dict:
    codec, arg = algo.codec
    n, k = compress_group(layout)
    if layout.zero >= 2:  # reduce-scatter in the group, then the codec across groups
        inner = costs.dp_comm_time(params, layout.replace(dp=k, zero_shard_group=None), hw, rt)
        stride = layout.tp * k
    else:
        inner = {"grad": 0.0, "param": 0.0}
        if layout.zero == 1:  # the sharded optimizer's gather stays
            inner["param"] = costs.dp_comm_time(params, layout, hw, rt)["param"]
        stride = layout.tp
    shards = shard_shapes(shapes, k)
    elems = sum(math.prod(s) for s in shards)
    link = collectives.group_link(hw, n, stride)
    vol = volume.step_volume(algo, step=0, shapes=shards, n=n)
    msg = sum(volume.codec_message(codec, arg, s) for s in shards)
    sync, latency = 0.0, 2 * collectives.ring_latency(n, link, "all_reduce")
    if codec == "bf16":
        grad = collectives.all_reduce_time(msg, n, link)
        sync = costs.stream_time(hw, BF16_CASTS * elems)
    elif codec == "int8":  # the scales overlap the backward; the levels wait for them
        scales = volume.block_scale_bytes(shards)
        grad = collectives.all_reduce_time(scales, n, link)
        sync = collectives.all_reduce_time(msg - scales, n, link)
        sync += costs.stream_time(hw, (QSGD_ENCODE + INT8_DECODE) * elems)
        latency *= 2
    elif codec in ("qsgd", "topk"):
        grad = collectives.all_gather_time(n * msg, n, link)
        latency = collectives.ring_latency(n, link, "all_gather")
        work = QSGD_ENCODE + n * QSGD_DECODE if codec == "qsgd" else TOPK_WORK
        sync = costs.stream_time(hw, work * elems)
    else:  # PowerSGD: P (and what travels whole) overlaps; Q, the GEMMs and EF do not
        p_bytes = q_bytes = 0
        gemms = 0.0
        for s in shards:
            mat = volume.powersgd_matrix(s, arg)
            if mat is None:
                p_bytes += 4 * math.prod(s)
                continue
            rows, cols, r = mat
            p_bytes, q_bytes = p_bytes + 4 * r * rows, q_bytes + 4 * r * cols
            gemms += costs.gemm_time(hw, "fp32", rows, r, cols)  # M' Q
            gemms += costs.gemm_time(hw, "fp32", cols, r, rows)  # M'^T P^
            gemms += costs.gemm_time(hw, "fp32", rows, cols, r)  # P^ Q^T
        grad = collectives.all_reduce_time(p_bytes, n, link)
        sync = collectives.all_reduce_time(q_bytes, n, link) + gemms
        sync += costs.stream_time(hw, EF_STREAMS * elems)
        latency *= 2
    grad += inner["grad"]
    return {
        "grad": grad,
        "param": inner["param"],
        "sync": sync,
        "bytes_sent": vol.sent,
        "messages": 0,
        "latency": latency,
    }


def codec_buffers(codec: str, arg, n: int, bucket: float, tensor: float,
                  flying: tuple[float, ...]) -> list[tuple[float, float, bool]]:  # fmt: skip
    """The moments at which a gradient codec's buffers may peak as the backward launches a
    bucket of ``bucket`` elements whose largest tensor has ``tensor``, over n ranks
    (``compressed_grads``), with buckets of ``flying`` elements in flight (oldest first):
    (messages in flight, working set, whether the bucket's gradients have been copied
    into its flat buffer by then), in bytes. QSGD and top-k keep ``IN_FLIGHT`` buckets
    launched and not yet decoded, each its message and the n gathered: launching one more
    first decodes the oldest (QSGD: an fp32 copy of ``ENCODE_CHUNK`` elements at a time),
    then flattens and encodes the new bucket's tensors (QSGD: three fp32 copies and four
    bytes an element of a chunk; top-k: |g - g_i| whole, one fp32 copy), then makes its
    message and the gathered buffer beside its parts (the tensors' encoded levels, as
    large as the message) -- the new bucket's are working set until it is launched.
    bf16: the new bucket's cast beside those in flight. int8: a chunk's fp32 copy for its
    block scales (their 4 bytes a block in flight, 1/128 of the gradients, not counted).
    PowerSGD: nothing (its P factors, r (rows + cols) a matrix). ``plait rehearse`` of
    four llama blocks (h 2048, F 5632), ``--dp 16 --zero 1 --compress qsgd:4``: the peak
    as the newest's gathered buffer was made, 187 MiB of messages in flight and 198 of
    its own (2026-11-29)."""

    def message(elements: float) -> float:
        return volume.codec_message(codec, arg, (int(elements),))

    if codec not in volume.WINDOWED:
        chunk = min(tensor, volume.ENCODE_CHUNK)
        return [(0.0, 4 * chunk if codec == "int8" else 0.0, True)]
    copies = 1 if codec == "bf16" else 1 + n  # a bucket's buffers: its message (and the n)
    out = [(copies * sum(message(b) for b in flying), 0.0, False)]  # as its hook fires
    if len(flying) >= volume.IN_FLIGHT:  # the oldest decoded first
        chunk = min(flying[0], volume.ENCODE_CHUNK)
        out.append((out[0][0], 4 * chunk if codec == "qsgd" else 0.0, False))
        flying = flying[1:]
    before = copies * sum(message(b) for b in flying)
    msg = message(bucket)
    if codec == "bf16":
        return out + [(before, msg, True)]
    encode = 16 * min(tensor, volume.ENCODE_CHUNK) if codec == "qsgd" else 4 * tensor
    return out + [(before, encode, True), (before, copies * msg + msg, True)]


def state_bytes(
    model: ModelConfig, layout: Layout, algo: DPAlgoConfig | None, params: float
) -> float:
    """Device memory the algorithm keeps on one rank of ``params`` parameters through a
    step (module docstring): DiLoCo's anchor and outer momentum, a compressed local SGD
    sync's anchor, EF21's two estimates, PowerSGD's error. ``plait rehearse`` finds them
    at the step's peak, as "other"."""
    if algo is None or algo.plain:
        return 0.0
    if algo.grad_codec is not None:
        codec, _ = algo.codec
        _, k = compress_group(layout)
        return {"topk": 8.0, "powersgd": 4.0}.get(codec, 0.0) * params / k
    _, k = replicas_of(layout)
    shard = 4.0 * params / k
    if algo.algo == "diloco":
        return 2 * shard
    if algo.algo == "local-sgd" and algo.sync_codec is not None:
        return shard
    return 0.0


def sync_bytes(
    model: ModelConfig, layout: Layout, algo: DPAlgoConfig | None, params: float
) -> float:
    """The buffers of the algorithm's synchronisation after the optimizer step, beside its
    state: DiLoCo's outer gradients and a compressed local SGD sync's changes, packed,
    beside one ``--bucket-mb`` chunk of them being formed; local SGD's packed shards (with
    ``--sync-optimizer-state`` AdamW's two moments too) while they are averaged; gossip's d receive buffers, the packed chunk and its mix (one
    ``--bucket-mb`` chunk each)."""
    if algo is None or algo.plain or algo.grad_codec is not None:
        return 0.0
    r, k = replicas_of(layout)
    shard = 4.0 * params / k
    chunk = min(shard, layout.bucket_mb * 2**20)
    if algo.algo == "gossip":
        return (max(graphs.degree(algo.topology, r), 1) + 2) * chunk
    if algo.algo == "diloco" or algo.sync_codec is not None:  # ``mean_changes``: the
        return shard + chunk  # packed changes, and one chunk's differences being formed
    if algo.sync_optimizer_state:  # AdamW's two moments packed beside the parameters
        return 3 * shard
    return shard


def added_at_peak(
    model: ModelConfig, layout: Layout, algo: DPAlgoConfig | None, params: float, mem
) -> float:
    """What the algorithm adds to the peak of a rank whose own is ``mem``
    (``sim/memory.Memory``): its state, and the sync's buffers where they outgrow the
    step's own peak -- at the sync, after the optimizer step, the rank holds its weights,
    optimizer state and buffers, but no activations or gradients."""
    held = state_bytes(model, layout, algo, params)
    at_sync = mem.weights + mem.optimizer + mem.buffers + mem.overhead
    return held + max(0.0, at_sync + sync_bytes(model, layout, algo, params) - mem.total)
