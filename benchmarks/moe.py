"""Mixture of experts with expert parallelism (issue 28): step time, peak memory and the
model state per rank of an 8-expert top-2 model at ep 1 / 2 / 4, against the dense model of
the same active size, in real gloo processes through the trainer.

    python benchmarks/moe.py                  # ~3-5 minutes on 2 shared cores
    python benchmarks/moe.py --ranks 1,2,4 --steps 3

Models (LLaMA-style, 2 layers x 256 hidden, 4 heads, byte vocabulary, sequences of 256,
fp32): the MoE one has 8 experts of FFN width 256 in every block, each token going to 2
(``--moe-experts 8 --moe-top-k 2 --moe-ffn-hidden 256``, dropless, aux loss 0.01); the
dense one an FFN of width 512, the two active experts' worth, so both do the same FLOPs a
token outside the router. Each row runs n gloo processes (one thread each) at dp n, one
sequence a rank and step (global batch n): dense, MoE with every expert on every rank
(ep 1) and MoE at ep n. Per rank, after building the trainer and one warm-up step:

- step: the mean wall time of ``--steps`` steps, the slowest rank's;
- peak: the growth of the process's peak resident set over what it held before those
  steps (``benchmarks/data_parallel.py``'s ``PeakRSS``), the largest rank's: activations,
  gradients, the dispatch's buffers;
- state: the model state the rank holds (parameters + gradients + AdamW), the trainer's
  ``model_state_bytes``: what ep divides;
- a2a: bytes the rank counted in all-to-alls per step (``comm.py``'s convention: the
  counts and the rows it sends, forward and backward).

The n ranks time-share the 2 cores, so step times at n > 1 include that contention; compare
rows of the same n.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch.distributed as dist
from data_parallel import PeakRSS  # the peak resident set of a block (benchmarks/)
from ranks import bench_run, run_ranks  # n gloo ranks of one thread each (benchmarks/)

BASE = dict(arch="llama", n_layers=2, hidden=256, n_heads=4, n_kv_heads=4, vocab_size=256,
            seq_len=256)  # fmt: skip
MOE = dict(moe_experts=8, moe_top_k=2, moe_ffn_hidden=256, moe_aux_loss_coef=0.01)
DENSE = dict(ffn_hidden=512)


def run_config(kind: str, n: int, ep: int, steps: int):
    from plait.layout import Layout
    from plait.model.config import ModelConfig

    model = ModelConfig(**BASE, **(MOE if kind == "moe" else DENSE))
    lay = Layout(dp=n, ep=ep, global_batch_size=n, micro_batch_size=1)
    return bench_run(model, lay, steps, "moe-bench-")


def worker(kind: str, n: int, ep: int, steps: int) -> dict:
    from plait.data import prepare
    from plait.topology import Topology
    from plait.train.loop import Trainer

    cfg = run_config(kind, n, ep, steps)
    prepare(cfg.data)
    topo = Topology.build(pp=1, dp=n, tp=1)
    trainer = Trainer(cfg, topo=topo)
    rec = trainer.step(0)  # warm-up: gradients and optimizer state exist from here on
    if dist.is_initialized():
        dist.barrier()
    a2a0 = sum(b for (_, op), b in topo.stats.bytes.items() if op == "all_to_all")
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            rec = trainer.step(step)
        seconds = (time.perf_counter() - t0) / steps
    a2a = sum(b for (_, op), b in topo.stats.bytes.items() if op == "all_to_all") - a2a0
    return {"step_s": seconds, "peak": peak.peak, "state": rec["model_state_bytes"],
            "a2a": a2a / steps, "loss": rec["loss"]}  # fmt: skip


def measure(kind: str, n: int, ep: int, steps: int) -> dict:
    """The slowest rank's step and the largest rank's peak, state and a2a over n ranks."""
    out = run_ranks("moe", worker, n, (kind, n, ep, steps))
    return {k: max(r[k] for r in out) for k in ("step_s", "peak", "state", "a2a")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,4", help="process counts (dp; ep runs at each)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"# {datetime.date.today()}  python benchmarks/moe.py --ranks {args.ranks} "
          f"--steps {args.steps}")  # fmt: skip
    print(f"{'model':<22} {'ranks':>5} {'step s':>8} {'peak MiB':>9} {'state MiB':>10} "
          f"{'a2a MiB/step':>13}")  # fmt: skip
    mib = 2**20
    for n in (int(x) for x in args.ranks.split(",")):
        rows = [("dense (ffn 512)", "dense", 1), ("moe 8x top-2, ep 1", "moe", 1)]
        if n > 1:
            rows.append((f"moe 8x top-2, ep {n}", "moe", n))
        for label, kind, ep in rows:
            m = measure(kind, n, ep, args.steps)
            print(f"{label:<22} {n:>5} {m['step_s']:>8.3f} {m['peak'] / mib:>9.1f} "
                  f"{m['state'] / mib:>10.2f} {m['a2a'] / mib:>13.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
