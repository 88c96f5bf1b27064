"""``plait calibrate``: the fits recover known parameters, and ``--quick`` writes a valid
hardware file (one process group of 2 workers) in under 30 s."""

import subprocess
import sys
import time
from dataclasses import replace

import pytest

from plait.calibrate import CalibrateConfig
from plait.calibrate.fit import (
    fit_efficiency,
    fit_elementwise,
    fit_link,
    fit_optimizer,
    fit_probes,
)
from plait.calibrate.measure import (
    ELEMENTWISE,
    GPU_PROBES,
    PROBES,
    gemm_shapes,
    measure_elementwise,
    message_sizes,
    probe_case,
)
from plait.layout import Layout
from plait.model.config import preset
from plait.sim import collectives, costs, simulate
from plait.sim.hardware import Efficiency, Hardware, Link, load_hardware
from plait.sim.search import PlanRequest, search


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


def test_attention_fit_is_the_long_sequence_rate_the_simulator_scales_back():
    """``attention_efficiency`` divides out the key loop's saturation at each measured
    shape, so the simulator, which applies it again (``costs.attention_key_saturation``),
    reproduces the measured attention time. Catches a fit that returns the short-sequence
    rate (the simulator would then count the saturation twice)."""
    from plait.calibrate.fit import attention_efficiency
    from plait.model.config import ModelConfig
    from plait.sim.runtime import PROFILES

    peak, half_k, truth = 100e9, 32.0, 0.4
    hw = Hardware.from_dict({**load_hardware("cpu").to_dict(), "peak_flops": {"fp32": peak},
                             "memory_bandwidth": 1e30, "elementwise_bandwidth": 1e30,
                             "efficiency": {"gemm_max": 0.6, "gemm_half_k": half_k,
                                            "gemm_half_flops": 0.0, "attention": truth}})  # fmt: skip
    rows = []
    for b, a, s, d in [(4, 4, 128, 32), (2, 8, 256, 64), (1, 8, 512, 64)]:
        blocks = max(1, -(-s // costs.FLASH_BLOCK))
        causal = (blocks + 1) / (2 * blocks)
        flops = 3.5 * 4.0 * b * s * s * a * d * causal
        rows.append((b, a, s, d, flops / (peak * truth * costs.attention_key_saturation(
            s, causal, half_k))))  # fmt: skip
    assert attention_efficiency(rows, peak, half_k) == pytest.approx(truth)
    assert attention_efficiency(rows, peak) < truth  # without it: the slower, short-s rate
    # and the simulator's attention core at a measured shape takes the measured time
    b, a, s, d, t = rows[1]
    cfg = ModelConfig(arch="gpt2", n_layers=1, hidden=a * d, n_heads=a, vocab_size=256,
                      seq_len=s)  # fmt: skip
    layout = Layout(dtype="fp32", micro_batch_size=b, global_batch_size=b)
    rt = PROFILES["fsdp"]
    fitted = hw.replace(efficiency=Efficiency(gemm_max=0.6, gemm_half_k=half_k,
                        gemm_half_flops=0.0, attention=attention_efficiency(rows, peak, half_k)))  # fmt: skip
    halved = fitted.replace(efficiency=Efficiency(gemm_max=0.6, gemm_half_k=half_k,
                            gemm_half_flops=0.0, attention=fitted.efficiency.attention / 2))  # fmt: skip
    lc, lc2 = costs.layer_cost(cfg, layout, fitted, rt), costs.layer_cost(cfg, layout, halved, rt)
    fwd_bwd = (lc2.fwd - lc.fwd) + (lc2.bwd_input - lc.bwd_input)
    assert fwd_bwd == pytest.approx(t, rel=1e-6)


def test_link_fit_recovers_latency_and_bandwidth():
    truth = Link(bandwidth=1.5e9, latency=80e-6)
    rows = []
    for n in (2, 3, 4):
        for s in message_sizes(quick=False):
            rows += [
                ("all_reduce", n, s, collectives.all_reduce_time(s, n, truth)),
                ("all_gather", n, s, collectives.all_gather_time(s, n, truth)),
                ("reduce_scatter", n, s, collectives.reduce_scatter_time(s, n, truth)),
            ]
    rows += [("p2p", 2, s, collectives.p2p_time(s, truth)) for s in message_sizes(quick=False)]
    fit = fit_link(rows)
    assert fit["latency"] == pytest.approx(80e-6, rel=0.1)
    assert fit["bandwidth"] == pytest.approx(1.5e9, rel=0.1)
    assert fit["residual"] < 0.05


def test_link_fit_gives_each_operation_its_own_pair():
    pairs = {"all_reduce": (1e-3, 1e9), "all_gather": (2e-3, 0.3e9),
             "reduce_scatter": (3e-3, 0.4e9), "p2p": (5e-4, 2e9)}  # fmt: skip
    rows = []
    for op, (a, b) in pairs.items():
        link = Link(bandwidth=b, latency=a)
        for n in (2, 4) if op != "p2p" else (2,):
            for s in message_sizes(quick=False):
                t = {"all_reduce": collectives.all_reduce_time, "all_gather": collectives.all_gather_time,
                     "reduce_scatter": collectives.reduce_scatter_time,
                     "p2p": lambda s, n, link: collectives.p2p_time(s, link)}[op](s, n, link)  # fmt: skip
                rows.append((op, n, s, t))
    fit = fit_link(rows)
    assert fit["residual"] < 0.05
    for op, (a, b) in pairs.items():
        assert fit["per_op"][op][0] == pytest.approx(a, rel=0.1)
        assert fit["per_op"][op][1] == pytest.approx(b, rel=0.1)


def test_elementwise_rate_is_the_counted_bytes_over_the_time():
    """The elementwise rate is each row's counted bytes (``StreamBytes`` on the measured
    call, as the model counts a block) over its time. Catches a fit from a fixed byte
    formula: it counted 0.96-4x less than what ran, by architecture and device (on an
    H200 the rate came out at a third of the copies' and the model's memory-bound time 2.6x
    the measured); and a measurement whose rows carry no count."""
    rows = [(shape, (1 + i) * 1e8, (1 + i) * 1e8 / 2.5e9) for i, shape in enumerate(ELEMENTWISE)]
    assert fit_elementwise(rows) == pytest.approx(2.5e9)
    cfg = CalibrateConfig(quick=True, procs=1, device="cpu")
    measured = measure_elementwise(cfg)
    for (arch, T, h, *_), nbytes, t in measured:
        # at least: read x, write the two residuals, read u (and g), write the activation,
        # each once forward and its gradient once backward (fp32)
        floor = 4 * T * (3 * h + (3 if arch == "llama" else 2) * 4 * h) * 2
        assert floor < nbytes < 8 * floor and t > 0


def test_probe_fit_recovers_the_kernel_overhead_and_gemm_level():
    truth = load_hardware("cpu").replace(op_overhead=80e-6, elementwise_bandwidth=3e9)
    truth = truth.replace(efficiency=truth.efficiency.__class__(
        gemm_max=0.45, gemm_half_k=16, gemm_half_flops=2e6, attention=0.3))  # fmt: skip
    rows = [(probe, simulate(*probe_case(probe), truth).iter_time_s) for probe in PROBES]
    # start from the sweep's view: GEMMs 20% faster than in a step, no kernel overhead
    sweep = truth.replace(op_overhead=0.0, efficiency=truth.efficiency.__class__(
        gemm_max=0.54, gemm_half_k=16, gemm_half_flops=2e6, attention=0.3))  # fmt: skip
    fit = fit_probes(rows, sweep)
    assert fit["residual"] < 0.03
    assert fit["hardware"].op_overhead == pytest.approx(80e-6, rel=0.2)
    assert fit["hardware"].efficiency.gemm_max == pytest.approx(0.45, rel=0.08)


def test_probe_fit_on_a_gpu_recovers_the_host_and_the_gemm_level():
    """On a GPU (``host_overlap``) the probes span launch-bound to compute-bound steps, and
    the fit recovers both knobs only if it prices a step as the longer of host and device.
    Catches the fit pricing its trials as the sum (it then trades the GEMM level against
    the per-kernel time, as it did 56% off on an H100), e.g. by dropping ``host_overlap``
    from the hardware it tries."""
    truth = load_hardware("h100-sxm").replace(op_overhead=25e-6, host_overlap=True)
    truth = truth.replace(efficiency=replace(truth.efficiency, gemm_max=0.5))
    probes = [(*p[:7], "bf16") for p in GPU_PROBES]
    rows = [(probe, simulate(*probe_case(probe), truth).iter_time_s) for probe in probes]
    sweep = truth.replace(op_overhead=0.0, efficiency=replace(truth.efficiency, gemm_max=0.62))
    fit = fit_probes(rows, sweep)
    assert fit["residual"] < 0.03, fit["rows"]
    assert fit["hardware"].op_overhead == pytest.approx(25e-6, rel=0.2)
    assert fit["hardware"].efficiency.gemm_max == pytest.approx(0.5, rel=0.08)
    for _, measured, fitted in fit["rows"]:
        assert fitted == pytest.approx(measured, rel=0.05)


def test_optimizer_fit_recovers_the_cost_per_tensor():
    from plait.sim.memory import stage_params
    from plait.sim.runtime import get_runtime

    truth = load_hardware("cpu").replace(elementwise_bandwidth=3e9, optimizer_tensor_overhead=45e-6)
    rows = []
    for probe in PROBES:
        model, layout = probe_case(probe)
        layers = model.n_layers
        params = stage_params(model, layout, layers, True, True)
        tensors = costs.stage_tensors(model, layers, True, True)
        rows.append((probe, costs.optimizer_time(params, layout, truth, get_runtime("plait"),
                                                 tensors)))  # fmt: skip
    assert fit_optimizer(rows, truth.replace(optimizer_tensor_overhead=0.0)) == pytest.approx(45e-6)
    # a tail faster than its bytes gives no negative overhead
    fast = [(probe, 1e-6) for probe, _ in rows]
    assert fit_optimizer(fast, truth) == 0.0


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
    assert "wrote" in proc.stdout and "all_reduce" in proc.stdout, proc.stdout
    hw = load_hardware(path=out)
    assert isinstance(hw, Hardware) and hw.peak("fp32") > 1e8
    assert 0 < hw.efficiency.gemm_max <= 1 and 0 < hw.efficiency.attention <= 1
    assert hw.intra_node.latency > 0 and hw.devices_per_node >= 2
    assert {op for op, _ in hw.intra_node.per_op} == {"all_reduce", "all_gather",
                                                      "reduce_scatter", "p2p"}  # fmt: skip
    assert hw.elementwise_bw > 1e7 and hw.op_overhead >= 0 and hw.optimizer_tensor_overhead >= 0
    assert 1 <= hw.compute_slots <= hw.devices_per_node
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
