"""How far is the planner's closed form from the replay that ``plait simulate`` prints?

    python benchmarks/closed_form.py          # a few seconds, pure computation
    python benchmarks/closed_form.py --rows   # and every layout

``plait plan`` ranks layouts on ``simulate(exact=False)`` (``schedules.pipeline_span`` plus
one fill of transfers) and replays only its winners, so a layout the closed form prices too
fast or too slow may crowd out, or never reach, the replay. This sweep simulates each layout
both ways: six models (1.3B to 405B) on their GPUs, pipelines of 2 to 16 ranks under every
schedule, selective and full recomputation, and prints closed / replayed - 1 by schedule,
in three settings:

- the GPUs' own fabric, layers cut evenly (``--pp-partition uniform``: the head makes the
  last rank the busiest);
- the same, cut by cost (``--pp-partition balanced``: the busiest rank is an early one);
- one GPU a node with 3 GB/s and 1 GB/s between nodes (Ethernet-class links), so every
  stage-to-stage message crosses the slow link.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from plait.layout import Layout
from plait.model.config import preset
from plait.sim import get_hardware, simulate
from plait.sim.hardware import Link

MODELS = (("gpt3-175b", "a100-80gb"), ("llama2-70b", "h100-sxm"), ("llama2-7b", "a100-80gb"),
          ("llama2-13b", "v100"), ("gpt3-1.3b", "a100-40gb"), ("llama3-405b", "h100-sxm"))  # fmt: skip
# tp, pp, schedule, vpp, micro-batch size, global batch size (dp 8)
LAYOUTS = (
    (8, 8, "1f1b", 1, 1, 512), (8, 16, "1f1b", 1, 1, 512), (8, 8, "interleaved-1f1b", 2, 1, 512),
    (4, 8, "1f1b", 1, 2, 256), (2, 8, "gpipe", 1, 1, 128), (8, 4, "zb-h1", 1, 1, 128),
    (1, 8, "1f1b", 1, 1, 64), (8, 16, "interleaved-1f1b", 2, 1, 256),
    (4, 4, "interleaved-1f1b", 4, 1, 64), (2, 2, "1f1b", 1, 4, 64), (1, 4, "zb-h1", 1, 2, 64),
    (4, 2, "gpipe", 1, 2, 32),
)  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def sweep(partition: str = "uniform", inter_node: float | None = None) -> list[tuple]:
    rows = []
    for name, gpu in MODELS:
        model, hw = preset(name), get_hardware(gpu)
        if inter_node is not None:  # one GPU a node: every pipeline message crosses the link
            hw = dataclasses.replace(hw, devices_per_node=1,
                                     inter_node=Link(bandwidth=inter_node, latency=2e-5))  # fmt: skip
        for tp, pp, schedule, vpp, mbs, gbs in LAYOUTS:
            if model.n_layers % (pp * vpp):
                continue
            if inter_node is not None:
                tp = 1  # tensor parallelism stays inside a node
            for recompute in ("selective", "full"):
                lay = Layout(tp=tp, pp=pp, dp=8, schedule=schedule, vpp=vpp, micro_batch_size=mbs,
                             global_batch_size=gbs, dtype="fp16" if gpu == "v100" else "bf16",
                             sequence_parallel=tp > 1, recompute=recompute,
                             pp_partition=partition)  # fmt: skip
                replayed = simulate(model, lay, hw).iter_time_s
                closed = simulate(model, lay, hw, exact=False).iter_time_s
                rows.append((closed / replayed - 1, name, gpu, lay))
    return rows


def report(title: str, rows: list[tuple], every: bool) -> None:
    print(f"{title}: closed form / replay - 1, step time, by schedule")
    if every:
        for err, name, gpu, lay in rows:
            print(f"  {name:12s} {gpu:10s} tp {lay.tp} pp {lay.pp:2d} {lay.schedule:16s} "
                  f"v {lay.vpp} m {lay.num_microbatches:3d} {lay.recompute:9s} {err:+7.2%}")  # fmt: skip
    for schedule in SCHEDULES:
        errs = [r[0] for r in rows if r[3].schedule == schedule]
        print(f"  {schedule:16s} {len(errs):3d} layouts  mean {statistics.mean(errs):+.2%}  "
              f"from {min(errs):+.2%} to {max(errs):+.2%}")  # fmt: skip
    worst = max(rows, key=lambda r: abs(r[0]))
    print(f"  all: {len(rows)} layouts, mean |error| "
          f"{statistics.mean(abs(r[0]) for r in rows):.2%}, worst {worst[0]:+.2%} ({worst[1]} "
          f"pp {worst[3].pp} {worst[3].schedule} m {worst[3].num_microbatches})")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every layout")
    args = ap.parse_args()
    t0 = time.perf_counter()
    report("fabric, uniform cut", sweep(), args.rows)
    report("fabric, balanced cut", sweep("balanced"), args.rows)
    report("3 GB/s between stages", sweep(inter_node=3e9), args.rows)
    report("1 GB/s between stages", sweep(inter_node=1e9), args.rows)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
