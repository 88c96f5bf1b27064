"""Calibration: measure the machine it runs on and write a hardware file that
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
  reduce-scatter through ``comm.py`` itself (the trainer's calls) over message sizes from
  1 KiB to 16 MiB, and point-to-point transfers (``comm.batch_p2p`` ping-pong, half the
  round trip);
- one training step of plait's own model: ``train.loop.Trainer.step`` itself, in a few
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
- The optimizer: the probe steps' tail (gradient norm, clipping, AdamW, zeroing) beyond
  its bytes at the elementwise rate, per parameter tensor: ``optimizer_tensor_overhead``
  (``fit_optimizer``; per-tensor loops on a CPU).
- Model steps: the host time per kernel (``op_overhead``) and a common scale of the GEMM
  level (``gemm_max``, at most 1) are then fitted over a grid until ``simulate`` best
  reproduces the probe steps (``fit_probes``): a framework's per-operation overheads and
  a step's cache misses, which bare matmuls on hot operands do not see, land there. On a
  GPU the host queues kernels ahead of the device, so the file says ``host_overlap``: a
  step takes the longer of the host's time and the device's, not their sum (a CPU worker
  runs its kernels itself: the sum).
- ``Link``: latency alpha and bandwidth B such that ``costs.all_reduce_time``,
  ``all_gather_time``, ``reduce_scatter_time`` and ``p2p_time`` best match every
  measured collective (grid over alpha, B). One host: ``intra_node`` and ``inter_node``
  are the same link and ``devices_per_node`` covers every process.

The file's ``description`` records the fit residuals; ``plait calibrate`` prints every
measured collective beside its fit.

Where things are: ``config.py`` (what to measure), ``measure.py`` (the measurements),
``fit.py`` (the fits), ``calibrate`` below (both, into a ``Hardware`` entry); the command
line is ``plait/commands/calibrate.py``.
"""

from __future__ import annotations

import os
import socket
import time

from plait.calibrate.config import DTYPES, CalibrateConfig, GiB
from plait.calibrate.fit import (
    attention_efficiency,
    fit_efficiency,
    fit_elementwise,
    fit_link,
    fit_optimizer,
    fit_probes,
)
from plait.calibrate.measure import measure

__all__ = ["DTYPES", "CalibrateConfig", "calibrate"]


def calibrate(cfg: CalibrateConfig, log=print):
    """Measure and fit (module docstring); returns (``Hardware``, the measurements)."""
    import torch

    from plait.sim.hardware import OVERLAP_SLOWDOWN, Efficiency, Hardware, Link, PeakFlops

    t0 = time.perf_counter()
    queued = str(cfg.device).startswith("cuda")  # the host queues kernels ahead of a GPU
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
    # against the peak of the dtype it was measured in (bf16 on a GPU that calibrates it)
    att_dtype = attn[0][4] if attn and len(attn[0]) > 5 else "fp32"
    attention = attention_efficiency(attn, peaks.get(att_dtype, fit["peak"]), fit["gemm_half_k"])
    eff = Efficiency(gemm_max=min(1.0, fit["gemm_max"]), gemm_half_k=fit["gemm_half_k"],
                     gemm_half_flops=fit["gemm_half_flops"], attention=attention)  # fmt: skip
    draft = Hardware(
        name=cfg.name, peak_flops=PeakFlops(**peaks), memory_bytes=64 * GiB,
        memory_bandwidth=bandwidth, framework_overhead_bytes=0.0, devices_per_node=1,
        efficiency=eff, intra_node=Link(bandwidth=1e9, latency=0.0),
        inter_node=Link(bandwidth=1e9, latency=0.0), pcie_bandwidth=bandwidth,
        host_memory_bandwidth=bandwidth, elementwise_bandwidth=elementwise,
        host_overlap=queued,
    )  # fmt: skip
    per_tensor = fit_optimizer(compute["optimizer"], draft)
    draft = draft.replace(optimizer_tensor_overhead=per_tensor)
    log(f"  optimizer step: {per_tensor * 1e6:.1f} us per parameter tensor beyond its bytes")
    probe = fit_probes(compute["probe"], draft)
    eff, op_overhead = probe["hardware"].efficiency, probe["hardware"].op_overhead
    fit["probe_residual"] = probe["residual"]
    log(f"  model steps: the GEMM level x{probe['scale']:.2f}, {op_overhead * 1e6:.1f} us per "
        f"kernel (fit error {probe['residual']:.0%} over {len(compute['probe'])} probe models)")  # fmt: skip
    for (layers, hidden, _, seq, batch, micro, vocab, *_), measured, fitted in probe["rows"]:
        log(f"    probe {layers} x {hidden}, seq {seq}, batch {batch} (micro {micro}), vocab "
            f"{vocab}: measured {measured * 1e3:.2f} ms, fitted {fitted * 1e3:.2f} ms")  # fmt: skip
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
        host_overlap=queued,
        # not measured here (one device): the built-in GPU entries' published figure
        overlap_slowdown=OVERLAP_SLOWDOWN if cfg.device == "cuda" else 0.0,
    )
    data = {"matmul": mm, "attention": attn, "collectives": comm, "fit": fit, "link": link,
            "seconds": time.perf_counter() - t0}  # fmt: skip
    return hw, data
