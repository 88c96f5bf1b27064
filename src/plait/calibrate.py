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
- one training step (forward, backward, clipping, AdamW) of plait's own model in a few
  probe sizes (``PROBES``, unlike the benchmarked ones), in a single process each;
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
- Model steps: the GEMM curve's level (gemm_max, at most 1) and fixed cost
  (gemm_half_flops) are then scaled, over a grid, until ``simulate`` best reproduces the
  probe steps: a framework's per-operation overheads and a step's cache misses, which
  bare matmuls on hot operands do not see, land there.
- ``Link``: latency alpha and bandwidth B such that ``costs.all_reduce_time``,
  ``all_gather_time``, ``reduce_scatter_time`` and ``p2p_time`` best match every
  measured collective (grid over alpha, B). One host: ``intra_node`` and ``inter_node``
  are the same link and ``devices_per_node`` covers every process.

The file's ``description`` records the fit residuals; ``plait calibrate`` prints every
measured collective beside its fit.
"""

from __future__ import annotations

import argparse
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


def gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(m, n, k) of the sweep: squares, and small-transformer products in the forward and
    both backward orientations (tokens T, hidden h, FFN 4h)."""
    squares = [64, 256, 1024] if quick else [32, 64, 128, 256, 512, 1024]
    shapes = {(s, s, s) for s in squares}
    tokens = [256, 1024] if quick else [128, 512, 2048]
    hiddens = [64, 256] if quick else [64, 128, 256, 512]
    for T in tokens:
        for h in hiddens:
            for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
                shapes |= {(T, n, k), (T, k, n), (n, k, T)}
    return sorted(shapes)


def measure_matmuls(
    cfg: CalibrateConfig, log=print, sync=lambda: None
) -> list[tuple[str, int, int, int, float]]:
    """(dtype, m, n, k, seconds) of ``(m x k) @ (k x n)`` over ``gemm_shapes``; ``sync()``
    before each shape keeps concurrent workers on the same one."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    min_s, reps = (0.004, 3) if cfg.quick else (0.02, 5)
    out = []
    for dtype in cfg.dtypes:
        shapes = gemm_shapes(cfg.quick)
        if dtype != "fp32":  # the curve is fitted on fp32; other dtypes only need a peak
            shapes = [s for s in shapes if s[0] == s[1] == s[2] and s[0] >= 256]
        for m, n, k in shapes:
            a = torch.randn(m, k, dtype=dt[dtype], device=cfg.device)
            b = torch.randn(k, n, dtype=dt[dtype], device=cfg.device)
            sync()
            t = _median_time(lambda a=a, b=b: a @ b, cfg.device, min_s=min_s, reps=reps)
            out.append((dtype, m, n, k, t))
        best = max(2 * m * n * k / t for d, m, n, k, t in out if d == dtype)
        log(f"  matmul {dtype}: {len(shapes)} shapes, best {best / 1e9:.1f} GFLOP/s")
    return out


def measure_attention(
    cfg: CalibrateConfig, sync=lambda: None
) -> list[tuple[int, int, int, int, float]]:
    """(batch, heads, seq, head size, seconds) of causal fused attention, forward +
    backward."""
    import torch
    import torch.nn.functional as F

    shapes = [(4, 4, 128, 32)] if cfg.quick else [(4, 4, 128, 32), (2, 8, 256, 64), (1, 8, 512, 64)]
    min_s, reps = (0.01, 3) if cfg.quick else (0.03, 5)
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


def measure_compute(cfg: CalibrateConfig, log=None, sync=lambda: None) -> dict:
    """Memory bandwidth, the matmul sweep and attention, in this process; ``sync()``
    (a barrier, in workers) before each measurement keeps them measuring together."""
    import torch

    torch.set_num_threads(cfg.threads)
    sync()
    out = {"stream": measure_stream(cfg)}
    out["matmul"] = measure_matmuls(cfg, log or (lambda m: None), sync)
    out["attention"] = measure_attention(cfg, sync)
    out["probe"] = measure_probes(cfg, sync)
    return out


PROBES = (  # (layers, hidden, heads, seq, batch, vocab): overhead- to compute-bound
    (2, 128, 4, 128, 1, 512),
    (2, 256, 8, 128, 8, 1024),
    (2, 96, 4, 128, 16, 512),
    (3, 192, 6, 256, 4, 512),
)


def measure_probes(cfg: CalibrateConfig, sync=lambda: None) -> list[tuple[tuple, float]]:
    """Seconds of one single-process training step of plait's own model (forward, backward,
    gradient clipping, AdamW) for each of ``PROBES`` (the first two when ``quick``)."""
    import torch

    from plait.model.config import ModelConfig
    from plait.model.transformer import build_model
    from plait.topology import Topology

    out = []
    for probe in PROBES[:2] if cfg.quick else PROBES:
        layers, hidden, heads, seq, batch, vocab = probe
        model_cfg = ModelConfig(n_layers=layers, hidden=hidden, n_heads=heads, seq_len=seq,
                                vocab_size=vocab)  # fmt: skip
        model = build_model(model_cfg, topo=Topology.single(cfg.device), device=cfg.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(0, vocab, (batch, seq), device=cfg.device)

        def step(model=model, opt=opt, ids=ids):
            model(ids, ids).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        sync()
        out.append((probe, _median_time(step, cfg.device, min_s=0.0, reps=3 if cfg.quick else 5)))
    return out


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
    compute = measure_compute(cfg, sync=dist.barrier)
    dist.barrier()
    reps = 5 if cfg.quick else 9
    rows = []

    def timed(fn, group) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
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

    for n, group in groups.items():
        if rank < n:
            for nbytes in message_sizes(cfg.quick):
                elems = max(n, nbytes // 4 // n * n)
                full = torch.randn(elems, device=device)
                part = torch.empty(elems // n, device=device)
                chunks = list(full.chunk(n))
                calls = {
                    "all_reduce": lambda f=full, g=group: dist.all_reduce(f, group=g),
                    "all_gather": lambda f=full, p=part, g=group: dist.all_gather_into_tensor(
                        f, p, group=g),
                    "reduce_scatter": lambda p=part, c=chunks, g=group: dist.reduce_scatter(
                        p, c, group=g),
                }  # fmt: skip
                for op, call in calls.items():
                    rows.append((op, n, 4 * elems, timed(call, group)))
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

            rows.append(("p2p", 2, nbytes, timed(ping, groups[2]) / 2))
    dist.barrier()
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
    computes = [c for _, c, _, _ in results]
    compute = {
        "stream": statistics.median(c["stream"] for c in computes),
        "matmul": [(*row[:4], statistics.median(c["matmul"][i][4] for c in computes))
                   for i, row in enumerate(computes[0]["matmul"])],
        "attention": [(*row[:4], statistics.median(c["attention"][i][4] for c in computes))
                      for i, row in enumerate(computes[0]["attention"])],
        "probe": [(row[0], statistics.median(c["probe"][i][1] for c in computes))
                  for i, row in enumerate(computes[0]["probe"])],
    }  # fmt: skip
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


def fit_probes(rows, hw) -> dict:
    """Refine the GEMM curve so that ``simulate`` reproduces plait's own single-process
    training steps (``measure_probes``): scale its level (``gemm_max``, at most 1) and its
    fixed cost (``gemm_half_flops``, which then stands for every per-operation overhead
    of a layer) over a grid; the rest stays as the sweep measured it."""
    from plait.layout import Layout
    from plait.model.config import ModelConfig
    from plait.sim import simulate

    if not rows:
        return {"efficiency": hw.efficiency, "scale": 1.0, "fixed": 1.0, "residual": 0.0}
    eff = hw.efficiency
    cases = []
    for (layers, hidden, heads, seq, batch, vocab), t in rows:
        model = ModelConfig(n_layers=layers, hidden=hidden, n_heads=heads, seq_len=seq,
                            vocab_size=vocab)  # fmt: skip
        layout = Layout(global_batch_size=batch, micro_batch_size=batch, dtype="fp32")
        cases.append((model, layout, t))
    base_hf = max(eff.gemm_half_flops, 1e3)

    def error(scale: float, fixed: float) -> tuple:
        trial = eff.__class__(gemm_max=float(eff.gemm_max * scale), gemm_half_k=eff.gemm_half_k,
                              gemm_half_flops=float(base_hf * fixed), attention=eff.attention)  # fmt: skip
        h = hw.replace(efficiency=trial)
        err = float(np.sqrt(np.mean([np.log(simulate(m, lay, h).iter_time_s / t) ** 2
                                     for m, lay, t in cases])))  # fmt: skip
        return err, trial, float(scale), float(fixed)

    # a coarse grid (factors of ~1.4 and ~3), then a finer one around its best; the level
    # stays at most 1 (gemm_max <= 1)
    top = 1.0 / eff.gemm_max
    best = min((error(a, b) for a in np.geomspace(0.1, 2.0, 10) if a <= top
                for b in [0.0, *np.geomspace(0.1, 1000.0, 9)]), key=lambda x: x[0])  # fmt: skip
    _, _, a0, b0 = best
    fine_b = [0.0] if b0 == 0 else list(b0 * np.geomspace(0.5, 2.0, 7))
    best = min([best, *(error(a, b) for a in a0 * np.geomspace(0.8, 1.25, 7) if a <= top
                        for b in fine_b)], key=lambda x: x[0])  # fmt: skip
    err, trial, scale, fixed = best
    return {"efficiency": trial, "scale": scale, "fixed": fixed, "residual": err}


def fit_link(rows) -> dict:
    """Latency and bandwidth of the ``Link`` whose ``costs`` formulas best match the
    measured collectives (rms of log error over every row)."""
    from plait.sim import costs
    from plait.sim.hardware import Link

    fns = {
        "all_reduce": lambda s, n, link: costs.all_reduce_time(s, n, link),
        "all_gather": lambda s, n, link: costs.all_gather_time(s, n, link),
        "reduce_scatter": lambda s, n, link: costs.reduce_scatter_time(s, n, link),
        "p2p": lambda s, n, link: costs.p2p_time(s, link),
    }
    t = np.array([r[3] for r in rows])

    def error(alpha: float, bw: float) -> float:
        link = Link(bandwidth=bw, latency=alpha)
        pred = np.array([fns[op](s, n, link) for op, n, s, _ in rows])
        return float(np.sqrt(np.mean(np.log(pred / t) ** 2)))

    # a coarse grid (a factor 2 apart), then a fine one (2^(1/8)) around its best
    best = min((error(a, b), a, b) for a in np.geomspace(1e-7, 1e-2, 17)
               for b in np.geomspace(1e7, 1e12, 17))  # fmt: skip
    fine = np.geomspace(0.5, 2.0, 17)
    best = min((error(best[1] * x, best[2] * y), best[1] * x, best[2] * y)
               for x in fine for y in fine)  # fmt: skip
    err, alpha, bw = best
    return {"latency": float(alpha), "bandwidth": float(bw), "residual": err}


# -- the hardware file ---------------------------------------------------------------------


def calibrate(cfg: CalibrateConfig, log=print):
    """Measure and fit (module docstring); returns (``Hardware``, the measurements)."""
    import torch

    from plait.sim.hardware import Efficiency, Hardware, Link, PeakFlops

    t0 = time.perf_counter()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu")
    log(f"  compute in {cfg.procs} process(es) at once, collectives over 2..{cfg.procs} ...")
    compute, comm, overhead = measure(cfg, log)
    bandwidth, mm, attn = compute["stream"], compute["matmul"], compute["attention"]
    log(f"  memory bandwidth {bandwidth / 1e9:.2f} GB/s per process")
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
        host_memory_bandwidth=bandwidth,
    )  # fmt: skip
    probe = fit_probes(compute["probe"], draft)
    eff, fit["probe_residual"] = probe["efficiency"], probe["residual"]
    log(f"  model steps: the GEMM level x{probe['scale']:.2f}, fixed cost x{probe['fixed']:.2g} "
        f"(fit error {probe['residual']:.0%} over {len(compute['probe'])} probe models)")  # fmt: skip
    link = fit_link(comm) if comm else {"latency": 50e-6, "bandwidth": 2e9, "residual": 0.0}
    if comm:
        log(f"  link: latency {link['latency'] * 1e6:.1f} us, bandwidth "
            f"{link['bandwidth'] / 1e9:.2f} GB/s (fit error {link['residual']:.0%})")  # fmt: skip
    per_node = max(cfg.procs, os.cpu_count() or 1)
    if cfg.device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        per_node = torch.cuda.device_count()
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node
    link_obj = Link(bandwidth=link["bandwidth"], latency=link["latency"])
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
            pred = costs.p2p_time(s, link) if op == "p2p" else fns[op](s, n, link)
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
