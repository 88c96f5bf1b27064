"""``plait calibrate``: the fits recover known parameters, and ``--quick`` writes a valid
hardware file (one process group of 2 workers) in under 30 s."""

import subprocess
import sys
import time

import pytest

from plait.calibrate import fit_efficiency, fit_link, gemm_shapes, message_sizes
from plait.layout import Layout
from plait.model.config import preset
from plait.sim import costs, simulate
from plait.sim.hardware import Efficiency, Hardware, Link, load_hardware
from plait.sim.plan import PlanRequest, search


def test_gemm_fit_recovers_the_efficiency_curve():
    peak, bandwidth = 100e9, 5e9
    truth = Efficiency(gemm_max=0.6, gemm_half_k=32, gemm_half_flops=2e6, attention=0.3)
    rows = []
    for m, n, k in gemm_shapes(quick=False):
        flops = 2 * m * n * k
        t = max(flops / (peak * truth.gemm(m, n, k)), 4 * (m * k + k * n + m * n) / bandwidth)
        rows.append(("fp32", m, n, k, t))
    fit = fit_efficiency(rows, bandwidth)
    assert fit["residual"] < 0.03
    for m, n, k in [(512, 512, 512), (2048, 384, 128), (128, 128, 2048)]:
        flops = 2 * m * n * k
        got = Efficiency(gemm_max=fit["gemm_max"], gemm_half_k=fit["gemm_half_k"],
                         gemm_half_flops=fit["gemm_half_flops"], attention=0.3)  # fmt: skip
        assert fit["peak"] * got.gemm(m, n, k) == pytest.approx(
            peak * truth.gemm(m, n, k), rel=0.08
        )
    assert fit["gemm_max"] <= 1.0


def test_link_fit_recovers_latency_and_bandwidth():
    truth = Link(bandwidth=1.5e9, latency=80e-6)
    rows = []
    for n in (2, 3, 4):
        for s in message_sizes(quick=False):
            rows += [
                ("all_reduce", n, s, costs.all_reduce_time(s, n, truth)),
                ("all_gather", n, s, costs.all_gather_time(s, n, truth)),
                ("reduce_scatter", n, s, costs.reduce_scatter_time(s, n, truth)),
            ]
    rows += [("p2p", 2, s, costs.p2p_time(s, truth)) for s in message_sizes(quick=False)]
    fit = fit_link(rows)
    assert fit["latency"] == pytest.approx(80e-6, rel=0.1)
    assert fit["bandwidth"] == pytest.approx(1.5e9, rel=0.1)
    assert fit["residual"] < 0.05


@pytest.mark.slow
def test_quick_calibration_writes_a_valid_hardware_file(tmp_path):
    out = tmp_path / "hw.yaml"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "plait.cli", "calibrate", "--quick", "--procs", "2", "--out",
         str(out)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 30, f"plait calibrate --quick took {elapsed:.0f} s"
    assert "wrote" in proc.stdout and "all_reduce" in proc.stdout
    hw = load_hardware(path=out)
    assert isinstance(hw, Hardware) and hw.peak("fp32") > 1e8
    assert 0 < hw.efficiency.gemm_max <= 1 and 0 < hw.efficiency.attention <= 1
    assert hw.intra_node.latency > 0 and hw.devices_per_node >= 2
    model = preset("tiny")
    layout = Layout(dp=2, global_batch_size=8, micro_batch_size=4)
    res = simulate(model, layout, hw)
    assert 1e-4 < res.iter_time_s < 60 and res.fits
    plan = search(PlanRequest(model=model, hardware=hw, n_devices=2, global_batch_size=8,
                              dtype="fp32", top_k=2))  # fmt: skip
    assert plan.best.result.fits


def test_bad_flags_are_one_line_errors(tmp_path):
    from plait.cli import main

    assert main(["calibrate", "--dtypes", "bf16", "--out", str(tmp_path / "x.yaml")]) == 2
    assert main(["calibrate", "--procs", "0", "--out", str(tmp_path / "x.yaml")]) == 2
