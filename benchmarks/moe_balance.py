"""Mixture-of-experts load balancing (issue 28, "Measured"): does auxiliary-loss-free
balancing (DeepSeek-V3's expert bias, ``--moe-bias-rate``) narrow the max / mean expert
load against no balancing and against the Switch aux loss, at what cost in loss; and is
the aux loss the same value at ep 1 / 2 / 4. Real runs of ``plait train``, read back from
their ``metrics.jsonl``.

    python benchmarks/moe_balance.py                    # ~40 minutes on 2 busy shared cores
    python benchmarks/moe_balance.py --steps 60 --rates 0.001 --ep-steps 2   # a smoke run

Model: the ``tiny`` preset (GPT-2 block, 4 layers x 128 hidden, 4 heads, sequences of
128, the default corpus and BPE vocabulary) with 8 experts of FFN width 512 in every block,
each token going to 2 (``--moe-experts 8 --moe-top-k 2``, softmax router, dropless); the
default batch: one micro-batch of 16 sequences (2,048 tokens) a step.

1. Balancing, one process, ``--steps`` (200) steps, the same data order in every run:
   none (``--moe-aux-loss-coef 0``), the Switch aux loss alone (0.01, the default), and
   the expert bias alone at each of ``--rates`` (aux coef 0). DeepSeek-V3 updates its bias
   by 0.001 a step over some 10^5 steps; here a bias can move at most 200 R in the whole
   run, against softmax scores of 1 / E = 0.125 on average, so the paper's rate is shown
   beside one ten times larger. Per run: ``moe_imbalance`` (max / mean assignments per
   expert, the worst layer) as the mean of the first 20 steps and of the last 50, the
   least-loaded expert's share of the mean over the last 50 (``moe_tokens_min`` /
   ``moe_tokens_mean``, worst layer: 0 is an expert that gets no token), the mean training
   loss of the last 20 steps, the final validation loss, and the mean step time.
2. Layouts: ``--ep-steps`` steps at dp 4 with ep 1 / 2 / 4 (4 gloo processes, micro-
   batches of 4 sequences), and one process with the same 4 micro-batches (dp 1,
   ``--micro-batch-size 4``) as the reference: ``moe_aux_loss`` per step (the Switch loss
   E sum_e f_e P_e without its coefficient, the mean over layers and micro-batches),
   side by side with the largest difference from the reference. The aux loss (0.01) and
   the expert bias (0.001) both train in these runs, so the bias's load all-reduce over
   dp is on the path too.

The runs time-share the 2 cores with each other (``--jobs`` balancing runs at a time) and
whatever else runs, so step times are rough; the losses and loads do not depend on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = ["--model", "tiny", "--moe-experts", "8", "--moe-top-k", "2"]


def train(out: Path, flags: list[str], *, steps: int) -> list[dict]:
    """Run ``plait train`` with ``flags`` into ``out``; its metrics.jsonl records."""
    cmd = [sys.executable, "-m", "plait.cli", "train", *MODEL, *flags, "--steps", str(steps),
           "--eval-every", "0", "--no-progress", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"moe_balance: {' '.join(cmd)} failed ({proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")  # fmt: skip
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def balancing(root: Path, steps: int, rates: list[float], jobs: int) -> None:
    runs = [("none", ["--moe-aux-loss-coef", "0"]),
            ("switch aux 0.01", ["--moe-aux-loss-coef", "0.01"])]  # fmt: skip
    runs += [(f"bias {r:g}", ["--moe-aux-loss-coef", "0", "--moe-bias-rate", f"{r:g}"])
             for r in rates]  # fmt: skip
    head, tail = min(20, steps), min(50, steps)
    print(f"\n## 1. Balancing: {steps} steps, one process")
    print(f"{'balancing':<17} {'imb first ' + str(head):>13} {'imb last ' + str(tail):>12} "
          f"{'min/mean last ' + str(tail):>17} {'loss last 20':>13} {'val loss':>9} "
          f"{'step s':>7}")  # fmt: skip
    with ThreadPoolExecutor(jobs) as pool:  # runs side by side: each is one process
        done = pool.map(lambda run: train(root / run[0].replace(" ", "-"), run[1], steps=steps),
                        runs)  # fmt: skip
    for (label, _), recs in zip(runs, done):
        train_recs = [r for r in recs if "moe_imbalance" in r]
        last = train_recs[-tail:]
        val = [r["val_loss"] for r in recs if "val_loss" in r]
        print(f"{label:<17} {mean(r['moe_imbalance'] for r in train_recs[:head]):>13.3f} "
              f"{mean(r['moe_imbalance'] for r in last):>12.3f} "
              f"{mean(r['moe_tokens_min'] / r['moe_tokens_mean'] for r in last):>17.3f} "
              f"{mean(r['loss'] for r in train_recs[-20:]):>13.4f} "
              f"{val[-1] if val else float('nan'):>9.4f} "
              f"{mean(r['step_time_s'] for r in train_recs[1:]):>7.2f}", flush=True)  # fmt: skip


def layouts(root: Path, steps: int) -> None:
    common = ["--global-batch-size", "16", "--micro-batch-size", "4",
              "--moe-aux-loss-coef", "0.01", "--moe-bias-rate", "0.001"]  # fmt: skip
    runs = [("dp 1 (reference)", ["--dp", "1"])]
    runs += [(f"dp 4, ep {n}", ["--dp", "4", "--ep", str(n)]) for n in (1, 2, 4)]
    print(f"\n## 2. moe_aux_loss per step at each layout ({steps} steps)")
    print(f"{'layout':<17} " + " ".join(f"{'step ' + str(s):>13}" for s in range(1, steps + 1))
          + f" {'max |diff|':>11}")  # fmt: skip
    ref, worst = None, 0.0
    for label, flags in runs:
        recs = [r for r in train(root / label.split(" (")[0].replace(" ", "").replace(",", "-"),
                                 common + flags, steps=steps) if "moe_aux_loss" in r]  # fmt: skip
        aux = [r["moe_aux_loss"] for r in recs]
        ref = aux if ref is None else ref
        diff = max(abs(a - b) for a, b in zip(aux, ref))
        worst = max(worst, diff)
        print(f"{label:<17} " + " ".join(f"{a:>13.9f}" for a in aux) + f" {diff:>11.2e}",
              flush=True)  # fmt: skip
    print(f"largest difference from one process over every layout and step: {worst:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of each balancing run")
    ap.add_argument("--rates", default="0.001,0.01", help="expert-bias rates to run")
    ap.add_argument("--ep-steps", type=int, default=5, help="steps of each layout run (0: skip)")
    ap.add_argument("--jobs", type=int, default=2, help="balancing runs at a time")
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        ap.error(f"--rates {args.rates!r}: give comma-separated numbers, e.g. 0.001,0.01")
    if args.steps < 1 or args.jobs < 1 or args.ep_steps < 0 or any(r <= 0 for r in rates):
        ap.error("--steps and --jobs must be >= 1, --ep-steps >= 0 and every --rates value > 0")
    print(f"# {datetime.date.today()}  python benchmarks/moe_balance.py --steps {args.steps} "
          f"--rates {args.rates} --ep-steps {args.ep_steps} --jobs {args.jobs}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as d:
        balancing(Path(d), args.steps, rates, args.jobs)
        if args.ep_steps:
            layouts(Path(d), args.ep_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
