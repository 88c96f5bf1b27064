"""One rank of a full layout, run for real on this one GPU, beside what ``plait rehearse``
and the performance model say of it.

    python benchmarks/rank_on_gpu.py                         # every case, on CUDA
    python benchmarks/rank_on_gpu.py --only 7b-z3,7b-z3-m1   # some
    python benchmarks/rank_on_gpu.py --only 7b-z3 --profile  # device time by kind
    python benchmarks/rank_on_gpu.py --only 7b-z3 --profile --kernels 30  # and by kernel
    python benchmarks/rank_on_gpu.py --smoke                 # a tiny model on the CPU

``plait rehearse`` runs a rank's program on fake tensors (no storage) and counts what its
storages hold. This runs the same program -- the ``Trainer`` of ``train/loop.py``, built
and stepped as the rehearsal does (its synthetic batches: ``rehearse._trainer_class``) --
under the same fake process group, but with real tensors on the GPU, and reads the CUDA
caching allocator's peak (``torch.cuda.max_memory_allocated``) per step. What the fake
tensors cannot show, this does: storages the allocator keeps for a side stream, gradients
accumulated in place or not, fused kernels' workspaces, and the step's time.

The fake process group completes every call at once and moves nothing. So that the values
are real numbers (NaNs change neither memory nor GEMM time, but they would change a step
that skips on a non-finite norm) and the memory traffic a collective makes is made:
ZeRO's all-gather writes the shard into every slot of its output, the reduce-scatter sums
the input's slices into the shard, and a pipeline's receive zeroes its buffer (the calls
``comm.py`` makes, wrapped here). The network itself, and the SMs NCCL would take, are
left out: the step time is this rank's compute with the network free, held against the
model's step with free links (``Link(bandwidth=1e18)``), for layouts without pipelines
(a pipeline rank alone waits for no other stage: its time is not the model's step).

Communication: none leaves the process (the fake group); every case runs in this process,
one after another, each under its own group, destroyed before the next.

Prints, per case: peak memory per step measured / rehearsed / simulated (GiB) and the
ratios, the step time measured and modelled; then one JSON line of the figures;
``--json FILE`` writes every field.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_profile

GiB = 2**30

# flags as ``plait rehearse`` takes them (``build_run_config``'s keys); rank 0 of each
SEVEN_B = {"model": "llama2-7b", "dp": 64, "micro_batch_size": 1, "dtype": "bf16"}
CASES = {
    # ZeRO-3 over 64 ranks, two micro-batches: rehearsed 21.5 GiB, the model 19.95
    "7b-z3": {**SEVEN_B, "zero": 3, "global_batch_size": 128},
    # one micro-batch: what a model that adds each term's own peak would over-predict
    "7b-z3-m1": {**SEVEN_B, "zero": 3, "global_batch_size": 64},
    "7b-hsdp8": {**SEVEN_B, "zero": 3, "zero_shard_group": 8, "global_batch_size": 128},
    "7b-z2": {**SEVEN_B, "zero": 2, "global_batch_size": 128},
    # a tied table at a real vocabulary: its ZeRO-3 unit in fp32 and the head's bf16 cast
    # set the peak as the forward ends (``memory.tied_zero3_unit``; rehearsed 1.001 of
    # the model at 4,096 tokens, 1.134 before the model had them)
    "1b-tied-z3": {"model": "llama3.2-1b", "dp": 8, "zero": 3, "micro_batch_size": 1,
                   "seq_len": 4096, "global_batch_size": 16, "dtype": "bf16"},
    # GPT-3 175B's first pipeline stage (tp 8, pp 16, dp 8): 17 of its 192 micro-batches
    # reach every state of the full step (rehearse.shortened_layout)
    "175b-stage0": {"model": "gpt3-175b", "tp": 8, "pp": 16, "dp": 8, "micro_batch_size": 1,
                    "global_batch_size": 1536, "dtype": "bf16"},
}  # fmt: skip
SMOKE = {
    "tiny-z3": {"model": "tiny", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 32,
                "dp": 4, "zero": 3, "global_batch_size": 8, "micro_batch_size": 1},
    "tiny-pp": {"model": "tiny", "layers": 4, "hidden": 64, "heads": 4, "seq_len": 32,
                "pp": 2, "tp": 2, "dp": 2, "global_batch_size": 16, "micro_batch_size": 1},
}  # fmt: skip


@contextlib.contextmanager
def local_traffic(collectives: bool = True):
    """ZeRO's gathers and reduce-scatters (unless not ``collectives``), and a pipeline's
    receives, given back the writes a real backend makes to their outputs (module
    docstring)."""
    from plait import comm

    gather, scatter = comm._all_gather_single, comm._reduce_scatter_single
    batch = dist.batch_isend_irecv

    def all_gather(out, inp, group=None, async_op=False):
        work = gather(out, inp, group=group, async_op=async_op)
        n = out.numel() // max(inp.numel(), 1)
        out.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))
        return work

    def reduce_scatter(out, inp, group=None, async_op=False, **kw):
        work = scatter(out, inp, group=group, async_op=async_op, **kw)
        n = inp.numel() // max(out.numel(), 1)
        torch.sum(inp.view(n, -1), 0, out=out.view(-1))
        return work

    def batch_isend_irecv(ops):
        works = batch(ops)
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.zero_()
        return works

    if collectives:
        comm._all_gather_single, comm._reduce_scatter_single = all_gather, reduce_scatter
    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        comm._all_gather_single, comm._reduce_scatter_single = gather, scatter
        dist.batch_isend_irecv = batch


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled_step(trainer, step: int, device, top: int = 0) -> dict:
    """One more step under ``torch.profiler``: device time by kind of kernel
    (``plait.train.profiling.summarise``); with ``top``, its ``top`` kernels and the
    operators by their own device time (``ops``: PyTorch's table)."""
    from torch.profiler import ProfilerActivity, profile

    from plait.train.profiling import summarise

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.step(step)
        _sync(device)
        wall = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    out = summarise(trace, 1, wall, top)
    if top:
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        out["ops"] = prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)
    return out


def run_for_real(cfg, rank: int, device, steps: int, made_batch: int | None,
                 profile: bool = False, top: int = 0) -> dict:  # fmt: skip
    """Rank ``rank`` of ``cfg``'s layout built and stepped ``steps`` times on ``device``
    under the fake process group: each step's allocator peak and time; with ``profile``
    two more steps under the profiler, with the collectives' local writes and without
    them (what those writes, which NCCL would make, cost on this GPU)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from plait import rehearse
    from plait.topology import Topology

    lay = cfg.layout
    dist.init_process_group("fake", rank=rank, world_size=lay.world_size, store=FakeStore())
    try:
        topo = Topology.build(pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp, device=device)
        with local_traffic():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            trainer = rehearse._trainer_class(made_batch)(cfg, topo=topo)
            if lay.pp > 1:  # as the rehearsal: a completed send is let go once reaped
                trainer.runner.sends_done_when_reaped = True
            _sync(device)
            built = time.perf_counter() - t0
            build_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            trainer.model.train()
            peaks, times, losses = [], [], []
            for step in range(steps):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t0 = time.perf_counter()
                stats = trainer.step(step)
                _sync(device)
                times.append(time.perf_counter() - t0)
                peaks.append(
                    torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
                )
                losses.append(stats.get("loss"))
            retries = (torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
                       if device.type == "cuda" else 0)  # fmt: skip
            kinds = {"local writes": profiled_step(trainer, steps, device)} if profile else {}
        if profile:  # the same step with the gathers and reduce-scatters writing nothing
            with local_traffic(collectives=False):
                try:
                    kinds["no local writes"] = profiled_step(trainer, steps + 1, device, top)
                except FloatingPointError as e:  # stale buffers: not a step to time
                    print(f"  (the step without local writes: {e})", flush=True)
        trainer.close()
        del trainer
        return {"build_s": built, "build_peak": build_peak, "step_peaks": peaks,
                "step_s": times, "losses": losses, "alloc_retries": retries,
                "profiled": kinds}  # fmt: skip
    finally:
        dist.destroy_process_group()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def modelled_step(cfg, hw_name: str) -> float | None:
    """The model's step for this layout with every link free (None with pipelines)."""
    from plait.sim import get_hardware, simulate
    from plait.sim.hardware import Link

    lay = cfg.layout
    if lay.pp > 1:
        return None
    free = Link(bandwidth=1e18, latency=0.0)
    hw = get_hardware(hw_name)
    hw = hw.replace(intra_node=free, inter_node=free, devices_per_node=lay.world_size)
    return simulate(cfg.model, lay, hw, lay.world_size, runtime="plait").iter_time_s


def modelled_kinds(cfg, hw_name: str) -> dict | None:
    """The model's device seconds a step by kind for this rank (None with pipelines)."""
    from gpu_profile import simulated_kinds

    from plait.sim import get_hardware

    if cfg.layout.pp > 1:
        return None
    return simulated_kinds(cfg.model, cfg.layout, get_hardware(hw_name))


def run_case(name: str, values: dict, device, steps: int, hw_name: str,
             profile: bool = False, top: int = 0) -> dict:  # fmt: skip
    from plait import rehearse
    from plait.commands.train import build_run_config

    with tempfile.TemporaryDirectory(prefix="plait-rank-") as out:
        cfg = build_run_config({**values, "out": out})
        t0 = time.perf_counter()
        report = rehearse.rehearse_rank(cfg, 0)
        rehearsed_s = time.perf_counter() - t0
        compared = rehearse.compared(report, cfg)
        rehearsed = {p.name: p.peak for p in report.phases}
        simulated = compared["memory"]["total"][1]
        run = rehearse.shortened_layout(cfg, 0)
        made = None
        if run.num_microbatches < cfg.layout.num_microbatches:
            made = cfg.layout.global_batch_size
            cfg = dataclasses.replace(cfg, layout=run)
        real = run_for_real(cfg, 0, device, steps, made, profile, top)
    real.update(
        case=name, flags=values, microbatches_run=cfg.layout.num_microbatches,
        rehearsed_peaks=rehearsed, rehearsed_split=next(p.split for p in report.phases if p.name == "step 2"),
        simulated_peak=simulated, simulated_split={k: v[1] for k, v in compared["memory"].items()},
        rehearse_s=rehearsed_s, modelled_step_s=modelled_step(cfg, hw_name),
        modelled_kinds=modelled_kinds(cfg, hw_name) if profile else None,
    )  # fmt: skip
    return real


def summary(r: dict) -> str:
    reh = max(r["rehearsed_peaks"]["step 1"], r["rehearsed_peaks"]["step 2"])
    got = max(r["step_peaks"][1:] or r["step_peaks"])  # a steady step's
    med = statistics.median(r["step_s"][1:] or r["step_s"])
    model = r["modelled_step_s"]
    time_part = (f"step {med:.3f} s measured (median of {len(r['step_s']) - 1}), modelled "
                 f"{model:.3f} s (measured / modelled {med / model:.3f})" if model else
                 f"step {med:.3f} s measured (a pipeline rank alone: no modelled step)")  # fmt: skip
    return (
        f"{r['case']}: {r['microbatches_run']} micro-batches a step; peak memory GiB "
        f"measured {got / GiB:.2f} (steps: "
        + ", ".join(f"{p / GiB:.2f}" for p in r["step_peaks"])
        + f"), rehearsed {reh / GiB:.2f}, simulated {r['simulated_peak'] / GiB:.2f}; "
        f"measured / rehearsed {got / reh:.3f}, measured / simulated "
        f"{got / r['simulated_peak']:.3f}; build peak {r['build_peak'] / GiB:.2f} "
        f"(rehearsed {r['rehearsed_peaks']['build'] / GiB:.2f}); {time_part}; allocator "
        f"flushes {r['alloc_retries']}"
    )


def kinds_table(r: dict) -> str:
    """Measured device ms a step by kind (with and without the local writes) beside the
    model's."""
    runs = {k: v["by_kind_s_per_step"] for k, v in r["profiled"].items()}
    model = r.get("modelled_kinds") or {}
    names = sorted(set(model).union(*runs.values()))
    head = "".join(f"{k:>17s}" for k in runs) + f"{'model':>10s}"
    lines = [f"  {'device ms by kind':24s}{head}"]
    for n in names:
        got = "".join(f"{1e3 * v.get(n, 0.0):17.1f}" for v in runs.values())
        lines.append(f"  {n:24s}{got}{1e3 * model.get(n, 0.0):10.1f}")
    busy = "".join(f"{1e3 * (v['device_busy_s_per_step'] or 0):17.1f}"
                   for v in r["profiled"].values())  # fmt: skip
    wall = "".join(f"{1e3 * v['wall_s_per_step']:17.1f}" for v in r["profiled"].values())
    lines.append(f"  {'busy':24s}{busy}{1e3 * sum(model.values()):10.1f}")
    # the fake group's all-gather copies its input into every slot of the output (64
    # device-to-device copies a gather at dp 64): a collective's work, which the model's
    # step with free links leaves out, as it does the local writes
    bare = "".join(f"{1e3 * ((v['device_busy_s_per_step'] or 0) - v['by_kind_s_per_step'].get('copy', 0)):17.1f}"
                   for v in r["profiled"].values())  # fmt: skip
    lines.append(f"  {'busy less copies':24s}{bare}{1e3 * sum(model.values()):10.1f}")
    lines.append(f"  {'wall':24s}{wall}")
    return "\n".join(lines)


def kernels_table(r: dict) -> str:
    """The step's top kernels and operators (``--kernels``), without the local writes."""
    got = r["profiled"].get("no local writes") or {}
    lines = [
        f"  {1e3 * s:8.2f} ms {c:7.0f}x  {k:12s} {n}" for n, k, c, s in got.get("top_kernels", [])
    ]
    return "\n".join(lines + ([got["ops"]] if got.get("ops") else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--steps", type=int, default=3, help="steps run for real (>= 2)")
    ap.add_argument("--hardware", default=None, help="the model's GPU (default: by name)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="two more steps under torch.profiler (with and without the local "
                    "writes): device time by kind against the model's")  # fmt: skip
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="with --profile: the N kernels and operators with the most device "
                    "time in the step without local writes")  # fmt: skip
    args = ap.parse_args(argv)
    cases = SMOKE if args.smoke else CASES
    names = args.only.split(",") if args.only else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        print(f"rank_on_gpu: --only {args.only}: no case {unknown[0]!r} (have: "
              f"{', '.join(cases)})", file=sys.stderr)  # fmt: skip
        return 2
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("rank_on_gpu: no GPU here (--smoke runs tiny models on the CPU)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", 0)
    hw = args.hardware
    if hw is None:
        name = torch.cuda.get_device_name(0) if device.type == "cuda" else ""
        hw = "h200" if "H200" in name else "h100-sxm" if device.type == "cuda" else "a100-80gb"
    print(f"device {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, model hardware {hw}", flush=True)  # fmt: skip
    results, failed = [], 0
    for name in names:
        t0 = time.perf_counter()
        try:
            r = run_case(name, cases[name], device, max(args.steps, 2), hw, args.profile,
                         args.kernels)  # fmt: skip
        except Exception as e:  # noqa: BLE001 -- one case's failure is reported, the rest run
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                  flush=True)  # fmt: skip
            import traceback

            traceback.print_exc()
            continue
        results.append(r)
        print(summary(r) + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
        if r["profiled"]:
            print(kinds_table(r), flush=True)
            print(kernels_table(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps({r["case"]: {k: r[k] for k in ("step_peaks", "rehearsed_peaks",
                                                     "simulated_peak", "losses", "step_s")}
                      for r in results}, default=str))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
