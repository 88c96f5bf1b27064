"""One training step of one layout on one hardware entry: time, throughput and memory.

``simulate(model, layout, hardware)`` builds the per-action costs of ``costs.py``,
replays the pipeline schedule's real action lists (``parallel/pipeline/schedules.py``,
the lists the executor runs) with them, adds the data-parallel communication where the
runtime issues it and the optimizer step, and reports:

- ``iter_time_s`` and tokens/s;
- TFLOP/s per device in both conventions of ``model/sizes.py``: model FLOPs
  (``tflops_per_device``, ``mfu``; recomputation not counted, as the trainer's MFU) and
  hardware FLOPs (``hw_tflops_per_device``, ``hfu``; recomputation counted);
- peak memory per device (the fullest pipeline rank) and whether it fits;
- a breakdown of the step that adds up to ``iter_time_s`` (``breakdown``):
  ``compute`` and exposed ``tp_comm`` on the busiest pipeline rank, the pipeline
  ``bubble`` and exposed ``pp_comm`` (its idle time, split by replaying once more with
  free transfers), exposed ``dp_comm`` (gradient reduction past the rank's last
  backward, ZeRO gathers) and ``optimizer``; with ``--cp`` also ``cp_comm``, with
  ``--ep`` ``ep_comm`` (the experts' dispatch, ``sim/expert.py``); on a device whose
  host queues its kernels (``Hardware.host_overlap``) and cannot keep up, ``host``
  (``_host_overlapped``).

Mixtures of experts: every stage's MoE blocks cost ``layer_step(moe=True)`` and the
others the dense block's; the routed experts' gradients are reduced over their edp group
beside the dense ones over dp (``costs.dp_comm_time(experts=True)``), at the run's
``moe_imbalance`` (``sim/expert.py``).

Step timeline per pipeline rank r (every dp / tp replica of it behaves the same):
    replay the action lists -> r's compute ends at end_r
    gradients of a chunk are ready from the start of its last backward; overlapped
    reduction streams them from then, else starts at end_r -> finish_r
    step = max_r finish_r + the loss / grad-norm all-reduce (it syncs everyone)
           + optimizer + the ZeRO 1/2 weight all-gather where it is not overlapped.

Time sharing. When a node holds more devices than can compute at once
(``Hardware.compute_slots``: e.g. four single-thread worker processes on two CPU cores),
the busy ones share the slots: each runs at ``1 / f`` of full speed with
``f = max(1, A / slots)``, A the average number of the node's devices at work (their
compute, optimizer and communication time over the step, overlapped or not: a CPU
host's backend copies and reduces on the same cores). Every compute cost is scaled by f
and the step simulated again until f settles (a few rounds; A barely moves with f). A step
whose devices are all busy gets f = devices / slots, i.e. the node's total work over its
slots; a pipeline whose stages idle in bubbles shares less. ``time_sharing`` reports f.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.nccl_p2p import Timeline
from plait.parallel.pipeline.partition import partition_layers, stage_costs_from_model
from plait.parallel.pipeline.schedules import ScheduleError, pipeline_span
from plait.sim import costs, pipeline, step
from plait.sim import expert as ep_sim
from plait.sim.hardware import Hardware
from plait.sim.memory import Memory, chunk_blocks, memory_per_rank, stage_params
from plait.sim.pipeline import compile_schedule
from plait.sim.runtime import DEFAULT_RUNTIME, Runtime, get_runtime

FLOP_CONVENTION = (
    "tflops_per_device/mfu count model FLOPs (6 per weight per token + attention, no "
    "recomputation; plait.model.sizes); hw_tflops_per_device/hfu add recomputation"
)
BREAKDOWN_KEYS = ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer")


_DETAIL = ("memory_ranks", "busy_s", "timeline", "extras")


@dataclass(frozen=True)
class Result:
    iter_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # model FLOPs
    hw_tflops_per_device: float  # hardware FLOPs (with recomputation)
    mfu: float
    hfu: float
    peak_mem_bytes: float
    mem_capacity_bytes: float
    fits: bool
    breakdown: dict[str, float]
    memory: Memory  # the fullest pipeline rank
    memory_ranks: tuple[Memory, ...]  # every pipeline rank
    n_devices: int
    hardware: str
    runtime: str
    flop_convention: str = FLOP_CONVENTION
    time_sharing: float = 1.0  # compute slowed by this factor (module docstring)
    dp_algo: dict | None = None  # --dp-algo / --compress: per step bytes, messages, latency
    busy_s: tuple[float, ...] = field(default=(), repr=False, compare=False)  # per pp rank
    timeline: Timeline | None = field(default=None, repr=False, compare=False)
    extras: dict[int, list[tuple[str, float, float]]] = field(
        default_factory=dict, repr=False, compare=False
    )  # per pipeline rank: ("p2p" | "dp_comm" | "optimizer", start, end) to draw

    def to_dict(self) -> dict:
        """The figures (``--json``, ``plait plan``'s entries): every field but the per-rank
        detail (``memory_ranks``, ``busy_s``, ``timeline``, ``extras``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _DETAIL}
        return {**out, "breakdown": dict(self.breakdown), "memory": self.memory.to_dict()}


def simulate(
    model: ModelConfig,
    layout: Layout,
    hardware: Hardware,
    n_devices: int | None = None,
    *,
    runtime: Runtime | str = DEFAULT_RUNTIME,
    keep_timeline: bool = False,
    exact: bool = True,
    lora=None,
    dp_algo=None,
    moe_imbalance: float | None = None,
) -> Result:
    """Simulate one optimizer step. Raises ValueError (one actionable line) when the layout
    cannot run the model or the hardware lacks the dtype; a layout that does not fit in
    memory still gets a time, with ``fits`` False. ``n_devices``, when given, must equal
    dp x tp x pp. ``keep_timeline`` keeps the replayed per-rank events for drawing.

    ``lora`` (a ``LoRAConfig``): the memory of fine-tuning adapters over a frozen base
    (``memory.memory_per_rank``); the step's compute is still that of full training.

    ``exact=False`` skips the replay: the pipeline takes ``schedules.pipeline_span`` (m
    micro-batches on the rank that paces it, each other rank's share of the fill and
    drain, the transfers it waits on), and memory counts ``schedules.in_flight_bound``
    micro-batches. Much cheaper for pipelines of thousands of actions and within 0.03%
    of the replay on average (``benchmarks/closed_form.py``); for ranking many
    candidates before simulating the best exactly.

    ``dp_algo`` (a ``dp_algos.DPAlgoConfig``): price local SGD, DiLoCo, gossip or a
    compressed all-reduce instead of the plain one (``sim/dp_algos.py``).

    ``moe_imbalance``: a MoE model's most-loaded expert over the mean (``sim/expert.py``;
    default the runtime's, 1.0: balanced)."""
    rt = get_runtime(runtime) if isinstance(runtime, str) else runtime
    if dp_algo is not None and dp_algo.grad_codec is not None:  # its buffers in the backward
        rt = dataclasses.replace(rt, grad_codec=dp_algo.codec)
    if moe_imbalance is not None:
        rt = dataclasses.replace(rt, moe_imbalance=moe_imbalance)
    ep_sim.check_imbalance(model, rt.moe_imbalance)
    if dp_algo is not None and model.moe and not dp_algo.plain:
        raise ValueError("--dp-algo / --compress with --moe-experts is not modelled yet; use "
                         "the plain all-reduce")  # fmt: skip
    res = _simulate(model, layout, hardware, n_devices, rt, keep_timeline, exact, lora, dp_algo)
    on_node = min(layout.world_size, hardware.devices_per_node)
    if on_node <= hardware.compute_slots:
        return res
    block = layout.dp * layout.cp * layout.tp  # global ranks per pipeline rank
    share = 1.0
    for _ in range(12):
        active = sum(min(1.0, res.busy_s[g // block] / res.iter_time_s) for g in range(on_node))
        new = max(1.0, active / hardware.compute_slots)  # busy_s already run at 1/share
        if abs(new - share) <= 0.002 * share:
            break
        share = new
        res = _simulate(model, layout, _slowed(hardware, share), n_devices, rt, keep_timeline,
                        exact, lora, dp_algo)  # fmt: skip
    return dataclasses.replace(res, mfu=res.mfu / share, hfu=res.hfu / share, time_sharing=share)


def _slowed(hw: Hardware, f: float) -> Hardware:
    """``hw`` with every compute rate divided by ``f``, and the host's time per kernel
    multiplied by it (links as measured)."""
    peaks = {k: (v / f if v else v) for k, v in dataclasses.asdict(hw.peak_flops).items()}
    return hw.replace(
        peak_flops=hw.peak_flops.__class__(**peaks),
        memory_bandwidth=hw.memory_bandwidth / f,
        elementwise_bandwidth=hw.elementwise_bw / f,
        op_overhead=hw.op_overhead * f,
        optimizer_tensor_overhead=hw.optimizer_tensor_overhead * f,
    )


def _simulate(model, layout, hw, n_devices, rt, keep_timeline, exact, lora=None,
              dp_algo=None) -> Result:  # fmt: skip
    if hw.host_overlap and (hw.op_overhead or hw.optimizer_tensor_overhead or hw.launch_s):
        return _host_overlapped(model, layout, hw, n_devices, rt, keep_timeline, exact, lora,
                                dp_algo)  # fmt: skip
    layout.check_model(model)
    if dp_algo is not None:
        dp_algo.check_layout(layout)
    if n_devices is not None and n_devices != layout.world_size:
        raise ValueError(
            f"--gpus {n_devices} does not match --dp {layout.dp} x --tp {layout.tp} x "
            f"--pp {layout.pp}{f' x --cp {layout.cp}' if layout.cp > 1 else ''} = "
            f"{layout.world_size}"
        )
    peak = hw.peak(layout.dtype)  # raises if the dtype has no fast path
    p, v, m = layout.pp, layout.vpp, layout.num_microbatches
    S = p * v
    stage_layers = layers_per_stage(model, layout)
    stage_moe = ep_sim.stage_moe_layers(model, stage_layers)
    compiled = None
    if exact:
        try:
            compiled = compile_schedule(layout.schedule, p, m, v)
        except ScheduleError as e:
            raise ValueError(str(e)) from None

    cost, split = _action_costs(model, layout, hw, rt, stage_layers, stage_moe)
    p2p = step.stage_messages(model, layout, hw)
    if compiled is not None:
        rep = pipeline.run(compiled, cost, p2p, record=keep_timeline)
    else:
        rep = _formula_pipeline(layout, cost, p2p)
    ends, windows, timeline = rep.ends, rep.windows, rep.timeline
    pipe_end, free_end = max(ends), max(rep.free_ends)

    # Gradient reduction per pipeline rank, then the step's global sync.
    # (layers, first, last, MoE layers) of each rank's chunks: what it holds
    chunks = [
        [(stage_layers[c * p + r], c * p + r == 0, c * p + r == S - 1, stage_moe[c * p + r])
         for c in range(v)]
        for r in range(p)
    ]  # fmt: skip
    per_expert_layer = ep_sim.expert_params(model, layout)
    chunk_experts = [[chunk[3] * per_expert_layer for chunk in row] for row in chunks]
    chunk_params = [[stage_params(model, layout, *chunk) for chunk in row] for row in chunks]
    params = [sum(row) for row in chunk_params]
    experts = [sum(row) for row in chunk_experts]
    tensors = [sum(costs.stage_tensors(model, *chunk) for chunk in row) for row in chunks]
    tied_sync = step.tied_sync(model, layout, hw, rt)
    finish, gathers, dp_work, syncs = [], [], [], []
    extras = {r: [("p2p", a, b) for a, b in spans] for r, spans in rep.transfer_waits.items()}
    for r in range(p):
        dp = _dp_time(model, layout, hw, rt, dp_algo, [c[:3] for c in chunks[r]], params[r],
                      experts[r])  # fmt: skip
        syncs.append(dp["sync"])
        t_grad = dp["grad"] + (tied_sync if r in (0, p - 1) else 0.0)
        if rt.overlap_grad_reduce and t_grad > 0:
            held = params[r] + experts[r]
            shares = [  # (chunk, share of the bytes, buckets)
                (c, n / held, costs.grad_buckets(n, stage_layers[c * p + r], layout, rt))
                for c, n in enumerate(a + b for a, b in zip(chunk_params[r], chunk_experts[r]))
            ]
            done = _overlapped_reduce(windows[r], shares, t_grad)
            # the backward it ran beside is slowed for the time they shared the device
            hidden = max(0.0, t_grad - max(0.0, done - ends[r]))
            done = max(done, ends[r] + hw.overlap_slowdown * hidden)
        else:
            done = ends[r] + t_grad
        finish.append(max(done, ends[r]))
        gathers.append(dp["param"])
        dp_work.append(t_grad + dp["param"] + dp["sync"])
        if finish[r] > ends[r]:
            extras.setdefault(r, []).append(("dp_comm", ends[r], finish[r]))
    stats = step.stats_time(layout, hw)
    step_sync = max(finish) + stats
    if stats:
        for r in range(p):
            extras.setdefault(r, []).append(("dp_comm", step_sync - stats, step_sync))
    opts = [costs.optimizer_time(n, layout, hw, rt, k, x)
            for n, k, x in zip(params, tensors, experts)]  # fmt: skip
    opt = max(opts)
    gather = max(
        step.exposed_weight_gather(t, cost[r][0][0], rt, hw) for r, t in enumerate(gathers)
    )
    sync = max(syncs)  # dp_algos: averaging / mixing / decoding after the step, exposed
    iter_time = step_sync + opt + gather + sync
    for r in range(p):
        extras.setdefault(r, []).append(("optimizer", step_sync, step_sync + opt))
        if gather + sync > 0:
            extras[r].append(("dp_comm", step_sync + opt, iter_time))

    # Breakdown on the busiest pipeline rank; every chunk's F and B run m times.
    busy = [m * sum(sum(x) for x in split[r]) for r in range(p)]
    crit = max(range(p), key=busy.__getitem__)
    comp, tp, z3, cp, ep = (m * sum(x[i] for x in split[crit]) for i in range(5))
    idle = max(0.0, pipe_end - busy[crit])
    pp_comm = min(idle, max(0.0, pipe_end - free_end))
    breakdown = {
        "compute": comp,
        "bubble": idle - pp_comm,
        "tp_comm": tp,
        "pp_comm": pp_comm,
        "dp_comm": z3 + (step_sync - pipe_end) + gather + sync,
        "optimizer": opt,
    }
    if layout.cp > 1:  # exposed context-parallel exchanges (sim/context.py)
        breakdown["cp_comm"] = cp
    if layout.ep > 1:  # exposed expert dispatch (sim/expert.py)
        breakdown["ep_comm"] = ep

    memory = memory_per_rank(model, layout, rt, stage_layers, hw.framework_overhead_bytes, compiled,
                             lora=lora)  # fmt: skip
    fullest = max(memory, key=lambda mem: mem.total)
    algo_mem, algo_info = 0.0, None
    if dp_algo is not None:
        from plait.sim import dp_algos as sim_dp

        algo_mem = max(sim_dp.added_at_peak(model, layout, dp_algo, n, mem)
                       for n, mem in zip(params, memory))  # fmt: skip
        busiest = _dp_time(model, layout, hw, rt, dp_algo, [c[:3] for c in chunks[crit]],
                           params[crit])  # fmt: skip
        algo_info = {k: busiest[k] for k in ("bytes_sent", "messages", "latency")}
        algo_info.update(label=dp_algo.label(), state_bytes=algo_mem, sync_s=sync)
    model_flops, hw_flops = costs.flops_per_step(model, layout, stage_layers)
    n = layout.world_size
    return Result(
        iter_time_s=iter_time,
        tokens_per_s=layout.global_batch_size * model.seq_len / iter_time,
        tflops_per_device=model_flops / iter_time / n / 1e12,
        hw_tflops_per_device=hw_flops / iter_time / n / 1e12,
        mfu=model_flops / iter_time / n / peak,
        hfu=hw_flops / iter_time / n / peak,
        peak_mem_bytes=fullest.total + algo_mem,
        mem_capacity_bytes=hw.memory_bytes,
        fits=fullest.total + algo_mem <= hw.memory_bytes,
        breakdown=breakdown,
        memory=fullest,
        memory_ranks=tuple(memory),
        n_devices=n,
        hardware=hw.name,
        runtime=rt.name,
        timeline=timeline,
        busy_s=tuple(
            m * sum(sum(x) for x in split[r])  # compute, tp and ZeRO-3 communication
            + m * v * (sum(p2p[r]) if p > 1 else 0.0)  # activations out, gradients back
            + dp_work[r]
            + opts[r]
            for r in range(p)
        ),
        extras=extras if keep_timeline else {},
        dp_algo=algo_info,
    )


def _host_overlapped(model, layout, hw, n_devices, rt, keep_timeline, exact, lora,
                     dp_algo) -> Result:  # fmt: skip
    """The step on a device whose host queues kernels ahead of it (``Hardware.host_overlap``,
    a GPU): host and device work side by side and the step takes the longer of the two.

    The device's step is the step with no host costs. Pipeline rank r's host time is what
    those costs add to its busy time: its kernels times ``op_overhead``, its parameter
    tensors times ``optimizer_tensor_overhead``, its extra launches times ``launch_s``.
    The step is the longer of the device's step and the busiest host's time: within a step
    the queue lets the host run ahead (its depth, ~1,000 kernels, is more than a layer
    issues), and the step's one host sync ends both. A host-bound step shows the excess as
    ``breakdown["host"]``. Summing the two instead (a CPU worker, ``host_overlap`` False)
    priced a GPU's overhead-bound small steps right and its compute-bound large ones ~2x too
    slow, whatever the fit (``plait calibrate --device cuda`` on an H100)."""
    device = _simulate(model, layout, hw.device_only(), n_devices, rt, keep_timeline, exact,
                       lora, dp_algo)  # fmt: skip
    both = _simulate(model, layout, hw.replace(host_overlap=False), n_devices, rt, False, exact,
                     lora, dp_algo)  # fmt: skip
    host = max(b - d for b, d in zip(both.busy_s, device.busy_s))
    if host <= device.iter_time_s:
        return device
    f = device.iter_time_s / host
    return dataclasses.replace(
        device,
        iter_time_s=host,
        tokens_per_s=device.tokens_per_s * f,
        tflops_per_device=device.tflops_per_device * f,
        hw_tflops_per_device=device.hw_tflops_per_device * f,
        mfu=device.mfu * f,
        hfu=device.hfu * f,
        breakdown={**device.breakdown, "host": host - device.iter_time_s},
    )


def layers_per_stage(model: ModelConfig, layout: Layout) -> list[int]:
    """Layers of every virtual stage, as the runtime cuts them: ``--pp-layout`` if given,
    else ``--pp-partition`` -- ``uniform``, or ``balanced`` by the FLOP costs the runtime's
    partitioner reads (``partition.stage_costs_from_model``: blocks and the head on the
    last stage; the same call as ``parallel/pipeline/stage.py``'s ``stage_layers``)."""
    S = layout.num_stages
    if layout.pp_layout is not None:
        parts = partition_layers(model.n_layers, S, method="explicit", explicit=layout.pp_layout)
    elif layout.pp_partition == "balanced":
        per_layer, first, last = stage_costs_from_model(model, model.seq_len)
        parts = partition_layers(model.n_layers, S, method="balanced", layer_costs=per_layer,
                                 first_extra=first, last_extra=last)  # fmt: skip
    else:
        parts = partition_layers(model.n_layers, S, method="uniform")
    return [len(r) for r in parts]


def _dp_time(model, layout, hw, rt, dp_algo, chunks, params, experts=0.0) -> dict:
    """{"grad", "param", "sync"} seconds of one pipeline rank's dp work (``dp_algos``);
    ``experts``: routed expert weights, reduced over their edp group after the dense ones."""
    if dp_algo is None:
        out = costs.dp_comm_time(params, layout, hw, rt)
        if experts:
            more = costs.dp_comm_time(experts, layout, hw, rt, experts=True)
            out = {k: out[k] + more[k] for k in out}
        return {**out, "sync": 0.0}
    from plait.sim import dp_algos as sim_dp

    return sim_dp.comm_time(model, layout, hw, rt, dp_algo, chunks=chunks, params=params)


def _formula_pipeline(layout, cost, p2p):
    """Closed-form stand-in for the replay (``exact=False``), without a timeline: the
    pipeline's span from ``schedules.pipeline_span``, with the transfers the pacing rank
    waits on. Chunk c's gradient window ends c p of its backwards before the end, as the
    replay's do in a balanced interleaved pipeline (before: every chunk at the end, which
    left the Megatron-LM README's interleaved rows' reduction exposed: 8.7% held out
    closed, 7.3% replayed; now 7.5%)."""
    p, v, m = layout.pp, layout.vpp, layout.num_microbatches
    hop = max(max(pair) for pair in p2p) if p > 1 else 0.0
    try:
        free = pipeline_span(layout.schedule, m, cost)
        end = pipeline_span(layout.schedule, m, cost, hop)
    except ScheduleError as e:
        raise ValueError(str(e)) from None
    # chunk c's last backward ends c p backwards of a chunk, each with its gradient's
    # message, before the rank's end (the cool-down runs the chunks in reverse, p
    # micro-batches each; the replay's, balanced); under ZB-H1 the last is a weight
    # gradient, deferred to the end
    last = 3 if layout.schedule == "zb-h1" else 1
    windows = [{c: (end - c * p * (row[c][1] + hop) - row[c][last], end - c * p * (row[c][1] + hop))
                for c in range(v)} for row in cost]  # fmt: skip
    return pipeline.Replay([end] * p, [free] * p, windows)


def _action_costs(model, layout, hw, rt, stage_layers, stage_moe):
    """``cost[rank][chunk]`` = (F, B, BI, W) seconds of one micro-batch, and ``split[rank]
    [chunk]`` = (compute, exposed tp, exposed ZeRO-3, exposed cp, exposed ep) seconds of
    F + B together; ``stage_moe[stage]`` of a stage's layers are MoE blocks."""
    p, v = layout.pp, layout.vpp
    S = p * v

    def steps(lay):  # (dense, routed) blocks' LayerStep under ``lay``
        dense = step.layer_step(model, lay, hw, rt)
        return dense, step.layer_step(model, lay, hw, rt, moe=True) if model.moe else dense

    # --recompute-layers: a chunk's first blocks recompute, the rest do not (counts below)
    kinds = {True: steps(layout.recomputing_all())}
    if layout.recompute_layers is not None:
        kinds[False] = steps(layout.without_recompute())
    emb = costs.embedding_cost(model, layout, hw)
    head = costs.head_cost(model, layout, hw, rt)
    none = costs.EndCost()
    cost, split = [], []
    for rank in range(p):
        row, parts = [], []
        for chunk in range(v):
            stage = chunk * p + rank
            e = emb if stage == 0 else none
            hd = head if stage == S - 1 else none
            f = bi = w = 0.0
            comp = tp = z3 = cp = ep = 0.0
            for recomputed, (n, k) in chunk_blocks(model, layout, stage_layers, stage).items():
                dense, routed = kinds[recomputed]
                f += n * dense.fwd + k * routed.fwd
                bi += n * dense.bwd_input + k * routed.bwd_input
                w += n * dense.bwd_weight + k * routed.bwd_weight
                more = (n * x + k * y for x, y in zip(dense.parts, routed.parts))
                comp, tp, z3, cp, ep = (a + b for a, b in zip((comp, tp, z3, cp, ep), more))
            f = f + e.fwd + e.fwd_tp + hd.fwd + hd.fwd_tp  # (summed in this order)
            bi = bi + hd.bwd_input + hd.bwd_tp
            w = w + e.bwd_weight + hd.bwd_weight
            row.append((f, bi + w, bi, w))
            comp += e.fwd + hd.fwd + hd.bwd_input + e.bwd_weight + hd.bwd_weight
            parts.append((comp, tp + e.fwd_tp + hd.fwd_tp + hd.bwd_tp, z3, cp, ep))
        cost.append(tuple(row))
        split.append(parts)
    return tuple(cost), split


def _overlapped_reduce(windows, shares, t_grad):
    """When a rank's bucketed gradient reduction ends. A chunk's n buckets fill evenly
    during its last backward (window start..end, one every d = (end - start) / n) and
    leave one after another, each taking tau = its share of ``t_grad`` / n: the last
    leaves at ``max(max(cursor, start + d) + n tau, end + tau)`` (the stream keeps up
    with the backward, or the backward outruns it); chunks in the order they finish."""
    cursor = 0.0
    for chunk, share, buckets in sorted(shares, key=lambda x: windows[x[0]][1]):
        start, end = windows[chunk]
        n = max(1, buckets)
        tau = t_grad * share / n
        cursor = max(max(cursor, start + (end - start) / n) + n * tau, end + tau)
    return cursor
