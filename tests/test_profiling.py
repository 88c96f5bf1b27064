"""``plait train --profile A:B`` (``train/profiling.py``): the files a rank writes, and the
summary's reading of a GPU trace, checked on a trace written here."""

import json

from plait.data import DataConfig
from plait.layout import Layout
from plait.model.config import preset
from plait.topology import Topology
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train
from plait.train.profiling import summarise


def test_profiled_steps_write_a_trace_a_table_and_a_summary(tmp_path):
    """Steps 2-3 of 4 profiled on the CPU: the Chrome trace parses and holds the steps'
    matrix products, the table lists operators, the summary counts 2 steps of the
    profiled wall time and no device time (a CPU has no kernels). Catches a profiler
    never started or stopped (no files), and a window off by one step."""
    cfg = preset("tiny", n_layers=1, hidden=32, n_heads=2, seq_len=16, vocab_size=256)
    run = RunConfig(
        model=cfg, layout=Layout(global_batch_size=2, micro_batch_size=2),
        data=DataConfig(tokenizer="bytes"), out=str(tmp_path / "run"),
        train=TrainConfig(steps=4, eval_every=0, eval_batches=1, progress=False, warmup=1,
                          profile="2:3"),
    )  # fmt: skip
    (tmp_path / "run").mkdir()
    train(run, topo=Topology.single())
    folder = tmp_path / "run" / "profile"
    trace = json.loads((folder / "rank-0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names
    assert "aten::" in (folder / "rank-0.txt").read_text()
    summary = json.loads((folder / "rank-0-summary.json").read_text())
    assert summary["steps"] == 2 and summary["device_busy_s_per_step"] is None
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (
        0.5 * (steps[1]["step_time_s"] + steps[2]["step_time_s"]) <= 2 * summary["wall_s_per_step"]
    )


def test_summary_sorts_kernels_by_kind_and_finds_an_idle_gpu():
    """Kernel names as CUDA 12's libraries print them (cuBLAS on Hopper, flash attention,
    NCCL, the fused optimizer) and a memcpy, over 2 steps of 10 ms each: each lands in
    its kind, host events are not device time, and 6 ms busy of 20 ms is a busy fraction
    of 0.3. Catches a kind read from the wrong field and host operators counted as device
    time (a busy fraction above 1)."""

    def ev(name, cat, us):
        return {"ph": "X", "name": name, "cat": cat, "dur": us}

    trace = {"traceEvents": [
        ev("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", 2000),
        ev("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "kernel", 1000),
        ev("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "kernel", 1000),
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 500),
        ev("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "kernel", 500),
        ev("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 250),
        ev("void at::native::vectorized_elementwise_kernel<4, add>", "kernel", 750),
        ev("aten::mm", "cpu_op", 9000),
        {"ph": "i", "name": "marker", "cat": "kernel"},
    ]}  # fmt: skip
    s = summarise(trace, steps=2, wall_s=0.020)
    kinds = s["by_kind_s_per_step"]
    assert kinds == {"gemm": 0.0015, "attention": 0.0005, "nccl": 0.00025,
                     "multi_tensor": 0.00025, "copy": 0.000125, "other": 0.000375}  # fmt: skip
    assert abs(s["device_busy_s_per_step"] - 0.003) < 1e-12
    assert abs(s["busy_fraction"] - 0.3) < 1e-12
    # the two kernels with the most device time, launches and seconds a step
    top = summarise(trace, steps=2, wall_s=0.020, top=2)["top_kernels"]
    assert [(k, c, t) for _, k, c, t in top] == [("gemm", 0.5, 0.001), ("gemm", 0.5, 0.0005)]


def test_stream_bytes_counts_an_out_result_once():
    """``torch.add(a, b, out=c)`` reads a and b and writes c: 3 tensors' bytes. Catches the
    result counted again beside its ``out=`` argument (ZeRO's one-kernel pack, an
    ``out=`` operator, counted 4)."""
    import torch

    from plait.train.profiling import StreamBytes

    a, b, c = torch.ones(256), torch.ones(256), torch.empty(256)
    with StreamBytes() as count:
        torch.add(a, b, out=c)
    assert count.bytes["add"] == 3 * 256 * 4
