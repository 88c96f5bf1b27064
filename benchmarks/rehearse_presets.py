"""Rehearsed against modelled memory for real model presets over common layouts (issue 25).

``rehearse_sweep.py`` holds the model to the rehearsal on a small llama, where transients
loom large; this runs the presets users train -- their real vocabularies, tied tables,
grouped-query heads, q/k norms -- at 2,048 tokens a micro-batch, bf16, rank 0 and a
pipeline's last, one layout at a time:

    PYTHONPATH=src python benchmarks/rehearse_presets.py                      # every pair
    PYTHONPATH=src python benchmarks/rehearse_presets.py --models llama3.2-1b --layouts z3,cp2z3

Prints one line per rank: the whole peak's ratio rehearsed / modelled and the rehearsed
peak, then every category whose ratio is beyond 5 % (a category read at the rehearsal's
peak can differ from the model's at its own moment; the totals are the check). A layout
plait refuses for a model (Mistral's sliding window under cp) gets one line saying why.
A few seconds a rank on a CPU (``plait rehearse``'s fake tensors); about six minutes in
all.
"""

from __future__ import annotations

import argparse
import tempfile
import time

MODELS = ("llama3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "gpt2-124m", "gpt3-1.3b", "mistral-7b",
          "qwen2.5-7b", "llama3-8b")  # fmt: skip
LAYOUTS = {
    "z1": {"dp": 8, "zero": 1, "global_batch_size": 16},
    "z2": {"dp": 8, "zero": 2, "global_batch_size": 16},
    "z3": {"dp": 8, "zero": 3, "global_batch_size": 16},
    "tp2sp": {"tp": 2, "dp": 4, "sequence_parallel": True, "global_batch_size": 8},
    "pp2": {"pp": 2, "dp": 4, "global_batch_size": 16},
    "cp2z3": {"cp": 2, "dp": 4, "zero": 3, "global_batch_size": 8},
    "zb": {"pp": 2, "dp": 2, "schedule": "zb-h1", "global_batch_size": 16},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=", ".join(LAYOUTS))
    args = ap.parse_args(argv)
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: no layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")

    from plait import rehearse
    from plait.commands.train import build_run_config

    for model in args.models.split(","):
        for name in args.layouts.split(","):
            with tempfile.TemporaryDirectory(prefix="plait-presets-") as out:
                values = {"model": model, "micro_batch_size": 1, "seq_len": 2048,
                          "dtype": "bf16", "out": out, **LAYOUTS[name]}  # fmt: skip
                try:
                    cfg = build_run_config(values)
                except ValueError as e:  # a layout plait refuses for this model
                    print(f"{model:13s} {name:6s} not run: {e}", flush=True)
                    continue
                for rank in rehearse.parse_ranks("0,LAST", cfg.layout):
                    t0 = time.perf_counter()
                    rows = rehearse.compared(rehearse.rehearse_rank(cfg, rank), cfg)["memory"]
                    got, _, ratio = rows["total"]
                    off = " ".join(f"{k} {v[2]:.3f}" for k, v in rows.items()
                                   if k != "total" and v[2] is not None and abs(v[2] - 1) > 0.05)  # fmt: skip
                    print(f"{model:13s} {name:6s} rank {rank:3d}: whole {ratio:.3f} of the model "
                          f"({got / 2**30:.2f} GiB rehearsed)  {off}  "
                          f"[{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
