"""plait's data parallelism against PyTorch's, same model, same batch, same processes.

    python benchmarks/data_parallel.py                  # ~2-3 minutes on 2 CPU cores
    python benchmarks/data_parallel.py --reps 3 --steps 2 --write-results
    python benchmarks/data_parallel.py --overlap        # + what the backward overlap buys

Two gloo processes (``--dp``) hold four implementations of the same GPT (default: 6 layers
x 256 hidden, vocabulary 4,096, 16 sequences of 128 tokens = 2,048 tokens a step, fp32,
``--micro`` micro-batches per rank, default one), all built from the same initial weights:

- plait ``--zero 0``: ``build_data_parallel`` (bucketed all-reduce launched from the
  backward hooks)                    vs  ``torch.nn.parallel.DistributedDataParallel``;
- plait ``--zero 3``: parameters gathered per block, prefetched, freed after use
                                     vs  FSDP2: ``fully_shard`` on every block, then the root.

A step is forward + backward + gradient sync + AdamW (foreach) for all four; no clipping.
With ``--micro M`` each rank runs M forward-backward passes a step: DDP under ``no_sync``
until the last (as plait's stage 0 communicates only then), FSDP2 reduce-scattering
every one (its default, and what plait's stages 2-3 do).
Pairs alternate in blocks of ``--steps`` steps, ``--reps`` times (runs here vary by
10-20%); figures are medians of per-step times (a barrier closes each block). Step-1
losses of all four are checked to agree.

Peak memory per rank: the growth of the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) from building the implementation to the end of two
steps, measured one implementation at a time after a warm-up (imports) and with
``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors go back to the OS. Not a tensor
tracker: ``torch.distributed._tools.mem_tracker`` does not see storages grown with
``untyped_storage().resize_()``, which is how both FSDP2 and plait's ZeRO-3 materialise
parameters. Last, every ZeRO stage's measured model state per rank (parameters,
gradients, AdamW state) beside ``sizes.model_state_breakdown``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).with_name("RESULTS.md")


# --- memory -------------------------------------------------------------------------------


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _settle() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRSS:
    """Peak resident-set growth over a block (Linux): reset VmHWM, read it after."""

    def __enter__(self):
        _settle()
        self.base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        return self

    def __exit__(self, *exc):
        self.peak = _status("VmHWM") - self.base
        return False


# --- the four implementations -------------------------------------------------------------


class Impl:
    """One implementation: a model (plait's Transformer) wrapped for data parallelism."""

    def __init__(self, name, model, step_fn):
        self.name, self.model, self._step = name, model, step_fn

    def step(self, x, y, tokens) -> float:
        return self._step(x, y, tokens)


def build(name: str, args, topo) -> Impl:
    from plait.model.config import preset
    from plait.model.transformer import build_model
    from plait.parallel.engine import DataParallelConfig, build_data_parallel
    from plait.train import optim
    from plait.train.config import TrainConfig

    cfg = preset("tiny", n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                 vocab_size=args.vocab, seq_len=args.seq_len)  # fmt: skip
    tcfg = TrainConfig(lr=1e-3, warmup=0)
    model = build_model(cfg, seed=0)
    if name.startswith("plait"):
        zero = int(name[-1])
        engine = build_data_parallel(
            model, topo=topo,
            cfg=DataParallelConfig(zero=zero, bucket_mb=args.bucket_mb,
                                   num_microbatches=args.micro),
            make_optimizer=functools.partial(optim.build_adamw, cfg=tcfg),
            owns_grad=functools.partial(optim.owns_grad, topo=topo),
        )  # fmt: skip

        def step(x, y, tokens):  # loss over the global tokens: the dp sum is the mean
            loss = 0.0
            for xm, ym in zip(x.chunk(args.micro), y.chunk(args.micro)):
                part = model(xm, ym).sum() / tokens
                part.backward()
                loss += part.detach()
            engine.finish()
            engine.step(1e-3)
            engine.zero_grad()
            return loss.item() * args.dp

        impl = Impl(name, model, step)
        impl.engine = engine
        return impl
    named = list(model.named_parameters())
    if name == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:  # fsdp2
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (args.dp,))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
        named = list(model.named_parameters())  # now DTensor shards
    opt = optim.build_adamw([(n, p, p) for n, p in named], tcfg)

    def step(x, y, tokens):  # DDP and FSDP average over dp: loss over the local tokens
        # accumulation as each is used: DDP under no_sync until the last micro-batch,
        # FSDP2 reduce-scattering every one (its default, and plait's ZeRO-2/3)
        loss = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(args.micro), y.chunk(args.micro))):
            quiet = name == "ddp" and i < args.micro - 1
            with wrapped.no_sync() if quiet else contextlib.nullcontext():
                part = wrapped(xm, ym).sum() / (tokens / args.dp)
                part.backward()
            loss += part.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return Impl(name, wrapped, step)


# --- the worker ---------------------------------------------------------------------------

PAIRS = (("plait-zero0", "ddp"), ("plait-zero3", "fsdp2"))


def _barrier_time() -> float:
    dist.barrier()
    return time.perf_counter()


def worker(rank: int, args) -> dict:
    from plait.model.sizes import model_state_breakdown
    from plait.topology import Topology

    torch.manual_seed(0)
    topo = Topology.build(pp=1, dp=args.dp, tp=1)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    local = batch.chunk(args.dp)[rank]
    x, y, tokens = local[:, :-1], local[:, 1:], batch[:, 1:].numel()
    out: dict = {"loss1": {}, "times": {}, "peak": {}, "stages": {}}

    # warm-up: every implementation once (imports, first-call allocations), untimed
    for name in (n for pair in PAIRS for n in pair):
        impl = build(name, args, topo)
        out["loss1"][name] = impl.step(x, y, tokens)
        del impl
    # peak memory, one implementation at a time
    for name in (n for pair in PAIRS for n in pair):
        dist.barrier()
        with PeakRSS() as m:
            impl = build(name, args, topo)
            for _ in range(2):
                impl.step(x, y, tokens)
        out["peak"][name] = m.peak
        del impl
    # step times: all four alive, pairs interleaved, order alternating
    impls = {n: build(n, args, topo) for pair in PAIRS for n in pair}
    for name in impls:
        impls[name].step(x, y, tokens)
    times = {n: [] for n in impls}
    for rep in range(args.reps):
        for pair in PAIRS:
            for name in pair if rep % 2 == 0 else pair[::-1]:
                t0 = _barrier_time()
                for _ in range(args.steps):
                    impls[name].step(x, y, tokens)
                times[name].append((_barrier_time() - t0) / args.steps)
    out["times"] = times
    del impls
    # every ZeRO stage's model state per rank against the formula
    for zero in (0, 1, 2, 3):
        impl = build(f"plait-zero{zero}", args, topo)
        impl.step(x, y, tokens)
        n = sum(p.numel() for _, p in impl.engine.named)
        measured = impl.engine.model_state_bytes()["total"]
        out["stages"][zero] = (measured, model_state_breakdown(n, dp=args.dp, zero=zero)["device"])
        impl.engine.close()
        del impl
    if args.overlap:
        out["overlap"] = overlap(args, topo, x, y, tokens)
    return out


def overlap(args, topo, x, y, tokens) -> dict:
    """What launching buckets from the backward hooks buys: the communication still
    exposed after the backward (``finish()``'s wait) and the step time, with and without.
    Without = an engine whose gradient hooks are removed, so ``finish()`` launches every
    bucket after the backward."""
    impls = {}
    for zero in (0, 2):
        for hooks in (True, False):
            a = argparse.Namespace(**{**vars(args), "bucket_mb": 4.0, "micro": 1})
            impl = build(f"plait-zero{zero}", a, topo)
            if not hooks:  # (ZeRO-2 launches every micro-batch's buckets from its hooks)
                impl.engine.grads.remove_hooks()
            impls[(zero, hooks)] = impl
    times = {k: [] for k in impls}
    waits = {k: [] for k in impls}
    for rep in range(args.reps):
        for k in list(impls) if rep % 2 == 0 else list(impls)[::-1]:
            model, engine = impls[k].model, impls[k].engine
            t0 = _barrier_time()
            for _ in range(args.steps):
                (model(x, y).sum() / tokens).backward()
                t1 = time.perf_counter()
                engine.finish()
                waits[k].append(time.perf_counter() - t1)
                engine.step(1e-3)
                engine.zero_grad()
            times[k].append((_barrier_time() - t0) / args.steps)
    return {k: (statistics.median(times[k]), statistics.median(waits[k])) for k in impls}


def run(args) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    from ranks import run_ranks  # the launch the multi-process benchmarks share

    return run_ranks("benchmark", _rank_worker, args.dp, (args,))


def _rank_worker(args) -> dict:
    return worker(dist.get_rank(), args)


def report(args, results: list[dict], wall: float) -> str:
    r0 = results[0]
    med = {n: statistics.median(t) for n, t in r0["times"].items()}
    losses = r0["loss1"]
    spread = max(losses.values()) - min(losses.values())
    mib = 2**20
    lines = [
        f"{args.dp} gloo processes x 1 thread, GPT {args.layers}x{args.hidden} vocab "
        f"{args.vocab}, {args.batch} x {args.seq_len} tokens a step, fp32, {args.micro} "
        f"micro-batch(es) per rank; {args.reps} reps x {args.steps} steps, medians; wall {wall:.0f} s. "
        f"Step-1 losses agree within {spread:.1e} ({losses['ddp']:.5f}).",
        "",
        "| plait | s/step | PyTorch | s/step | time ratio | peak MiB/rank plait | "
        "peak MiB/rank PyTorch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ours, theirs in PAIRS:
        peaks_ours = "/".join(f"{r['peak'][ours] / mib:.0f}" for r in results)
        peaks_theirs = "/".join(f"{r['peak'][theirs] / mib:.0f}" for r in results)
        lines.append(
            f"| {ours} | {med[ours]:.3f} | {theirs} | {med[theirs]:.3f} | "
            f"**{med[ours] / med[theirs]:.2f}** | {peaks_ours} | {peaks_theirs} |"
        )
    lines += [
        "",
        "plait model state per rank (parameters + gradients + AdamW) after a step:",
        "",
        "| --zero | measured MiB/rank | formula MiB/rank | measured / formula |",
        "| --- | --- | --- | --- |",
    ]
    for zero, (measured, formula) in sorted(r0["stages"].items()):
        lines.append(
            f"| {zero} | {measured / mib:.2f} | {formula / mib:.2f} | {measured / formula:.3f} |"
        )
    if "overlap" in r0:
        lines += [
            "",
            "Buckets of 4 MiB launched from the backward hooks (overlap) or all after it:",
            "",
            "| --zero | overlap | s/step | exposed communication (finish) ms |",
            "| --- | --- | --- | --- |",
        ]
        for (zero, hooks), (t, wait) in sorted(
            r0["overlap"].items(), key=lambda kv: (kv[0][0], not kv[0][1])
        ):
            lines.append(f"| {zero} | {'yes' if hooks else 'no'} | {t:.3f} | {wait * 1e3:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro", type=int, default=1,
                   help="micro-batches a step on each rank (gradient accumulation)")  # fmt: skip
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--overlap", action="store_true", help="also measure the backward overlap")
    p.add_argument("--write-results", action="store_true", help=f"append to {RESULTS}")
    args = p.parse_args(argv)
    if args.batch % args.dp:
        sys.exit(f"--batch {args.batch} must be divisible by --dp {args.dp}")
    t0 = time.time()
    text = report(args, run(args), time.time() - t0)
    print(text)
    if args.write_results:
        head = "" if RESULTS.exists() else "# Benchmarks\n\nplait beside PyTorch's own.\n"
        with RESULTS.open("a") as f:
            f.write(f"{head}\n## Data parallel / ZeRO\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
