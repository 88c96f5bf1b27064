"""``plait calibrate``: measure the machine it runs on and write a hardware file that
``plait simulate`` and ``plait plan`` accept (``--hardware calibrated.yaml``).

    plait calibrate                        # ~1-2 minutes; writes calibrated.yaml
    plait calibrate --quick --out hw.yaml  # a short sweep, under 30 s
    plait calibrate --procs 8 --dtypes fp32,bf16

A "device" is one worker process with ``--threads`` threads (as ``plait train
--threads``), and the file describes ``--procs`` of them busy at once: the sweep runs in
``--procs`` worker processes started together, every one of them measuring the compute
at the same time, so that on a host with fewer cores than processes (or other work on
it) each process's share is what gets measured -- as the training workers will see it.
Calibrate for the process count you will train with (``--procs 1`` for one process, no
collectives). What each worker measures:

- matrix multiplies over a sweep of shapes (squares, and the (tokens x hidden) products
  of small transformers, in both the forward and the two backward orientations) in
  each dtype asked for;
- fused attention (``scaled_dot_product_attention``, causal, forward + backward);
- sustained memory bandwidth (copies of a tensor much larger than the caches);
- collectives through the backend the trainer uses (gloo on CPU, NCCL on CUDA), on
  groups of 2..``--procs`` of the worker processes: all-reduce, all-gather and
  reduce-scatter (the calls ``comm.py`` makes) over message sizes from 1 KiB to 16 MiB,
  and point-to-point transfers (``batch_isend_irecv`` ping-pong, half the round trip);
- one training step of plait's own model as ``plait train`` runs it (runner, data-parallel
  engine, global statistics, clipping, AdamW) in a few probe sizes (``PROBES``, unlike
  the benchmarked ones), in a single process each;
- what a worker holds before any model exists (resident memory after importing torch
  and joining the process group): the framework overhead.

Each figure is the median of several timed repetitions (the slowest rank's time, for
collectives). Then it fits the simulator's own models (``sim/hardware.py``,
``sim/costs.py``) by least squares on log time, so the relative error counts the same
for small and large operations:

- ``Efficiency``: a GEMM of F FLOPs and reduction length k takes
  ``max((F + gemm_half_flops) (k + gemm_half_k) / (k peak gemm_max), bytes / bandwidth)``;
  grid search over (gemm_half_k, gemm_half_flops, peak x gemm_max). ``peak`` is the
  fastest throughput measured (what the trainer's MFU divides by on CPU), so
  ``gemm_max`` <= 1. ``attention`` is the simulator's attention FLOPs (3.5 x the causal
  forward's) over the measured time, as a fraction of peak.
- The optimizer: the probe steps' tail (gradient norm, clipping, AdamW, zeroing) beyond
  its bytes at the elementwise rate, per parameter tensor: ``optimizer_tensor_overhead``
  (``fit_optimizer``; per-tensor loops on a CPU).
- Model steps: the host time per kernel (``op_overhead``) and a common scale of the GEMM
  level (``gemm_max``, at most 1) are then fitted over a grid until ``simulate`` best
  reproduces the probe steps (``fit_probes``): a framework's per-operation overheads and
  a step's cache misses, which bare matmuls on hot operands do not see, land there.
- ``Link``: latency alpha and bandwidth B such that ``costs.all_reduce_time``,
  ``all_gather_time``, ``reduce_scatter_time`` and ``p2p_time`` best match every
  measured collective (grid over alpha, B). One host: ``intra_node`` and ``inter_node``
  are the same link and ``devices_per_node`` covers every process.

The file's ``description`` records the fit residuals; ``plait calibrate`` prints every
measured collective beside its fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

GiB = 2**30
DTYPES = ("fp32", "bf16", "fp16")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    """What to measure. ``procs``: worker processes measured at once (module docstring)."""

    quick: bool = False
    procs: int = 2
    threads: int = 1
    dtypes: tuple[str, ...] = ("fp32",)
    device: str = "cpu"
    name: str = "calibrated"

    @property
    def rounds(self) -> int:
        """Passes over the compute measurements (``measure_compute``)."""
        return 2 if self.quick else 3

    @property
    def compute_slots(self) -> int:
        """Processes that can compute at full speed at once: the GPUs, or the CPU cores
        this process may use divided by the threads per worker."""
        if self.device == "cuda":
            return self.procs
        return max(1, len(os.sched_getaffinity(0)) // self.threads)

    @property
    def compute_procs(self) -> int:
        """Workers that measure compute together: never more than the slots, so the file
        describes a device at full speed and ``simulate`` shares the slots itself."""
        return min(self.procs, self.compute_slots)

    def __post_init__(self) -> None:
        if self.procs < 1:
            raise ValueError(f"--procs must be at least 1, got {self.procs}")
        if self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad or "fp32" not in self.dtypes:
            raise ValueError(f"--dtypes must include fp32 and be among {', '.join(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose cpu or cuda")


# -- timing --------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _median_time(fn, device: str, *, min_s: float, reps: int) -> float:
    """Median seconds of one ``fn()`` call: ``reps`` timed batches of enough calls to last
    ``min_s`` each (after one warm-up call)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_s / one))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


# -- compute -------------------------------------------------------------------------------


def gemm_cases(quick: bool) -> list[tuple[int, int, int, str]]:
    """(m, n, k, kind) of the sweep: ``square`` products, and the small-transformer
    products of a linear layer with n outputs, k inputs and T tokens: ``forward`` (T, n,
    k), ``input_grad`` (T, k, n) and ``weight_grad`` (n, k, T) (tokens T, hidden h, FFN
    4h)."""
    squares = [64, 256, 1024] if quick else [32, 64, 128, 256, 512, 1024]
    cases = {(s, s, s, "square") for s in squares}
    tokens = [256, 1024] if quick else [128, 512, 2048]
    hiddens = [64, 256] if quick else [64, 128, 256, 512]
    for T in tokens:
        for h in hiddens:
            for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
                cases |= {(T, n, k, "forward"), (T, k, n, "input_grad"), (n, k, T, "weight_grad")}
    return sorted(cases)


def gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    """The distinct (m, n, k) of ``gemm_cases``."""
    return sorted({c[:3] for c in gemm_cases(quick)})


def measure_matmuls(
    cfg: CalibrateConfig, log=print, sync=lambda: None
) -> list[tuple[str, int, int, int, float]]:
    """(dtype, m, n, k, seconds) of ``(m x k) @ (k x n)`` over ``gemm_shapes``; ``sync()``
    before each shape keeps concurrent workers on the same one. Squares multiply
    contiguous matrices; the transformer shapes are run with the operand layouts a linear
    layer has: forward ``x W^T``, input gradient ``g W``, weight gradient ``g^T x``."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    min_s, reps = (0.004, 2) if cfg.quick else (0.01, 3)
    out = []
    for dtype in cfg.dtypes:
        shapes = gemm_cases(cfg.quick)
        if dtype != "fp32":  # the curve is fitted on fp32; other dtypes only need a peak
            shapes = [s for s in shapes if s[3] == "square" and s[0] >= 256]
        for m, n, k, kind in shapes:
            a, b = _linear_operands(m, n, k, kind, dt[dtype], cfg.device)
            sync()
            t = _median_time(lambda a=a, b=b: a @ b, cfg.device, min_s=min_s, reps=reps)
            out.append((dtype, m, n, k, t))
        best = max(2 * m * n * k / t for d, m, n, k, t in out if d == dtype)
        log(f"  matmul {dtype}: {len(shapes)} shapes, best {best / 1e9:.1f} GFLOP/s")
    return out


def _linear_operands(m: int, n: int, k: int, kind: str, dtype, device):
    """Operands of ``(m x k) @ (k x n)`` laid out as a linear layer has them
    (``gemm_cases``): the forward multiplies by the transposed weight (x W^T), the input
    gradient by the weight as stored (g W), the weight gradient takes the transposed
    output gradient (g^T x)."""
    import torch

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if kind == "forward":
        return randn(m, k), randn(n, k).t()
    if kind == "weight_grad":
        return randn(k, m).t(), randn(k, n)
    return randn(m, k), randn(k, n)  # square, input_grad


def measure_attention(
    cfg: CalibrateConfig, sync=lambda: None
) -> list[tuple[int, int, int, int, float]]:
    """(batch, heads, seq, head size, seconds) of causal fused attention, forward +
    backward."""
    import torch
    import torch.nn.functional as F

    shapes = [(4, 4, 128, 32)] if cfg.quick else [(4, 4, 128, 32), (2, 8, 256, 64), (1, 8, 512, 64)]
    min_s, reps = (0.01, 2) if cfg.quick else (0.02, 3)
    out = []
    for b, a, s, d in shapes:
        q, k, v = (torch.randn(b, a, s, d, device=cfg.device, requires_grad=True) for _ in range(3))

        def step(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        sync()
        out.append((b, a, s, d, _median_time(step, cfg.device, min_s=min_s, reps=reps)))
    return out


def measure_stream(cfg: CalibrateConfig) -> float:
    """Sustained bytes/s of a large copy (read + write counted)."""
    import torch

    n = (8 if cfg.quick else 32) * 2**20  # floats: 32 / 128 MiB, far past the caches
    src = torch.randn(n, device=cfg.device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), cfg.device, min_s=0.02, reps=3 if cfg.quick else 5)
    return 2 * 4 * n / t


ELEMENTWISE = (  # (arch, tokens, hidden, heads): the memory-bound kernels of one layer
    ("gpt2", 2048, 128, 4),
    ("gpt2", 1024, 256, 8),
    ("llama", 2048, 128, 4),
    ("llama", 1024, 256, 8),
)


def elementwise_bytes(arch: str, tokens: int, hidden: int, heads: int) -> float:
    """Bytes the simulator counts for the memory-bound kernels of one layer, forward and
    backward (``costs.layer_cost``: 10 h + 2 f (gpt2) or 3 f + 2 (a + k) d (llama)
    elements per token forward, twice that backward, fp32)."""
    f = 4 * hidden
    per_token = 10 * hidden + (2 * f if arch == "gpt2" else 3 * f + 4 * hidden)
    return 3 * 4 * per_token * tokens


def measure_elementwise(cfg: CalibrateConfig, sync=lambda: None) -> list[tuple[tuple, float]]:
    """Seconds of the memory-bound kernels of one transformer layer, forward and backward,
    as plait's model runs them: two norms (LayerNorm or plait's RMSNorm), two residual
    adds, the MLP activation (tanh GELU, or SiLU times the up projection) and, for llama,
    rotary embeddings of q and k. One row per ``ELEMENTWISE`` shape."""
    import torch
    import torch.nn.functional as F

    from plait.model.config import ModelConfig
    from plait.model.transformer import apply_rotary, make_norm, rotary_tables

    min_s, reps = (0.01, 2) if cfg.quick else (0.02, 3)
    out = []
    for shape in ELEMENTWISE[::2] if cfg.quick else ELEMENTWISE:
        arch, T, h, a = shape
        mc = ModelConfig(arch=arch, n_layers=1, hidden=h, n_heads=a, seq_len=128, vocab_size=256)
        n1, n2 = make_norm(mc).to(cfg.device), make_norm(mc).to(cfg.device)
        for n in (n1, n2):
            torch.nn.init.ones_(n.weight)
        x = torch.randn(T, h, device=cfg.device, requires_grad=True)
        u = torch.randn(T, 4 * h, device=cfg.device, requires_grad=True)
        g = torch.randn(T, 4 * h, device=cfg.device, requires_grad=True)
        q = torch.randn(T // 128, a, 128, h // a, device=cfg.device, requires_grad=True)
        k = torch.randn(T // 128, a, 128, h // a, device=cfg.device, requires_grad=True)
        cos, sin = rotary_tables(mc, 128, cfg.device)

        def layer(arch=arch, x=x, u=u, g=g, q=q, k=k, n1=n1, n2=n2, cos=cos, sin=sin):
            r1 = x + n1(x)
            r2 = r1 + n2(r1)
            outs = [r2, F.gelu(u, approximate="tanh") if arch == "gpt2" else F.silu(g) * u]
            if arch == "llama":
                outs += [apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        sync()
        out.append((shape, _median_time(layer, cfg.device, min_s=min_s, reps=reps)))
    return out


def fit_elementwise(rows) -> float:
    """Bytes/s at which the simulator's byte count of the measured kernels takes the
    measured time (geometric mean over the rows)."""
    return float(np.exp(np.mean([np.log(elementwise_bytes(*shape) / t) for shape, t in rows])))


def measure_compute(cfg: CalibrateConfig, log=None, sync=lambda: None) -> dict:
    """Memory bandwidth, the matmul sweep, attention, elementwise kernels and model steps,
    in this process; ``sync()`` (a barrier, in workers) before each measurement keeps
    them measuring together.

    The whole set is measured ``cfg.rounds`` times over and each figure is the median of
    its rounds: a shared or virtual host changes speed for a fraction of a second at a
    time (a 1024^3 matmul on one thread moves between ~80 and ~125 GFLOP/s here), and a
    round seconds later catches the same shape at another moment."""
    import torch

    torch.set_num_threads(cfg.threads)
    passes = []
    for i in range(cfg.rounds):
        sync()
        passes.append({
            "stream": measure_stream(cfg),
            "elementwise": measure_elementwise(cfg, sync),
            "matmul": measure_matmuls(cfg, (log or (lambda m: None)) if i == 0 else (lambda m: None),
                                      sync),
            "attention": measure_attention(cfg, sync),
            **dict(zip(("probe", "optimizer"), measure_probes(cfg, sync))),
        })  # fmt: skip
    return median_of(passes)


def median_of(passes: list[dict]) -> dict:
    """Per-figure median of several measurements of the same set (rounds, or workers):
    ``stream`` is a number, every other key a list of rows whose last element is seconds."""
    return {
        "stream": statistics.median(p["stream"] for p in passes),
        **{key: [(*row[:-1], statistics.median(p[key][i][-1] for p in passes))
                 for i, row in enumerate(passes[0][key])]
           for key in ("matmul", "attention", "elementwise", "probe", "optimizer")},
    }  # fmt: skip


PROBES = (  # (layers, hidden, heads, seq, batch, micro-batch, vocab): overhead- to
    (2, 128, 4, 128, 1, 1, 512),  # compute-bound; the third accumulates 8 micro-batches
    (2, 256, 8, 128, 8, 8, 1024),
    (2, 96, 4, 128, 16, 2, 512),
    (3, 192, 6, 256, 4, 4, 512),
)


def probe_case(probe: tuple):
    """(``ModelConfig``, fp32 ``Layout``) of one of ``PROBES``."""
    from plait.layout import Layout
    from plait.model.config import ModelConfig

    layers, hidden, heads, seq, batch, micro, vocab = probe
    model = ModelConfig(n_layers=layers, hidden=hidden, n_heads=heads, seq_len=seq,
                        vocab_size=vocab)  # fmt: skip
    return model, Layout(global_batch_size=batch, micro_batch_size=micro, dtype="fp32")


def measure_probes(cfg: CalibrateConfig, sync=lambda: None) -> tuple[list, list]:
    """Seconds of one single-process training step of plait's own model for each of
    ``PROBES`` (every other one when ``quick``), run the way ``plait train`` runs it: the
    micro-batches through ``LocalRunner``, the data-parallel engine (flat gradient
    buffers, also at dp 1), the global statistics, clipping and AdamW step of
    ``train.loop.train``, on real next-token targets. Returns (steps, tails): rows
    (probe, seconds) of the whole step, and of its part after the backward (gradient
    norm, clipping, AdamW, zeroing; ``fit_optimizer``)."""
    import functools
    import math

    import torch

    from plait.model.transformer import build_model
    from plait.parallel.engine import DataParallelConfig, build_data_parallel
    from plait.topology import Topology
    from plait.train import optim
    from plait.train.config import TrainConfig
    from plait.train.loop import LocalRunner, autocast_factory

    out, tails = [], []
    tcfg = TrainConfig()
    topo = Topology.single(cfg.device)
    for probe in PROBES[::2] if cfg.quick else PROBES:
        model_cfg, layout = probe_case(probe)
        seq, vocab = model_cfg.seq_len, model_cfg.vocab_size
        batch, micro = layout.global_batch_size, layout.micro_batch_size
        model = build_model(model_cfg, topo=topo, device=cfg.device)
        engine = build_data_parallel(
            model, topo=topo, cfg=DataParallelConfig.from_layout(layout),
            make_optimizer=functools.partial(optim.build_adamw, cfg=tcfg),
            owns_grad=functools.partial(optim.owns_grad, topo=topo),
        )  # fmt: skip
        runner = LocalRunner(model, autocast=autocast_factory("fp32", torch.device(cfg.device)))
        rows = torch.randint(0, vocab, (batch, seq + 1), device=cfg.device)

        tail = []

        def step(engine=engine, runner=runner, rows=rows, micro=micro, batch=batch, seq=seq,
                 tail=tail):  # fmt: skip
            # as one iteration of train.loop.train
            loss = runner.train_step(list(rows.split(micro)), loss_scale=1.0,
                                     tokens_global=batch * seq)  # fmt: skip
            engine.finish()
            _sync(cfg.device)
            t0 = time.perf_counter()
            grad_sq, _ = optim.global_stats([engine.grad_sq_local(), loss], topo)
            engine.scale_grads_(optim.clip_coef(math.sqrt(grad_sq), tcfg.grad_clip))
            engine.step(tcfg.lr)
            engine.zero_grad()
            _sync(cfg.device)
            tail.append(time.perf_counter() - t0)

        sync()
        out.append((probe, _median_time(step, cfg.device, min_s=0.0, reps=2 if cfg.quick else 3)))
        tails.append((probe, statistics.median(tail[1:])))  # past the warm-up call
    return out, tails


# -- communication -------------------------------------------------------------------------


def message_sizes(quick: bool) -> list[int]:
    """Bytes per message: 1 KiB .. 16 MiB."""
    return [2**12, 2**16, 2**20, 2**22] if quick else [2**k for k in range(10, 25, 2)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: CalibrateConfig, queue) -> None:
    """One of ``cfg.procs`` processes: the compute sweep (all at once, so that each sees
    the others' load, as training workers do), then the collective sweep; reports
    (rank, compute, collective rows, overhead)."""
    import datetime
    import resource
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor
    torch.set_num_threads(cfg.threads)
    device = "cpu"
    backend = "gloo"
    if cfg.device == "cuda":
        device, backend = f"cuda:{rank}", "nccl"
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    overhead = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}
    n_compute = cfg.compute_procs
    compute_group = dist.new_group(list(range(n_compute))) if n_compute < world else None
    compute = None
    if rank < n_compute:
        sync = (lambda: dist.barrier(group=compute_group)) if n_compute > 1 else (lambda: None)
        compute = measure_compute(cfg, sync=sync)
    dist.barrier()
    reps = 3 if cfg.quick else 5
    work = torch.randn(384, 384, device=device)

    def timed(fn, group) -> float:
        """Median seconds of ``fn`` as a training step meets it: each repetition starts
        together (a barrier), computes for a few milliseconds (the same matmuls on every
        rank, so the backend's threads have gone idle and the caches hold other data),
        then times the collective; the slowest rank's median."""
        fn()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
            for _ in range(3):
                work @ work
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
        return float(t.median())

    samples: dict[tuple, list[float]] = {}  # (op, processes, bytes) -> seconds per round
    for _ in range(cfg.rounds):  # rounds apart in time, as for compute (measure_compute)
        for n, group in groups.items():
            if rank < n:
                for nbytes in message_sizes(cfg.quick):
                    elems = max(n, nbytes // 4 // n * n)
                    full = torch.randn(elems, device=device)
                    part = torch.randn(elems // n, device=device)

                    # the calls comm.py makes: list all-gather + cat, list reduce-scatter
                    def all_gather(p=part, g=group, n=n):
                        parts = [torch.empty_like(p) for _ in range(n)]
                        dist.all_gather(parts, p, group=g)
                        return torch.cat(parts)

                    def reduce_scatter(f=full, g=group, n=n):
                        chunks = [c.contiguous() for c in f.chunk(n)]
                        out = torch.empty_like(chunks[0])
                        dist.reduce_scatter(out, chunks, group=g)

                    calls = {"all_reduce": lambda f=full, g=group: dist.all_reduce(f, group=g),
                             "all_gather": all_gather, "reduce_scatter": reduce_scatter}  # fmt: skip
                    for op, call in calls.items():
                        samples.setdefault((op, n, 4 * elems), []).append(timed(call, group))
            dist.barrier()
        if rank < 2:  # point-to-point between ranks 0 and 1: half a ping-pong
            peer = 1 - rank
            for nbytes in message_sizes(cfg.quick):
                buf = torch.randn(nbytes // 4, device=device)

                def ping(buf=buf, peer=peer):
                    for kind in ("send", "recv") if rank == 0 else ("recv", "send"):
                        fn = dist.isend if kind == "send" else dist.irecv
                        for w in dist.batch_isend_irecv([dist.P2POp(fn, buf, peer)]):
                            w.wait()

                samples.setdefault(("p2p", 2, nbytes), []).append(timed(ping, groups[2]) / 2)
        dist.barrier()
    rows = [(*key, statistics.median(v)) for key, v in samples.items()]
    queue.put((rank, compute, rows, overhead))
    dist.destroy_process_group()


def measure(cfg: CalibrateConfig, log=print):
    """(compute, collective rows (op, processes, bytes, seconds), overhead bytes): in this
    process when ``cfg.procs`` is 1, else in ``cfg.procs`` workers started once (fork on
    CPU, spawn on CUDA), compute figures the median over the workers."""
    import resource

    import torch.multiprocessing as mp

    if cfg.procs == 1:
        compute = measure_compute(cfg, log)
        return compute, [], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ctx = mp.get_context("spawn" if cfg.device == "cuda" else "fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg.procs, port, cfg, queue))
             for r in range(cfg.procs)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=600) for _ in procs)
    except Exception:  # noqa: BLE001 - a worker died: say which, not the queue's error
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"the sweep failed (worker exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    compute = median_of([c for _, c, _, _ in results if c is not None])
    return compute, results[0][2], float(results[0][3])


# -- fits ----------------------------------------------------------------------------------


def fit_efficiency(rows, memory_bandwidth: float) -> dict:
    """Fit ``Efficiency`` (module docstring) to fp32 (m, n, k, seconds) rows. Returns peak,
    gemm_max, gemm_half_k, gemm_half_flops and the residual (rms of log error). For each
    (gemm_half_k, gemm_half_flops) of a grid, the effective peak is the least-squares one
    of the compute-bound model, refined over a few values around it with the roofline."""
    m, n, k, t = (np.array([r[i] for r in rows], float) for i in range(1, 5))
    flops = 2 * m * n * k
    mem_t = 4 * (m * k + k * n + m * n) / memory_bandwidth
    fastest = float((flops / t).max())

    def best_of(hks, hfs, best=None):
        for hk in hks:
            for hf in hfs:
                shape = (flops + hf) * (k + hk) / k  # = time x effective peak
                centre = float(np.exp(np.mean(np.log(shape / t))))
                for eff_peak in centre * np.geomspace(0.8, 1.25, 9):
                    pred = np.maximum(shape / eff_peak, mem_t)
                    err = float(np.sqrt(np.mean(np.log(pred / t) ** 2)))
                    if best is None or err < best[0]:
                        best = (err, float(hk), float(hf), float(eff_peak))
        return best

    # a coarse grid, then a finer one around its best
    best = best_of([0.0, *np.geomspace(1, 4096, 25)], [0.0, *np.geomspace(1e3, 1e10, 36)])
    _, hk, hf, _ = best
    best = best_of(hk * np.geomspace(0.7, 1.4, 9), hf * np.geomspace(0.6, 1.6, 11), best)
    err, hk, hf, eff_peak = best
    peak = max(fastest, eff_peak)
    return {"peak": peak, "gemm_max": eff_peak / peak, "gemm_half_k": hk,
            "gemm_half_flops": hf, "residual": err}  # fmt: skip


def attention_efficiency(rows, peak: float) -> float:
    """Median over shapes of the simulator's attention FLOPs (forward 4 T s h x the causal
    fraction, backward 2.5 x that) per second, as a fraction of ``peak``."""
    from plait.sim.costs import FLASH_BLOCK

    effs = []
    for b, a, s, d, t in rows:
        blocks = max(1, math.ceil(s / FLASH_BLOCK))
        flops = 3.5 * 4.0 * b * s * s * a * d * (blocks + 1) / (2 * blocks)
        effs.append(flops / t / peak)
    return float(min(1.0, statistics.median(effs)))


def fit_optimizer(rows, hw) -> float:
    """Host seconds per parameter tensor of the step's tail (``measure_probes``): what the
    tail takes beyond the simulator's streamed bytes at ``hw``'s elementwise rate, over
    the probe's parameter tensors (median over the probes, at least 0)."""
    from plait.sim import costs
    from plait.sim.memory import stage_params
    from plait.sim.runtime import get_runtime

    if not rows:
        return 0.0
    rt, plain = get_runtime("plait"), hw.replace(optimizer_tensor_overhead=0.0)
    per_tensor = []
    for probe, t in rows:
        model, layout = probe_case(probe)
        layers = model.n_layers
        streamed = costs.optimizer_time(stage_params(model, layout, layers, True, True), layout,
                                        plain, rt)  # fmt: skip
        per_tensor.append((t - streamed) / costs.stage_tensors(model, layers, True, True))
    return max(0.0, float(statistics.median(per_tensor)))


def fit_probes(rows, hw) -> dict:
    """Fit what bare kernels do not show, so that ``simulate`` reproduces plait's own
    single-process training steps (``measure_probes``): the host time per kernel
    (``op_overhead``: dispatch, autograd bookkeeping, allocation) and a common scale of
    the GEMM level (``gemm_max``, at most 1: a step's operands are colder than a sweep's),
    over a grid; everything else stays as measured. Returns the hardware and the fit."""
    from plait.sim import simulate

    if not rows:
        return {"hardware": hw, "scale": 1.0, "residual": 0.0}
    eff = hw.efficiency
    cases = [(*probe_case(probe), t) for probe, t in rows]

    def error(scale: float, overhead: float) -> tuple:
        trial = hw.replace(efficiency=dataclasses.replace(eff, gemm_max=float(eff.gemm_max * scale)),
                           op_overhead=float(overhead))  # fmt: skip
        err = float(np.sqrt(np.mean([np.log(simulate(m, lay, trial).iter_time_s / t) ** 2
                                     for m, lay, t in cases])))  # fmt: skip
        return err, trial, float(scale), float(overhead)

    # a coarse grid, then a finer one around its best; gemm_max stays at most 1
    top = 1.0 / eff.gemm_max
    best = min((error(a, b) for a in np.geomspace(0.25, 2.0, 13) if a <= top
                for b in [0.0, *np.geomspace(1e-6, 1e-3, 13)]), key=lambda x: x[0])  # fmt: skip
    _, _, a0, b0 = best
    fine_b = list(np.geomspace(1e-7, 2e-6, 4)) if b0 == 0 else list(b0 * np.geomspace(0.6, 1.6, 9))
    best = min([best, *(error(a, b) for a in a0 * np.geomspace(0.85, 1.15, 7) if a <= top
                        for b in fine_b)], key=lambda x: x[0])  # fmt: skip
    err, trial, scale, _ = best
    return {"hardware": trial, "scale": scale, "residual": err}


def fit_link(rows) -> dict:
    """The ``Link`` whose ``costs`` formulas best match the measured collectives (rms of
    log error): one latency and bandwidth over every row, and one pair per operation
    (``Link.per_op``), which the simulator uses where it has one. Returns latency,
    bandwidth, per_op {op: (latency, bandwidth)} and residual (with the per-op pairs)."""
    from plait.sim import costs
    from plait.sim.hardware import Link

    fns = {
        "all_reduce": lambda s, n, link: costs.all_reduce_time(s, n, link),
        "all_gather": lambda s, n, link: costs.all_gather_time(s, n, link),
        "reduce_scatter": lambda s, n, link: costs.reduce_scatter_time(s, n, link),
        "p2p": lambda s, n, link: costs.p2p_time(s, link),
    }

    def fit(subset) -> tuple[float, float, float]:
        t = np.array([r[3] for r in subset])

        def error(alpha: float, bw: float) -> float:
            link = Link(bandwidth=bw, latency=alpha)
            pred = np.array([fns[op](s, n, link) for op, n, s, _ in subset])
            return float(np.sqrt(np.mean(np.log(pred / t) ** 2)))

        # a coarse grid (a factor 2 apart), then a fine one (2^(1/8)) around its best
        best = min((error(a, b), a, b) for a in np.geomspace(1e-7, 1e-2, 17)
                   for b in np.geomspace(1e7, 1e12, 17))  # fmt: skip
        fine = np.geomspace(0.5, 2.0, 17)
        return min((error(best[1] * x, best[2] * y), best[1] * x, best[2] * y)
                   for x in fine for y in fine)  # fmt: skip

    _, alpha, bw = fit(rows)
    per_op, errors = {}, []
    for op in fns:
        subset = [r for r in rows if r[0] == op]
        if subset:
            err, a, b = fit(subset)
            per_op[op] = (float(a), float(b))
            errors += [err**2] * len(subset)
    return {"latency": float(alpha), "bandwidth": float(bw), "per_op": per_op,
            "residual": float(np.sqrt(np.mean(errors)))}  # fmt: skip


# -- the hardware file ---------------------------------------------------------------------


def calibrate(cfg: CalibrateConfig, log=print):
    """Measure and fit (module docstring); returns (``Hardware``, the measurements)."""
    import torch

    from plait.sim.hardware import Efficiency, Hardware, Link, PeakFlops

    t0 = time.perf_counter()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu")
    log(f"  compute in {cfg.compute_procs} process(es) at once ({cfg.compute_slots} can run "
        f"at full speed), collectives over 2..{cfg.procs} ...")  # fmt: skip
    compute, comm, overhead = measure(cfg, log)
    bandwidth, mm, attn = compute["stream"], compute["matmul"], compute["attention"]
    elementwise = fit_elementwise(compute["elementwise"])
    log(f"  memory bandwidth {bandwidth / 1e9:.2f} GB/s per process, elementwise kernels "
        f"{elementwise / 1e9:.2f} GB/s")  # fmt: skip
    fit = fit_efficiency([r for r in mm if r[0] == "fp32"], bandwidth)
    peaks = {"fp32": fit["peak"]}
    for dtype in cfg.dtypes[1:]:
        peaks[dtype] = max(2 * m * n * k / t for d, m, n, k, t in mm if d == dtype)
    attention = attention_efficiency(attn, fit["peak"])
    eff = Efficiency(gemm_max=min(1.0, fit["gemm_max"]), gemm_half_k=fit["gemm_half_k"],
                     gemm_half_flops=fit["gemm_half_flops"], attention=attention)  # fmt: skip
    draft = Hardware(
        name=cfg.name, peak_flops=PeakFlops(fp32=fit["peak"]), memory_bytes=64 * GiB,
        memory_bandwidth=bandwidth, framework_overhead_bytes=0.0, devices_per_node=1,
        efficiency=eff, intra_node=Link(bandwidth=1e9, latency=0.0),
        inter_node=Link(bandwidth=1e9, latency=0.0), pcie_bandwidth=bandwidth,
        host_memory_bandwidth=bandwidth, elementwise_bandwidth=elementwise,
    )  # fmt: skip
    per_tensor = fit_optimizer(compute["optimizer"], draft)
    draft = draft.replace(optimizer_tensor_overhead=per_tensor)
    log(f"  optimizer step: {per_tensor * 1e6:.1f} us per parameter tensor beyond its bytes")
    probe = fit_probes(compute["probe"], draft)
    eff, op_overhead = probe["hardware"].efficiency, probe["hardware"].op_overhead
    fit["probe_residual"] = probe["residual"]
    log(f"  model steps: the GEMM level x{probe['scale']:.2f}, {op_overhead * 1e6:.1f} us per "
        f"kernel (fit error {probe['residual']:.0%} over {len(compute['probe'])} probe models)")  # fmt: skip
    link = fit_link(comm) if comm else {"latency": 50e-6, "bandwidth": 2e9, "residual": 0.0}
    if comm:
        log(f"  link: latency {link['latency'] * 1e6:.1f} us, bandwidth "
            f"{link['bandwidth'] / 1e9:.2f} GB/s; per operation (fit error {link['residual']:.0%}): "
            + ", ".join(f"{op} {a * 1e6:.0f} us {b / 1e9:.2f} GB/s"
                        for op, (a, b) in link["per_op"].items()))  # fmt: skip
    per_node = max(cfg.procs, os.cpu_count() or 1)
    slots = None if cfg.device == "cuda" else min(per_node, cfg.compute_slots)
    if cfg.device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        per_node = torch.cuda.device_count()
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node
    link_obj = Link(
        bandwidth=link["bandwidth"], latency=link["latency"],
        per_op=tuple((op, Link(latency=a, bandwidth=b)) for op, (a, b) in link.get("per_op", {}).items()),
    )  # fmt: skip
    hw = Hardware(
        name=cfg.name,
        description=(
            f"measured by plait calibrate on {socket.gethostname()} ({cfg.device}, "
            f"{cfg.procs} processes at once, {cfg.threads} thread(s) each): GEMM fit error "
            f"{fit['residual']:.0%}, collective fit error {link['residual']:.0%}"
        ),
        peak_flops=PeakFlops(**peaks),
        memory_bytes=float(memory),
        memory_bandwidth=bandwidth,
        framework_overhead_bytes=overhead or 0.3 * GiB,
        devices_per_node=per_node,
        efficiency=eff,
        intra_node=link_obj,
        inter_node=link_obj,
        pcie_bandwidth=bandwidth,
        host_memory_bandwidth=bandwidth,
        elementwise_bandwidth=elementwise,
        compute_slots_per_node=slots,
        op_overhead=op_overhead,
        optimizer_tensor_overhead=per_tensor,
    )
    data = {"matmul": mm, "attention": attn, "collectives": comm, "fit": fit, "link": link,
            "seconds": time.perf_counter() - t0}  # fmt: skip
    return hw, data


# -- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="calibrated.yaml", help="hardware file to write")
    parser.add_argument("--quick", action="store_true", help="a short sweep (under 30 s)")
    parser.add_argument("--procs", type=int, default=None,
                        help="worker processes measured at once (default: the CPU cores, or "
                        "the GPUs)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    parser.add_argument("--dtypes", default="fp32", help="comma-separated, e.g. fp32,bf16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when available, else cpu")  # fmt: skip
    parser.add_argument("--name", default=None, help="name of the hardware entry")


def run(args: argparse.Namespace) -> int:
    try:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        procs = args.procs
        if procs is None:
            procs = torch.cuda.device_count() if device == "cuda" else max(2, os.cpu_count() or 1)
        cfg = CalibrateConfig(
            quick=args.quick, procs=procs, threads=args.threads, device=device,
            dtypes=tuple(d.strip() for d in args.dtypes.split(",") if d.strip()),
            name=args.name or f"{socket.gethostname()}-{device}",
        )  # fmt: skip
        print(f"plait calibrate: measuring {device} ({'quick' if cfg.quick else 'full'} sweep)",
              flush=True)  # fmt: skip
        hw, data = calibrate(cfg, log=lambda m: print(m, flush=True))
        hw.to_yaml(args.out)
    except OSError as e:
        print(f"plait calibrate: error: --out {args.out}: cannot write it ({e.strerror})",
              file=sys.stderr)  # fmt: skip
        return 2
    except (ValueError, RuntimeError) as e:
        print(f"plait calibrate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(summary(hw, data))
    print(f"wrote {args.out} in {data['seconds']:.1f} s "
          f"(plait simulate --hardware {args.out}; plait plan --hardware {args.out})")  # fmt: skip
    return 0


def summary(hw, data: dict) -> str:
    """What was measured and fitted, as printed by ``plait calibrate``."""
    from plait.sim import costs

    eff, fit = hw.efficiency, data["fit"]
    lines = [
        "peak        "
        + ", ".join(
            f"{d} {v / 1e9:.1f} GFLOP/s" for d in DTYPES if (v := hw.peak_flops.get(d))
        )  # fmt: skip
        + f" per process; memory {hw.memory_bandwidth / 1e9:.2f} GB/s",
        f"gemm fit    gemm_max {eff.gemm_max:.2f}, gemm_half_k {eff.gemm_half_k:.0f}, "
        f"gemm_half_flops {eff.gemm_half_flops:.3g}: rms error {fit['residual']:.0%} over "
        f"{sum(1 for r in data['matmul'] if r[0] == 'fp32')} shapes; attention {eff.attention:.2f}",
    ]
    if data["collectives"]:
        link = hw.intra_node
        lines.append(f"link        latency {link.latency * 1e6:.1f} us, bandwidth "
                     f"{link.bandwidth / 1e9:.2f} GB/s: rms error {data['link']['residual']:.0%}")  # fmt: skip
        lines.append(f"{'op':<15}{'procs':>6}{'bytes':>10}{'measured':>12}{'fit':>12}")
        fns = {"all_reduce": costs.all_reduce_time, "all_gather": costs.all_gather_time,
               "reduce_scatter": costs.reduce_scatter_time}  # fmt: skip
        for op, n, s, t in data["collectives"]:
            pred = costs.p2p_time(s, link) if op == "p2p" else fns[op](s, n, link)  # per-op pair
            lines.append(f"{op:<15}{n:>6}{s:>10}{t * 1e6:>10.0f}us{pred * 1e6:>10.0f}us")
    lines.append(f"overhead    {hw.framework_overhead_bytes / GiB:.2f} GiB per process; "
                 f"memory {hw.memory_bytes / GiB:.1f} GiB per process")  # fmt: skip
    return "\n".join(lines)


def _main() -> int:  # python -m plait.calibrate
    p = argparse.ArgumentParser(prog="plait calibrate")
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(_main())
