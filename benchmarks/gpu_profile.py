"""Where a GPU step's time goes, measured against what the performance model says: the
device time of plait's own step by kind of kernel (``plait train --profile``), beside the
simulator's split of the same step (``costs.LayerCost.kinds``), on one GPU.

    python benchmarks/gpu_profile.py [--hardware h200] [--only gpt2,llama1b]
    python benchmarks/gpu_profile.py --smoke      # a tiny model on the CPU: the script runs

Two workloads: GPT-2 124M (seq 1024, batch 8, the ``single_gpu.py`` shape) and a ~1B
llama (``llama3.2-1b`` with a 256 vocabulary, seq 2048, micro-batch 4, 2 micro-batches,
the ``gpu_checks.sh peaks`` shape), bf16, 4 steps, steps 3-4 profiled. Printed per
workload and kind (ms a step): measured, simulated, ratio; the device's busy time against
the step's wall time (what the GPU waited for the host); and the unprofiled step time
against the simulated one. Matching: measured "other" (elementwise, norms, loss, casts) vs
the model's "memory"; "multi_tensor" (fused AdamW, the gradient norm, scaling) vs its
optimizer time; wall - busy vs its per-kernel "launch" overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from plait.data import DataConfig
from plait.layout import Layout
from plait.model import sizes
from plait.model.config import preset
from plait.sim import costs, get_hardware, simulate
from plait.sim.runtime import PROFILES
from plait.topology import Topology
from plait.train import checkpoint
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train


def workloads(smoke: bool):
    if smoke:
        tiny = preset("tiny", n_layers=2, hidden=64, n_heads=4, seq_len=64, vocab_size=256)
        return {"tiny": (tiny, Layout(global_batch_size=4, micro_batch_size=2, dtype="bf16"))}
    return {
        "gpt2": (preset("gpt2-124m", vocab_size=50257),
                 Layout(global_batch_size=8, micro_batch_size=8, dtype="bf16")),
        "llama1b": (preset("llama3.2-1b", vocab_size=256, seq_len=2048),
                    Layout(global_batch_size=8, micro_batch_size=4, dtype="bf16")),
    }  # fmt: skip


def simulated_kinds(cfg, layout, hw, rt=None) -> dict[str, float]:
    """The model's seconds a step by kind on one GPU of the layout (pp = 1): every layer's
    micro-batches of its data-parallel rank, the embedding and head's, and the optimizer
    (on its ZeRO shard; plait's runtime unless ``rt``)."""
    rt = rt or PROFILES["plait"]
    m = layout.num_microbatches
    out: dict[str, float] = {}
    parts = [(costs.layer_cost(cfg, layout, hw, rt).kinds, m * cfg.n_layers),
             (costs.embedding_cost(cfg, layout, hw).kinds, m),
             (costs.head_cost(cfg, layout, hw, rt).kinds, m)]  # fmt: skip
    for kinds, times in parts:
        for k, v in kinds:
            out[k] = out.get(k, 0.0) + v * times
    n = sizes.num_params(cfg)
    out["optimizer"] = costs.optimizer_time(
        n, layout, hw, rt, 2 + cfg.n_layers * sizes.layer_tensors(cfg)
    )
    return out


def run(name, cfg, layout, out: Path, device, lr: float) -> tuple[dict, list[dict]]:
    run_cfg = RunConfig(
        model=cfg, layout=layout, data=DataConfig(tokenizer="bytes"), out=str(out),
        train=TrainConfig(steps=4, warmup=2, lr=lr, eval_every=0, eval_batches=1, progress=False,
                          profile="3:4", save_every=10**9),
    )  # fmt: skip
    out.mkdir(parents=True)
    save, checkpoint.save = checkpoint.save, lambda *a, **k: None  # the steps only
    try:
        train(run_cfg, topo=Topology.single(device))
    finally:
        checkpoint.save = save
    summary = json.loads((out / "profile" / "rank-0-summary.json").read_text())
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    print((out / "profile" / "rank-0.txt").read_text()[:6000])
    return summary, steps


def device_for(smoke: bool, script: str) -> torch.device | None:
    """The GPU, or the CPU under ``--smoke``; None after one line when there is no GPU."""
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script}: no GPU here; --smoke checks the script on the CPU")
        return None
    return torch.device("cuda", 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument(
        "--hardware", default=None, help="a preset (default: h200 on an H200, else h100-sxm)"
    )
    ap.add_argument("--only", default=None, help="comma-separated workloads")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--lr", type=float, default=3e-4, help="the runs' peak learning rate")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    args = ap.parse_args(argv)
    device = device_for(args.smoke, "gpu_profile.py")
    if device is None:
        return 2
    cuda = device.type == "cuda"
    hw_name = args.hardware or (
        "h200" if cuda and "H200" in torch.cuda.get_device_name(0) else "h100-sxm"
    )
    hw = get_hardware(hw_name)
    tmp = Path(tempfile.mkdtemp(prefix="plait-gpu-profile-"))
    results = {}
    for name, (cfg, layout) in workloads(args.smoke).items():
        if args.only and name not in args.only.split(","):
            continue
        layout = dataclasses.replace(layout, dtype=args.dtype)
        summary, steps = run(name, cfg, layout, tmp / name, device, args.lr)
        sim = simulated_kinds(cfg, layout, hw)
        pred = simulate(cfg, layout, hw, 1, runtime="plait").iter_time_s
        meas = summary["by_kind_s_per_step"]
        pairs = [("gemm", "gemm"), ("attention", "attention"), ("other", "memory"),
                 ("multi_tensor", "optimizer"), ("copy", None), ("nccl", None)]  # fmt: skip
        print(f"\n== {name} on {device} vs the model on {hw_name} (ms a step; steps 3-4 profiled)")
        print(f"{'kind':14s} {'measured':>9s} {'model':>9s} {'ratio':>6s}")
        for mk, sk in pairs:
            a, b = meas.get(mk, 0.0) * 1e3, sim.get(sk, 0.0) * 1e3 if sk else 0.0
            print(f"{mk + ('/' + sk if sk and sk != mk else ''):14s} {a:9.2f} {b:9.2f} "
                  f"{(a / b if b else float('nan')):6.2f}")  # fmt: skip
        busy, wall = summary["device_busy_s_per_step"] or 0.0, summary["wall_s_per_step"]
        unprof = [s["step_time_s"] for s in steps[1:2]]
        print(
            f"device busy {busy * 1e3:.2f} of {wall * 1e3:.2f} ms profiled wall "
            f"(idle {(wall - busy) * 1e3:.2f}; model's launch term {sim['launch'] * 1e3:.2f})"
        )
        print(
            f"step time unprofiled (step 2) {unprof[0]:.4f} s, model {pred:.4f} s "
            f"(model / measured {pred / unprof[0]:.3f}); losses "
            + ", ".join(f"{s['loss']:.3f}" for s in steps)
        )
        results[name] = {"measured": meas, "model": sim, "busy": busy, "wall": wall,
                         "step_s": [s["step_time_s"] for s in steps], "model_step_s": pred}  # fmt: skip
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
