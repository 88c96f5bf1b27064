"""plait ``--tp 2`` against PyTorch's own tensor parallelism, same model, same batch, same run.

    python benchmarks/tensor_parallel.py                 # ~1-2 minutes on 2 CPU cores
    python benchmarks/tensor_parallel.py --steps 1 --reps 4 --write-results

Two gloo processes hold both implementations of the same GPT (default: the ``small``
preset, 6 layers x 256 hidden, vocabulary 8,192, 8 sequences of 256 tokens = 2,048 tokens a
step, fp32) built from the same initial weights:

- plait: ``build_model(..., topo=tp 2)`` -- Megatron layers, vocabulary-parallel embedding
  and cross-entropy (tied head), ``TPGradSync``;
- PyTorch: the same network written with plain ``nn.Linear`` / ``nn.Embedding`` /
  ``nn.LayerNorm`` and parallelised with ``torch.distributed.tensor.parallel``:
  ``ColwiseParallel`` on q, k, v and the first MLP GEMM, ``RowwiseParallel`` on the output
  projections and (vocabulary-split) on the token embedding, the tied head as a DTensor
  matmul whose vocabulary-sharded logits go through ``loss_parallel``.

A step is forward + backward + AdamW for both. The two alternate in blocks of ``--steps``
steps, ``--reps`` times (runs here vary by 10-20%); the figures are medians of the
per-step times (a barrier closes each step). Peak memory per rank is measured in one
extra, untimed step under ``torch.distributed._tools.mem_tracker.MemTracker`` (live tensor
bytes: parameters, gradients, optimizer state, activations, temporaries), so the two
numbers are comparable even though they share a process. Step-1 losses of the two are
checked to agree (same model, same batch).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).with_name("RESULTS.md")


# --- the same GPT in plain torch.nn -----------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, C / tp) each after ColwiseParallel
        heads = q.shape[-1] // self.head_dim  # the heads on this rank
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, h: int, heads: int, f: int, eps: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.attn, self.mlp = Attention(h, heads), MLP(h, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, h: int, seq_len: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, h), nn.Embedding(seq_len, h)


class TorchGPT(nn.Module):
    """plait's gpt2 flavour with the same parameter names, so weights copy across by name."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden
        self.embed = Embed(cfg.vocab_size, h, cfg.seq_len)
        self.blocks = nn.ModuleDict(
            {
                str(i): Block(h, cfg.n_heads, cfg.ffn_hidden, cfg.norm_eps)
                for i in range(cfg.n_layers)
            }
        )
        self.norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.mesh = None

    def forward(self, ids, targets):
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import loss_parallel

        x = self.embed.tokens(ids) + self.embed.positions(torch.arange(ids.shape[1]))
        for block in self.blocks.values():
            x = block(x)
        x = DTensor.from_local(self.norm(x), self.mesh, [Replicate()])
        logits = F.linear(x, self.embed.tokens.weight)  # tied head: vocabulary-sharded logits
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_tp(cfg, plait_single, mesh) -> TorchGPT:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = TorchGPT(cfg)
    model.load_state_dict(plait_single.state_dict())
    model.mesh = mesh
    plan = {"embed.tokens": RowwiseParallel(input_layouts=Replicate())}
    for i in model.blocks:
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.proj"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


# --- one worker ---------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        result = ("ok", _bench(rank, world, args))
    except Exception:  # noqa: BLE001 - shipped to the parent, which prints it
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    os._exit(0)  # skip interpreter teardown: gloo can abort there


def _bench(rank: int, world: int, args) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from plait.model.config import preset
    from plait.model.transformer import build_model
    from plait.parallel.tensor import TPGradSync
    from plait.topology import Topology

    cfg = preset(args.model, arch="gpt2")
    topo = Topology.build(pp=1, dp=1, tp=world)
    mesh = init_device_mesh("cpu", (world,))

    plait_model = build_model(cfg, seed=0, topo=topo)
    tp_sync = TPGradSync(list(plait_model.parameters()), topo=topo)
    torch_model = torch_tp(cfg, build_model(cfg, seed=0), mesh)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)

    # torch: the parameters no plan touches (norms, positions) stay plain tensors, and one
    # foreach kernel cannot mix them with DTensors: two optimizers, the same maths
    dtensor = [isinstance(p, DTensor) for p in torch_model.parameters()]
    params = list(torch_model.parameters())
    opts = {
        "plait": [adamw(plait_model.parameters())],
        "torch": [
            adamw([p for p, d in zip(params, dtensor) if d]),
            adamw([p for p, d in zip(params, dtensor) if not d]),
        ],
    }
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g)
        for _ in range(4)
    ]

    def step(impl: str, i: int) -> float:
        ids = batches[i % len(batches)]
        if impl == "plait":
            loss = plait_model(ids[:, :-1], ids[:, 1:]).mean()
            loss.backward()
            tp_sync.finish()
        else:
            from torch.distributed.tensor.parallel import loss_parallel

            loss = torch_model(ids[:, :-1], ids[:, 1:])
            with loss_parallel():
                loss.backward()
            loss = loss.full_tensor()
        for opt in opts[impl]:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    first = {impl: step(impl, 0) for impl in ("plait", "torch")}  # also the warm-up
    times = {"plait": [], "torch": []}
    cpu = {"plait": [], "torch": []}  # this process's CPU seconds: less sensitive to other jobs
    order = ("plait", "torch")
    for rep in range(args.reps):
        for impl in order if rep % 2 == 0 else order[::-1]:
            for i in range(args.steps):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step(impl, i + 1)
                dist.barrier()
                times[impl].append(time.perf_counter() - t0)
                cpu[impl].append(time.process_time() - c0)

    peak = {}
    for impl, model in (("plait", plait_model), ("torch", torch_model)):
        tracker = MemTracker()
        tracker.track_external(model, *opts[impl])
        with tracker:
            step(impl, 0)
        peak[impl] = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return {"first_loss": first, "times": times, "cpu": cpu, "peak_bytes": peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="plait preset, built in the gpt2 flavour")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=1, help="timed steps per block")
    p.add_argument("--reps", type=int, default=12, help="blocks per implementation")
    p.add_argument("--write-results", action="store_true", help=f"append to {RESULTS.name}")
    args = p.parse_args(argv)

    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]  # other jobs on the machine slow both sides alike
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, args, out_dir)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        results = {}
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pt")
            if not os.path.exists(path):
                print(f"worker {r} died (exit code {procs[r].exitcode})", file=sys.stderr)
                return 1
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                print(f"worker {r} failed:\n{value}", file=sys.stderr)
                return 1
            results[r] = value
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]

    r0 = results[0]
    loss_p, loss_t = r0["first_loss"]["plait"], r0["first_loss"]["torch"]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    spread = {k: (min(v), max(v)) for k, v in r0["times"].items()}
    ratio = med["plait"] / med["torch"]
    cpu = {k: statistics.median(x for r in results for x in results[r]["cpu"][k]) for k in med}
    peaks = {k: max(results[r]["peak_bytes"][k] for r in results) for k in med}
    from plait.model.config import preset

    cfg = preset(args.model, arch="gpt2")
    tokens = args.batch * cfg.seq_len
    n = len(r0["times"]["plait"])
    lines = [
        f"model {args.model} (gpt2: {cfg.n_layers} x {cfg.hidden}, vocab {cfg.vocab_size}), "
        f"{tokens:,} tokens a step, fp32, 2 processes (gloo, 1 thread each), "
        f"{n} timed steps each (interleaved blocks of {args.steps}), {wall:.0f} s wall, "
        f"load average {load_start:.1f} -> {load:.1f} on {os.cpu_count()} cores",
        "",
        "| implementation | median step (s) | min-max (s) | CPU s / step / rank | "
        "peak memory / rank (MiB) |",
        "|---|---|---|---|---|",
        f"| plait --tp 2 | {med['plait']:.3f} | {spread['plait'][0]:.3f}-{spread['plait'][1]:.3f} "
        f"| {cpu['plait']:.3f} | {peaks['plait'] / 2**20:.1f} |",
        f"| torch.distributed.tensor.parallel | {med['torch']:.3f} | "
        f"{spread['torch'][0]:.3f}-{spread['torch'][1]:.3f} | {cpu['torch']:.3f} "
        f"| {peaks['torch'] / 2**20:.1f} |",
        "",
        f"step-time ratio plait / torch: **{ratio:.2f}** (goal <= 1.0), CPU-time ratio "
        f"{cpu['plait'] / cpu['torch']:.2f}; "
        f"memory ratio {peaks['plait'] / peaks['torch']:.2f}; step-1 loss plait {loss_p:.6f}, "
        f"torch {loss_t:.6f} (relative difference {abs(loss_p - loss_t) / abs(loss_t):.1e}). "
        "Peak memory: live tensor bytes (parameters, gradients, AdamW state, activations) "
        "under MemTracker in one untimed step, the larger of the two ranks.",
    ]
    print("\n".join(lines))
    if abs(loss_p - loss_t) > 1e-5 * abs(loss_t):
        print("the two implementations disagree on the step-1 loss", file=sys.stderr)
        return 1
    if args.write_results:
        _append_results(lines, argv if argv is not None else sys.argv[1:])
    return 0


def _append_results(lines: list[str], argv: list[str]) -> None:
    """Append (or replace) this benchmark's section of RESULTS.md, leaving others' alone."""
    header = "# Benchmarks\n\nSide-by-side comparisons with PyTorch's own implementations.\n"
    text = RESULTS.read_text() if RESULTS.exists() else header
    start = text.find("\n## Tensor parallel\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + (text[end:] if end >= 0 else "\n")
    cmd = " ".join(["python benchmarks/tensor_parallel.py", *argv])
    stamp = time.strftime("%Y-%m-%d")
    section = ["", "## Tensor parallel", "", f"`{cmd}` ({stamp})", "", *lines, ""]
    RESULTS.write_text(text.rstrip("\n") + "\n" + "\n".join(section))


if __name__ == "__main__":
    sys.exit(main())
