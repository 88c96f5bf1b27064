"""Fits of ``plait calibrate``: the simulator's own formulas (``sim/hardware.py``,
``sim/costs.py``, ``sim/collectives.py``) fitted to the measurements by least squares on
log time, so the relative error counts the same for small and large operations.

- ``fit_efficiency``: a GEMM of F FLOPs and reduction length k takes
  ``max((F + gemm_half_flops) (k + gemm_half_k) / (k peak gemm_max), bytes / bandwidth)``;
  grid search over (gemm_half_k, gemm_half_flops, peak x gemm_max). ``peak`` is the fastest
  throughput measured, so ``gemm_max`` <= 1. ``attention_efficiency``: the simulator's
  attention FLOPs over the measured time.
- ``fit_elementwise``: the bytes a layer's memory-bound kernels read and write, counted as
  the simulator counts a block's (``StreamBytes``), over their measured time.
- ``fit_optimizer``: the probe steps' tail (gradient norm, clipping, AdamW, zeroing) beyond
  its bytes, per parameter tensor.
- ``fit_probes``: the host time per kernel and a common scale of the GEMM level that make
  ``simulate`` reproduce the probe steps.
- ``fit_link``: latency and bandwidth per collective operation.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

from plait.calibrate.measure import probe_case


def fit_elementwise(rows) -> float:
    """Bytes/s at which the simulator's byte count of the measured kernels takes the
    measured time (geometric mean over the rows)."""
    return float(np.exp(np.mean([np.log(nbytes / t) for _, nbytes, t in rows])))


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


def attention_efficiency(rows, peak: float, half_k: float = 0.0) -> float:
    """Median over shapes of the simulator's attention FLOPs (forward 4 T s h x the causal
    fraction, backward 2.5 x that) per second, as a fraction of ``peak``, divided by the
    key loop's saturation at each shape (``costs.attention_key_saturation`` with
    ``half_k``, the fitted ``gemm_half_k``): the long-sequence figure the simulator
    scales back down at every sequence length."""
    from plait.sim.costs import FLASH_BLOCK, attention_key_saturation

    effs = []
    for row in rows:  # (b, a, s, d[, dtype], seconds): the caller picks the dtype's peak
        (b, a, s, d), t = row[:4], row[-1]
        blocks = max(1, math.ceil(s / FLASH_BLOCK))
        causal = (blocks + 1) / (2 * blocks)
        flops = 3.5 * 4.0 * b * s * s * a * d * causal
        effs.append(flops / t / peak / attention_key_saturation(s, causal, half_k))
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
    over a grid; everything else stays as measured. Returns the hardware, the fit and each
    probe's (probe, measured, fitted) seconds."""
    from plait.sim import simulate

    if not rows:
        return {"hardware": hw, "scale": 1.0, "residual": 0.0, "rows": []}
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
    rows = [(probe, t, simulate(m, lay, trial).iter_time_s)
            for (probe, t), (m, lay, _) in zip(rows, cases)]  # fmt: skip
    return {"hardware": trial, "scale": scale, "residual": err, "rows": rows}


def fit_link(rows) -> dict:
    """The ``Link`` whose ``costs`` formulas best match the measured collectives (rms of
    log error): one latency and bandwidth over every row, and one pair per operation
    (``Link.per_op``), which the simulator uses where it has one. Returns latency,
    bandwidth, per_op {op: (latency, bandwidth)} and residual (with the per-op pairs)."""
    from plait.sim import collectives
    from plait.sim.hardware import Link

    fns = {
        "all_reduce": lambda s, n, link: collectives.all_reduce_time(s, n, link),
        "all_gather": lambda s, n, link: collectives.all_gather_time(s, n, link),
        "reduce_scatter": lambda s, n, link: collectives.reduce_scatter_time(s, n, link),
        "p2p": lambda s, n, link: collectives.p2p_time(s, link),
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
