"""plait's pipeline executor against ``torch.distributed.pipelining``, side by side.

    python benchmarks/pipeline_parallel.py            # pp=2, about 2-3 minutes on 2 cores
    python benchmarks/pipeline_parallel.py --pp 4 --layers 8 --reps 3

Both run in the same gloo processes, on the same model chunks (plait's ``Transformer``
over the same layers, the same initial weights), the same micro-batches and the same
virtual-stage placement: GPipe, 1F1B and interleaved 1F1B (two chunks per rank) against
torch's ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B``; plait's
zb-h1 runs alone (torch has no single-chunk ZB-H1). A timed step is one forward and
backward over every micro-batch (no optimizer), between two barriers, so it is the
slowest rank's time; the two implementations alternate within each repetition and the
median is reported, with the ratio plait / torch (goal <= 1.0).

Peak memory per stage: the most bytes of tensors alive at once during one step, counting
every tensor an op creates (activations, gradients, message buffers) by its storage until
the storage is freed; parameters are not counted. Measured in a separate, untimed step.

Bubble: plait's measured fraction, 1 - compute time / step time on each rank, averaged
over ranks, beside the schedule's formula put in the same terms: ``bubble_formula`` gives
idle / compute = b, so idle / step = b / (1 + b) (e.g. 1F1B, p=2, m=8: 1/9 = 0.111).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from plait.layout import Layout
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.parallel.pipeline.executor import PipelineRunner
from plait.parallel.pipeline.schedules import bubble_formula
from plait.parallel.pipeline.stage import build_stage, stage_layers
from plait.topology import Topology

SCHEDULES = {  # plait name -> (vpp, torch schedule class name or None)
    "gpipe": (1, "ScheduleGPipe"),
    "1f1b": (1, "Schedule1F1B"),
    "interleaved-1f1b": (2, "ScheduleInterleaved1F1B"),
    "zb-h1": (1, None),
}


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created under this mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                key = s.data_ptr()
                if key and key not in self.live:
                    self.live[key] = (StorageWeakRef(s), s.nbytes())
                    self.current += s.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _model(args):
    return preset(
        "tiny",
        arch=args.arch,
        n_layers=args.layers,
        hidden=args.hidden,
        n_heads=args.heads,
        vocab_size=256,
        seq_len=args.seq_len,
    )


class _Plait:
    def __init__(self, args, schedule, topo, cfg):
        vpp = SCHEDULES[schedule][0]
        self.layout = Layout(
            pp=args.pp,
            vpp=vpp,
            schedule=schedule,
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.micro_batch_size * args.microbatches,
        )
        self.stage = build_stage(cfg, self.layout, topo=topo, seed=0)
        self.runner = PipelineRunner(
            self.stage,
            topo=topo,
            layout=self.layout,
            seq_len=cfg.seq_len,
            autocast=lambda: torch.autocast("cpu", enabled=False),
            trace_dir=f"{args.trace}/{schedule}" if args.trace else None,
        )
        self.bubbles: list[float] = []

    def step(self, batch, tokens):
        self.stage.zero_grad(set_to_none=True)
        loss = self.runner.train_step(
            list(batch.split(self.layout.micro_batch_size)), loss_scale=1.0, tokens_global=tokens
        )
        self.bubbles.append(self.runner.bubble_fraction)
        return loss


class _Torch:
    """The same chunks in torch.distributed.pipelining stages. The last chunk returns
    logits and the schedule's loss_fn computes the same summed cross-entropy."""

    def __init__(self, args, schedule, topo, cfg):
        from torch.distributed import pipelining

        vpp, cls_name = SCHEDULES[schedule]
        layout = Layout(pp=args.pp, vpp=vpp, schedule=schedule, global_batch_size=args.microbatches)
        parts = stage_layers(cfg, layout)
        n = layout.num_stages
        self.chunks, stages = [], []
        for c in range(vpp):
            s = c * args.pp + topo.pp_rank
            chunk = build_model(cfg, seed=0, layers=parts[s], pre=s == 0, post=s == n - 1)
            self.chunks.append(chunk)
            stages.append(pipelining.PipelineStage(chunk, s, n, torch.device("cpu")))
        self.tokens = 1
        self.first, self.last = (
            0 in [st.stage_index for st in stages],
            n - 1 in [st.stage_index for st in stages],
        )

        def loss_fn(logits, targets):
            flat = logits.flatten(0, 1).float()
            return F.cross_entropy(flat, targets.flatten(), reduction="sum") / self.tokens

        cls = getattr(pipelining, cls_name)
        self.schedule = cls(
            stages if vpp > 1 else stages[0], args.microbatches, loss_fn=loss_fn, scale_grads=False
        )

    def step(self, batch, tokens):
        for c in self.chunks:
            c.zero_grad(set_to_none=True)
        self.tokens = tokens
        losses = []
        inputs = (batch[:, :-1],) if self.first else ()
        target = batch[:, 1:] if self.last else None
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        return sum(t.item() for t in losses)


def _timed(impl, batch, tokens) -> tuple[float, float, float]:
    """(wall seconds between barriers, this rank's CPU seconds in the step, loss)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = impl.step(batch, tokens)
    c1 = time.process_time()
    dist.barrier()
    return time.perf_counter() - t0, c1 - c0, loss


def _peak_memory(impl, batch, tokens) -> int:
    dist.barrier()
    with PeakTensorMemory() as mem:
        impl.step(batch, tokens)
    dist.barrier()
    return mem.peak


def _worker(rank, world, port, args, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    topo = Topology.build(pp=args.pp, dp=1, tp=1)
    cfg = _model(args)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(
        0, 256, (args.micro_batch_size * args.microbatches, cfg.seq_len + 1), generator=g
    )
    tokens = batch[:, 1:].numel()
    impls = {}
    for schedule in args.schedules:
        torch_cls = SCHEDULES[schedule][1]
        impls[(schedule, "plait")] = _Plait(args, schedule, topo, cfg)
        if torch_cls:
            impls[(schedule, "torch")] = _Torch(args, schedule, topo, cfg)
    times = {k: [] for k in impls}
    cpu = {k: [] for k in impls}
    losses = {}
    for k, impl in impls.items():  # warm-up (torch infers shapes on its first step)
        for _ in range(args.warmup):
            _, _, losses[k] = _timed(impl, batch, tokens)
    for rep in range(args.reps):
        order = list(impls) if rep % 2 == 0 else list(reversed(impls))
        for k in order:
            wall, cpu_s, _ = _timed(impls[k], batch, tokens)
            times[k].append(wall)
            cpu[k].append(cpu_s)
    memory = {k: _peak_memory(impl, batch, tokens) for k, impl in impls.items()}
    bubbles = {
        k[0]: statistics.mean(impl.bubbles[args.warmup :])
        for k, impl in impls.items()
        if k[1] == "plait"
    }
    out = [None] * world
    dist.all_gather_object(out, (times, memory, bubbles, losses, cpu))
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _mem(per_rank, schedule, impl) -> str:
    return " / ".join(f"{r[1][(schedule, impl)] / 2**20:.1f}" for r in per_rank)


def _report(args, per_rank) -> str:
    times = per_rank[0][0]  # wall times between barriers: the same on every rank
    p, m = args.pp, args.microbatches
    lines = [
        f"pp={p}, {m} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, "
        f"{args.arch} {args.layers} layers x {args.hidden} hidden, gloo on CPU (1 thread per "
        f"process), {args.reps} interleaved repetitions",
        "",
        "| schedule | plait s/step median (best) | torch s/step median (best) "
        "| plait / torch median (best) | CPU s/step, all ranks, plait / torch "
        "| peak MiB per stage plait | torch | bubble measured | bubble formula |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cpu_s(key):  # per step, summed over ranks
        return statistics.median(map(sum, zip(*(r[4][key] for r in per_rank))))

    for schedule in args.schedules:
        vpp, torch_cls = SCHEDULES[schedule]
        pm, pb = statistics.median(times[(schedule, "plait")]), min(times[(schedule, "plait")])
        row = [schedule + (f" (vpp {vpp})" if vpp > 1 else ""), f"{pm:.3f} ({pb:.3f})"]
        if torch_cls:
            tm, tb = statistics.median(times[(schedule, "torch")]), min(times[(schedule, "torch")])
            cpu = f"{cpu_s((schedule, 'plait')):.2f} / {cpu_s((schedule, 'torch')):.2f}"
            row += [f"{tm:.3f} ({tb:.3f})", f"**{pm / tm:.2f}** ({pb / tb:.2f})", cpu]
        else:
            row += ["-", "-", f"{cpu_s((schedule, 'plait')):.2f} / -"]
        b = bubble_formula(schedule, p, m, vpp)
        row += [
            _mem(per_rank, schedule, "plait"),
            _mem(per_rank, schedule, "torch") if torch_cls else "-",
            f"{statistics.mean(r[2][schedule] for r in per_rank):.3f}",
            f"{b / (1 + b):.3f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    last = per_rank[-1][3]
    diffs = [
        abs(last[(s, "plait")] - last[(s, "torch")]) for s in args.schedules if SCHEDULES[s][1]
    ]
    lines += [
        "",
        f"loss agreement plait vs torch (last stage): max |diff| = {max(diffs, default=0.0):.2e}",
        "wall min-max per step: "
        + ", ".join(f"{s} {i} {min(v):.2f}-{max(v):.2f}" for (s, i), v in times.items()),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--arch", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    ap.add_argument("--trace", help="folder for plait's traces: DIR/<schedule>/rank-K.json")
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.time()
    procs = [
        ctx.Process(target=_worker, args=(r, args.pp, port, args, queue)) for r in range(args.pp)
    ]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=1800)
    for proc in procs:
        proc.join(60)
    print(_report(args, result))
    print(
        f"\n(total {time.time() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
