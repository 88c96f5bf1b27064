"""plait's trainer against a plain PyTorch training loop on one GPU: same model (the
GPT-2 124M shape, sequence 1024), same batches, bf16 autocast, SDPA attention, fused
AdamW -- eager and compiled (``torch.compile`` per block for plait, of the whole model for
the plain loop). Rounds interleave the four runs; figures are medians of per-step times
after warm-up. Goal: plait's tokens/s at least 0.97 of the plain loop's, eager and
compiled, and its MFU against the GPU's dense bf16 peak (``sim/devices.py``).

    python benchmarks/single_gpu.py [--rounds 3] [--steps 20] [--batch 8]
    python benchmarks/single_gpu.py --smoke      # a tiny model on the CPU: the script runs
    python benchmarks/single_gpu.py --count-ops  # operations dispatched a step, on the CPU

``--count-ops`` counts the operators PyTorch dispatches in one steady eager step of each
(GPT-2's 12 blocks at a tiny width, bf16 autocast, on the CPU: the count does not depend on
the width, and on a GPU each is host time and most a kernel launch), the GEMMs apart, and
plait's step again with ``--zero 3`` (one process: its units gathered by a local cast).

It also prints what ``plait simulate`` predicts for that step on a hardware file
(``--hardware calibrated.yaml`` from ``plait calibrate --device cuda``), beside the
measured step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from single_process import PlainGPT  # noqa: E402  (the nanoGPT-style plain model)

from plait.data import DataConfig, GlobalBatchSampler, prepare  # noqa: E402
from plait.layout import Layout  # noqa: E402
from plait.model.config import preset  # noqa: E402
from plait.model.sizes import model_flops_per_token  # noqa: E402
from plait.topology import Topology  # noqa: E402
from plait.train.config import RunConfig, TrainConfig  # noqa: E402
from plait.train.loop import train  # noqa: E402
from plait.train.metrics import gpu_peak, measure_cpu_peak_tflops  # noqa: E402


def plain_steps(cfg, sampler, steps, *, device, dtype, compiled: bool) -> list[float]:
    torch.manual_seed(0)
    model = PlainGPT(cfg).to(device)
    forward = torch.compile(model) if compiled else model
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                            weight_decay=0.1, **fused)  # fmt: skip
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        plain_step(forward, model, opt, sampler.batch(step).to(device), dtype)
        times.append(time.perf_counter() - t0)
    return times


def plain_step(forward, model, opt, batch, dtype) -> None:
    """One step of the plain loop: autocast forward, backward, clip, AdamW."""
    with torch.autocast(batch.device.type, dtype=dtype):
        loss = forward(batch[:, :-1], batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()  # one host sync per step, as plait's trainer


def plait_steps(cfg, layout, data_cfg, out: Path, steps: int, *, compiled: bool, device):
    run = RunConfig(
        model=cfg, layout=layout, data=data_cfg, out=str(out),
        train=TrainConfig(steps=steps, eval_every=0, eval_batches=1, progress=False,
                          keep_checkpoints=1, lr=1e-3, warmup=2, compile=compiled,
                          peak_tflops=1.0, save_every=10**9),
    )  # fmt: skip
    out.mkdir(parents=True)
    from plait.train import checkpoint

    save, checkpoint.save = checkpoint.save, lambda *a, **k: None  # time the steps only
    try:
        train(run, topo=Topology.single(device))
    finally:
        checkpoint.save = save
    return [json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def count_ops(rows: int = 25) -> dict:
    """Operators dispatched in one steady eager step: plait's ``Trainer.step`` and the plain
    loop's (module docstring). Prints the totals, the GEMMs and the operators whose counts
    differ most; returns the counts."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from plait.train.loop import Trainer

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    data_cfg = DataConfig(tokenizer="bytes")
    data = prepare(data_cfg)
    cfg = preset("gpt2-124m", hidden=64, n_heads=4, seq_len=64, vocab_size=256)
    batch = 8

    def plait_step(zero: int) -> Count:
        layout = Layout(global_batch_size=batch, micro_batch_size=batch, dtype="bf16",
                        zero=zero)  # fmt: skip
        out = Path(tempfile.mkdtemp(prefix="plait-ops-"))
        run = RunConfig(
            model=cfg, layout=layout, data=data_cfg, out=str(out),
            train=TrainConfig(steps=10, eval_every=0, eval_batches=1, progress=False,
                              keep_checkpoints=1, lr=1e-3, warmup=2, peak_tflops=1.0,
                              save_every=10**9),
        )  # fmt: skip
        torch.manual_seed(0)
        trainer = Trainer(run, topo=Topology.single(torch.device("cpu")))
        trainer.model.train()
        for step in range(3):  # the optimizer's state exists from the first step on
            trainer.step(step)
        count = Count()
        with count:
            trainer.step(3)
        return count

    plait_count = plait_step(0)
    zero3_count = plait_step(3)  # units gathered in bf16: the fused GEMMs read their rows

    sampler = GlobalBatchSampler(data.train, seq_len=cfg.seq_len, global_batch=batch, seed=0)
    plain_count = Count()
    model = PlainGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                            weight_decay=0.1, foreach=True)  # fmt: skip

    for step in range(4):  # the last one counted
        with plain_count if step == 3 else contextlib.nullcontext():
            plain_step(model, model, opt, sampler.batch(step), torch.bfloat16)

    a, b = plait_count.ops, plain_count.ops
    gemms = ("mm", "addmm", "bmm")
    print(f"operators dispatched in one step (GPT-2's {cfg.n_layers} blocks, bf16 autocast, "
          f"CPU): plait {sum(a.values())}, plain {sum(b.values())}; GEMMs plait "
          f"{sum(a[g] for g in gemms)}, plain {sum(b[g] for g in gemms)}")  # fmt: skip
    z = zero3_count.ops
    print(f"  plait --zero 3: operators {sum(z.values())}, GEMMs {sum(z[g] for g in gemms)}")
    print(f"  {'operator':32s} {'plait':>6s} {'plain':>6s}")
    for k in sorted(set(a) | set(b), key=lambda k: -abs(a[k] - b[k]))[:rows]:
        if a[k] != b[k]:
            print(f"  {k:32s} {a[k]:6d} {b[k]:6d}")
    return {"plait": dict(a), "plain": dict(b), "zero3": dict(z)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--count-ops", action="store_true",
                    help="count the operators one step dispatches (CPU) and stop")  # fmt: skip
    ap.add_argument("--hardware", help="a hardware file to predict the step with")
    ap.add_argument("--vocab", type=int, default=50257,
                    help="vocabulary rows (GPT-2's 50257; 50304 = a multiple of 128 for both)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.count_ops:
        count_ops()
        return 0

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda and not args.smoke:
        print("single_gpu.py: no GPU here; run with --smoke to check the script on the CPU")
        return 2
    data_cfg = DataConfig(tokenizer="bytes")
    data = prepare(data_cfg)
    if args.smoke:
        cfg = preset("tiny", n_layers=2, hidden=64, n_heads=4, seq_len=64, vocab_size=256)
        dtype_name, dtype = "fp32", torch.float32
        args.steps, args.warmup_steps, args.rounds = 6, 2, 1
    else:  # GPT-2 124M's shape; a byte vocabulary padded to GPT-2's 50257 rows
        cfg = preset("gpt2-124m", vocab_size=args.vocab)
        dtype_name, dtype = "bf16", torch.bfloat16
    layout = Layout(global_batch_size=args.batch, micro_batch_size=args.batch, dtype=dtype_name)
    sampler = GlobalBatchSampler(data.train, seq_len=cfg.seq_len, global_batch=args.batch, seed=0)
    tokens = args.batch * cfg.seq_len
    tmp = Path(tempfile.mkdtemp(prefix="plait-gpu-bench-"))
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for compiled in (False, True):
            tag = "compiled" if compiled else "eager"
            got = plait_steps(cfg, layout, data_cfg, tmp / f"{tag}-{r}", args.steps,
                              compiled=compiled, device=device)  # fmt: skip
            times.setdefault(f"plait {tag}", []).extend(got[args.warmup_steps :])
            got = plain_steps(cfg, sampler, args.steps, device=device, dtype=dtype,
                              compiled=compiled)  # fmt: skip
            times.setdefault(f"plain {tag}", []).extend(got[args.warmup_steps :])
    med = {k: statistics.median(v) for k, v in times.items()}
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, dtype_name) * 1e12
    else:
        name, peak = "cpu", measure_cpu_peak_tflops("fp32") * 1e12
    flops = model_flops_per_token(cfg) * tokens
    result = {
        "device": name,
        "vocab": cfg.vocab_size,
        "tokens_per_step": tokens,
        "step_s": med,
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "mfu": {k: flops / v / peak for k, v in med.items()},
        "ratio_eager": med["plain eager"] / med["plait eager"],
        "ratio_compiled": med["plain compiled"] / med["plait compiled"],
    }
    if args.hardware:
        from plait.sim.hardware import load_hardware
        from plait.sim.simulate import simulate

        pred = simulate(cfg, layout, load_hardware(path=args.hardware), 1, runtime="plait")
        result["predicted_step_s"] = pred.iter_time_s
        result["predicted_over_measured"] = pred.iter_time_s / med["plait eager"]
    print(json.dumps(result, indent=1))
    print(
        f"{name}, vocabulary {cfg.vocab_size}: plait/plain tokens/s ratio eager {result['ratio_eager']:.3f}, compiled "
        f"{result['ratio_compiled']:.3f} (goal >= 0.97); MFU plait eager "
        f"{result['mfu']['plait eager']:.1%}, compiled {result['mfu']['plait compiled']:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
