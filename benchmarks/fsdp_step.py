"""One GPU's step of an MPT-shaped model under PyTorch FSDP1 the way llm-foundry ran it,
with and without recomputation, measured by kind of kernel beside the performance
model's price of the same step (``--runtime fsdp``), and the block's GEMMs alone.

    python benchmarks/fsdp_step.py                 # on a GPU (~2 minutes on an H100)
    python benchmarks/fsdp_step.py --smoke         # a tiny model on the CPU: the script runs
    python benchmarks/fsdp_step.py --fake-world 8 --only 7b-fsdp1-none --layers 32 --no-gemms
                                                   # the whole MPT-7B as rank 0 of 8 GPUs
    python benchmarks/fsdp_step.py --fake-world 32 --only 30b-fsdp1-full --no-gemms
                                                   # 4 of MPT-30B's blocks, rank 0 of 32

Why: the model prices llm-foundry's and IBM's H100 rows without recomputation 10-20% too
fast and those with it slightly slow (docs/performance-model.md section 6). One GPU takes
the network out: if its step matches the model, the gap is in the many-GPU part
(exposed collectives, the SMs NCCL takes); if the one-GPU step is already slow, the model
misprices compute, and the kinds say which part.

What runs (our own plain PyTorch, not llm-foundry's code): MPT's block -- LayerNorm
without bias run in bf16 (MPT's ``low_precision_layernorm``), fused QKV, causal SDPA
(FlashAttention-2 here; MPT's runs used Triton's FlashAttention with ALiBi), GELU MLP of
4h, no biases, tied embedding -- with Composer's ``amp_bf16`` + FSDP ``DEFAULT``
settings read in composer (2023-05, ``mosaic_fsdp.get_mixed_precision``,
``dist_strategy``): autocast bf16, FSDP1 ``param_dtype`` bf16 with fp32 reduction,
one unit per block, ``limit_all_gathers``, ``BACKWARD_POST`` prefetch, reentrant
activation checkpointing of each block; AdamW on the fp32 flat parameters. A world of one
process: FSDP1 runs its casts, copies and hooks, and the collectives are one-rank ones.
Beside it the same model without FSDP (fp32 parameters under autocast) separates what
FSDP1's unit machinery costs on one GPU.

Printed per case: the step time (median of the timed steps), the device time by kind of
kernel (``plait.train.profiling.summarise`` of one profiled step), the peak memory, and
the model's step and split on the GPU's preset (``h100-sxm`` / ``h200``) with the
``fsdp`` and ``plait`` runtimes. Then each GEMM of the block (forward, input gradient,
weight gradient) timed alone, as TFLOP/s and as a fraction of the GPU's dense bf16 peak,
beside the model's GEMM efficiency for the same product. Last line: one JSON object.

Communication: one process; its FSDP1 collectives are one-rank NCCL (gloo for --smoke)
collectives issued from the training thread in program order.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.sim import costs, get_hardware, simulate
from plait.sim.hardware import Link
from plait.sim.runtime import PROFILES
from plait.train.profiling import summarise

sys.path.insert(0, str(Path(__file__).parent))
from gpu_profile import device_for, simulated_kinds  # noqa: E402


class Block(nn.Module):
    """MPT's block, no biases; LayerNorm in the autocast dtype."""

    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h, bias=False)
        self.wqkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.ln2 = nn.LayerNorm(h, bias=False)
        self.up = nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    @staticmethod
    def _ln(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        dt = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x.to(dt), ln.normalized_shape, ln.weight.to(dt), None, ln.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.wqkv(self._ln(self.ln1, x)).view(b, s, 3, self.heads, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self._ln(self.ln2, x))))


class MPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.n_heads, cfg.ffn_hidden) for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(Block._ln(self.ln_f, x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def build(cfg: ModelConfig, device, *, fsdp: bool, recompute: bool):
    torch.manual_seed(0)
    model = MPT(cfg).to(device)
    if fsdp:
        from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
            backward_prefetch=BackwardPrefetch.BACKWARD_POST,
            limit_all_gathers=True,
            use_orig_params=False,
            device_id=device,
        )
    if recompute:  # each block, inside its FSDP unit when there is one (Composer's order)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT
            ),
            check_fn=lambda m: isinstance(m, Block),
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                            foreach=device.type == "cuda")  # fmt: skip
    return model, opt


def local_collectives(world: int) -> None:
    """Rank 0 of ``world`` on this one GPU: PyTorch's fake process group (every collective
    completes at once, moving nothing), with FSDP1's two collectives given back their
    local memory traffic on the stream that issues them -- the all-gather writes the shard
    into every slot of the unsharded buffer, the reduce-scatter sums the world's slices
    into the shard -- so the gathered weights are real numbers (tensor cores draw power by
    the bits they see) and FULL_SHARD's machinery runs as on ``world`` GPUs: its shards,
    casts, unsharded buffers allocated and freed per unit, the all-gather rate limit, its
    streams and hooks. What it leaves out is the network, and the SMs NCCL would take."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())

    def gathering(fake):
        def all_gather(output, input, group=None, async_op=False):
            work = fake(output, input, group=group, async_op=async_op)
            output.view(world, -1).copy_(input.reshape(1, -1).expand(world, -1))
            return work

        return all_gather

    def scattering(fake):
        def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = fake(output, input, op=op, group=group, async_op=async_op)
            torch.sum(input.view(world, -1), 0, out=output.view(-1))
            return work

        return reduce_scatter

    # FSDP1 calls one name or the other by PyTorch version
    for name, wrap in (("all_gather_into_tensor", gathering), ("all_gather_single", gathering),
                       ("reduce_scatter_tensor", scattering),
                       ("reduce_scatter_single", scattering)):  # fmt: skip
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name)))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sustain(step, device, seconds: float) -> dict:
    """Steps back to back for ``seconds`` while ``nvidia-smi`` samples the SM clock and the
    board's power every 500 ms: does the step slow as the GPU heats and meets its power
    cap (a published run is hours of this; the timed steps above are seconds)?"""
    import subprocess

    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
         "--format=csv,noheader,nounits", "-lms", "500"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    times, t_end = [], time.perf_counter() + seconds
    try:
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        smi.terminate()
        samples = smi.communicate(timeout=10)[0].split("\n")
    rows = []
    for line in samples:
        with contextlib.suppress(ValueError):
            rows.append([float(x) for x in line.split(",")])
    fifth = max(len(times) // 5, 1)
    out = {"steps": len(times), "first_fifth_s": statistics.median(times[:fifth]),
           "last_fifth_s": statistics.median(times[-fifth:])}  # fmt: skip
    for i, name in enumerate(("sm_mhz", "power_w", "temp_c")):
        col = [r[i] for r in rows if len(r) == 3]
        if col:
            out[name] = {"min": min(col), "median": statistics.median(col), "max": max(col),
                         "last": col[-1]}  # fmt: skip
    return out


def measure(cfg: ModelConfig, mbs: int, device, *, fsdp: bool, recompute: bool,
            warmup: int, steps: int, sustain: float = 0.0) -> dict:  # fmt: skip
    model, opt = build(cfg, device, fsdp=fsdp, recompute=recompute)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (mbs, cfg.seq_len + 1), generator=g).to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    dt = torch.bfloat16

    def step() -> float:
        with torch.autocast(device.type, dtype=dt):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        _sync(device)
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    kinds = summarise(trace, 1, wall)
    table = prof.key_averages().table(
        sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
        row_limit=25,
    )
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    retries = (
        torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0
    )
    sustained = _sustain(step, device, sustain) if sustain else None
    return {"step_s": statistics.median(times), "steps_s": times, "loss": float(loss.detach()),
            "kinds_s": kinds["by_kind_s_per_step"], "busy_s": kinds["device_busy_s_per_step"],
            "profiled_wall_s": wall, "peak_bytes": peak, "alloc_retries": retries,
            "sustained": sustained, "table": table}  # fmt: skip


def modelled(cfg: ModelConfig, mbs: int, recompute: bool, hw, runtime: str,
             world: int = 1) -> dict:  # fmt: skip
    """The model's step for rank 0 of ``world`` (ZeRO-3 over dp = ``world``: its optimizer
    on a 1/world shard), with the network free as ``--fake-world`` leaves it out."""
    layout = Layout(global_batch_size=mbs * world, micro_batch_size=mbs, dtype="bf16", zero=3,
                    dp=world, recompute="full" if recompute else "none")  # fmt: skip
    if world > 1:
        free = Link(bandwidth=1e18, latency=0.0)
        hw = hw.replace(intra_node=free, inter_node=free, devices_per_node=world)
    res = simulate(cfg, layout, hw, world, runtime=runtime)
    kinds = simulated_kinds(cfg, layout, hw, PROFILES[runtime])
    return {"step_s": res.iter_time_s, "kinds_s": kinds, "mfu": res.mfu}


def gemm_sweep(cfg: ModelConfig, mbs: int, device, hw, peak_tflops: float, reps: int) -> list:
    """Each of the block's products, bf16, timed alone: forward [M,K]x[K,N], the input
    gradient [M,N]x[N,K] and the weight gradient [K,M]x[M,N] (M = tokens)."""
    m, h, f = mbs * cfg.seq_len, cfg.hidden, cfg.ffn_hidden
    out = []
    for name, k, n in (("qkv", h, 3 * h), ("proj", h, h), ("up", h, f), ("down", f, h)):
        for phase, (a_shape, b_shape) in (("fwd", ((m, k), (k, n))), ("dgrad", ((m, n), (n, k))),
                                          ("wgrad", ((k, m), (m, n)))):  # fmt: skip
            a = torch.randn(a_shape, device=device, dtype=torch.bfloat16)
            b = torch.randn(b_shape, device=device, dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            _sync(device)
            t = (time.perf_counter() - t0) / reps
            flops = 2 * a_shape[0] * a_shape[1] * b_shape[1]
            rows, inner, cols = a_shape[0], a_shape[1], b_shape[1]
            model_s = costs.gemm_time(hw, "bf16", rows, cols, inner)
            out.append({"gemm": f"{name}.{phase}", "shape": [rows, inner, cols], "s": t,
                        "tflops": flops / t / 1e12, "of_peak": flops / t / 1e12 / peak_tflops,
                        "model_s": model_s})  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    ap.add_argument("--layers", type=int, default=8, help="blocks of the 7B shape (MPT-7B: 32)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument(
        "--sustain",
        type=float,
        default=0.0,
        help="then steps for this many seconds, clocks and power sampled (GPU)",
    )
    ap.add_argument("--table", action="store_true", help="print each case's operator table")
    ap.add_argument(
        "--fake-world",
        type=int,
        default=1,
        help="FSDP1 as rank 0 of this many GPUs, collectives local (GPU)",
    )
    ap.add_argument("--no-gemms", action="store_true", help="skip the GEMMs timed alone")
    args = ap.parse_args(argv)
    device = device_for(args.smoke, "fsdp_step.py")
    if device is None:
        return 2
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    hw = get_hardware("h200" if "H200" in name else "h100-sxm")
    peak = hw.peak("bf16") / 1e12 if cuda else 1.0
    if args.fake_world > 1:
        local_collectives(args.fake_world)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)

    def mpt(layers, hidden, heads, seq=2048, vocab=50368):
        return ModelConfig(arch="gpt2", n_layers=layers, hidden=hidden, n_heads=heads,
                           n_kv_heads=heads, ffn_hidden=4 * hidden, vocab_size=vocab,
                           seq_len=seq)  # fmt: skip

    if args.smoke:  # FSDP1 needs an accelerator: the plain cases only
        shapes = {"7b": (mpt(2, 64, 4, seq=64, vocab=256), 2)}
    else:  # llm-foundry's H100 micro-batches: MPT-7B 6 (no recompute), MPT-13B 2
        shapes = {
            "7b": (mpt(args.layers, 4096, 32), 6),
            "13b": (mpt(max(args.layers * 3 // 4, 1), 5120, 40), 2),
            # the 30B row on 32 H100s (mosaic2_h100_30b_s2048_32): micro-batch 14, recompute
            "30b": (mpt(max(args.layers // 2, 1), 7168, 56), 14),
        }
    cases = [("7b", True, False), ("7b", True, True), ("7b", False, False), ("7b", False, True),
             ("13b", True, False), ("13b", True, True), ("30b", True, True)]  # fmt: skip
    results = {"device": name, "hardware": hw.name, "torch": torch.__version__, "cases": {},
               "gemms": []}  # fmt: skip
    world = (
        f", FSDP1 as rank 0 of {args.fake_world} (collectives local)" if args.fake_world > 1 else ""
    )
    print(f"fsdp_step.py on {name} (torch {torch.__version__}){world}, model on {hw.name}")
    results["fake_world"] = args.fake_world
    for shape, fsdp, rec in cases:
        if shape not in shapes:
            continue
        case = f"{shape}-{'fsdp1' if fsdp else 'plain'}-{'full' if rec else 'none'}"
        if (args.only and case not in args.only.split(",")) or (fsdp and not cuda):
            continue
        cfg, mbs = shapes[shape]
        t0 = time.perf_counter()
        try:
            meas = measure(cfg, mbs, device, fsdp=fsdp, recompute=rec,
                           warmup=args.warmup, steps=args.steps,
                           sustain=args.sustain if cuda else 0.0)  # fmt: skip
        except Exception as e:  # noqa: BLE001 -- one case failing (memory, FSDP) keeps the rest
            import traceback

            print(
                f"== {case}: failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
            traceback.print_exc(limit=-4)
            if cuda:
                torch.cuda.empty_cache()
            continue
        if cuda:  # the case's model and optimizer went with measure's frame
            torch.cuda.empty_cache()
        model = {rt: modelled(cfg, mbs, rec, hw, rt, args.fake_world if fsdp else 1)
                 for rt in ("fsdp", "plait")}  # fmt: skip
        table = meas.pop("table")
        results["cases"][case] = {"layers": cfg.n_layers, "hidden": cfg.hidden, "mbs": mbs,
                                  "measured": meas, "model": model}  # fmt: skip
        fl = model["fsdp"]
        print(f"\n== {case}: {cfg.n_layers} layers, hidden {cfg.hidden}, mbs {mbs}, seq "
              f"{cfg.seq_len} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        print(f"step {meas['step_s'] * 1e3:.1f} ms (steps " + ", ".join(f"{t * 1e3:.1f}" for t in meas["steps_s"])
              + f"), model fsdp {fl['step_s'] * 1e3:.1f} (model / measured "
              f"{fl['step_s'] / meas['step_s']:.3f}), model plait {model['plait']['step_s'] * 1e3:.1f}; "
              f"peak {meas['peak_bytes'] / 2**30:.1f} GiB; loss {meas['loss']:.3f}")  # fmt: skip
        if args.table:
            print(table)
        if meas["sustained"]:
            print(f"sustained: {json.dumps(meas['sustained'])}")
        print(f"allocator retries (cudaMalloc failed, cache flushed): {meas['alloc_retries']}")
        busy = meas["busy_s"] or 0.0
        print(f"device busy {busy * 1e3:.1f} of {meas['profiled_wall_s'] * 1e3:.1f} ms profiled")
        pairs = [("gemm", "gemm"), ("attention", "attention"), ("other", "memory"),
                 ("multi_tensor", "optimizer"), ("copy", None), ("nccl", None)]  # fmt: skip
        for mk, sk in pairs:
            a = meas["kinds_s"].get(mk, 0.0) * 1e3
            b = fl["kinds_s"].get(sk, 0.0) * 1e3 if sk else 0.0
            print(f"  {mk + ('/' + sk if sk and sk != mk else ''):18s} {a:9.2f} {b:9.2f} "
                  f"{(a / b if b else float('nan')):6.2f}")  # fmt: skip
    if cuda and not args.no_gemms:
        cfg, mbs = shapes["7b"]
        results["gemms"] = gemm_sweep(cfg, mbs, device, hw, peak, reps=20)
        print(f"\n== the 7B block's GEMMs alone (M = {mbs * cfg.seq_len} tokens), bf16")
        for g in results["gemms"]:
            print(f"  {g['gemm']:12s} {str(g['shape']):22s} {g['s'] * 1e3:7.3f} ms "
                  f"{g['tflops']:6.0f} TFLOP/s ({g['of_peak']:.3f} of peak), model "
                  f"{g['model_s'] * 1e3:7.3f} ms")  # fmt: skip
    dist.destroy_process_group()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
