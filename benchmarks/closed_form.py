"""How far is the planner's closed form from the replay that ``plait simulate`` prints?

    python benchmarks/closed_form.py          # under a second, pure computation
    python benchmarks/closed_form.py --rows   # and every layout

``plait plan`` ranks layouts on ``simulate(exact=False)`` (``schedules.pipeline_span`` plus
one fill of transfers) and replays only its winners, so a layout the closed form prices too
slow may never reach the replay. This sweep simulates each layout both ways: five models
(1.3B to 405B) on their GPUs, pipelines of 2 to 16 ranks under every schedule, selective
and full recomputation, and prints closed / replayed - 1 by schedule. The stages are what
the runtime cuts (uniform layers; the head on the last stage), so the ranks are uneven.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from plait.layout import Layout
from plait.model.config import preset
from plait.sim import get_hardware, simulate

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every layout")
    args = ap.parse_args()
    t0, rows = time.perf_counter(), []
    for name, gpu in MODELS:
        model, hw = preset(name), get_hardware(gpu)
        for tp, pp, schedule, vpp, mbs, gbs in LAYOUTS:
            if model.n_layers % (pp * vpp):
                continue
            for recompute in ("selective", "full"):
                lay = Layout(tp=tp, pp=pp, dp=8, schedule=schedule, vpp=vpp, micro_batch_size=mbs,
                             global_batch_size=gbs, dtype="fp16" if gpu == "v100" else "bf16",
                             sequence_parallel=tp > 1, recompute=recompute)  # fmt: skip
                replayed = simulate(model, lay, hw).iter_time_s
                closed = simulate(model, lay, hw, exact=False).iter_time_s
                rows.append((closed / replayed - 1, name, gpu, lay))
    if args.rows:
        for err, name, gpu, lay in rows:
            print(f"{name:12s} {gpu:10s} tp {lay.tp} pp {lay.pp:2d} {lay.schedule:16s} "
                  f"v {lay.vpp} m {lay.num_microbatches:3d} {lay.recompute:9s} {err:+7.2%}")  # fmt: skip
    print("closed form / replay - 1, step time, by schedule:")
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        errs = [r[0] for r in rows if r[3].schedule == schedule]
        print(f"  {schedule:16s} {len(errs):3d} layouts  mean {statistics.mean(errs):+.2%}  "
              f"from {min(errs):+.2%} to {max(errs):+.2%}")  # fmt: skip
    worst = max(rows, key=lambda r: abs(r[0]))
    print(f"all: {len(rows)} layouts, mean |error| {statistics.mean(abs(r[0]) for r in rows):.2%}, "
          f"worst {worst[0]:+.2%} ({worst[1]} pp {worst[3].pp} {worst[3].schedule} "
          f"m {worst[3].num_microbatches}); {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
