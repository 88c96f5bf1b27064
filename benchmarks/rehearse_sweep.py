"""Rehearsed against modelled memory over a matrix of small layouts (issue 25).

Each case is rehearsed (``plait rehearse``'s ``rehearse_rank``: the rank's real program
on fake tensors) at rank 0 and, for a pipeline, at its last rank, and held against the
performance model (``rehearse.compared``): the whole peak, the activations at their own
peak, the model-state categories, and every axis's bytes. A llama of hidden 2048 and 4
blocks at 2,048 tokens a micro-batch, bf16: big enough that activations and weights
are both tens of MiB a block, small enough to run in about a second a rank on a CPU.
Small models magnify transients a 7B or 70B model hides (a vocabulary of 4,096, four
blocks), so a ratio here is a lead to a difference, not a verdict on a real size: the
issue's layouts are ``plait rehearse``'s own rows in docs/performance-model.md.

    PYTHONPATH=src python benchmarks/rehearse_sweep.py            # every case
    PYTHONPATH=src python benchmarks/rehearse_sweep.py --only 0,3  # some

Prints one line per rank: the whole peak rehearsed vs modelled (MiB) and their ratio,
then the ratios of the activations' own peak and of the model-state categories, and
any axis whose bytes differ from the model's.
"""

from __future__ import annotations

import argparse
import tempfile

BASE = {"model": "tiny", "arch": "llama", "hidden": 2048, "heads": 16, "seq_len": 2048,
        "layers": 4, "micro_batch_size": 1, "dtype": "bf16"}  # fmt: skip
CASES = [
    {"dp": 2, "zero": 0, "global_batch_size": 4},
    {"dp": 2, "zero": 1, "global_batch_size": 4},
    {"dp": 2, "zero": 2, "global_batch_size": 4},
    {"dp": 2, "zero": 3, "global_batch_size": 4},
    {"dp": 2, "zero": 3, "global_batch_size": 2},
    {"tp": 2, "global_batch_size": 2},
    {"tp": 2, "sequence_parallel": True, "global_batch_size": 2},
    {"tp": 2, "sequence_parallel": True, "recompute": "selective", "global_batch_size": 2},
    {"tp": 2, "recompute": "full", "global_batch_size": 2},
    {"pp": 2, "global_batch_size": 8},
    {"pp": 2, "global_batch_size": 8, "recompute": "full"},
    {"pp": 2, "vpp": 2, "schedule": "interleaved-1f1b", "global_batch_size": 8, "layers": 8},
    {"pp": 2, "global_batch_size": 2, "schedule": "gpipe"},
    {"pp": 2, "global_batch_size": 8, "schedule": "zb-h1"},
    {"pp": 2, "tp": 2, "sequence_parallel": True, "global_batch_size": 8},
    {"pp": 2, "dp": 2, "zero": 1, "global_batch_size": 16},
    {"cp": 2, "global_batch_size": 1},
    {"dp": 2, "lora_rank": 16, "global_batch_size": 4},
    {"dp": 2, "zero": 3, "lora_rank": 16, "global_batch_size": 4},
    {"arch": "gpt2", "dp": 2, "zero": 1, "global_batch_size": 4},
    {"arch": "gpt2", "pp": 2, "global_batch_size": 8},
    {"dp": 2, "zero": 1, "dtype": "fp16", "global_batch_size": 4},
    {"dp": 2, "zero": 0, "dtype": "fp32", "global_batch_size": 4},
    {"dp": 2, "fp32_residual": True, "global_batch_size": 4},
    {"dp": 2, "zero": 1, "offload_optimizer": True, "global_batch_size": 4},
]


def run_case(i: int) -> list[str]:
    """The report lines of case ``i``: one per rehearsed rank."""
    from plait import rehearse
    from plait.commands.train import build_run_config

    kw = CASES[i]
    with tempfile.TemporaryDirectory(prefix="plait-sweep-") as out:
        cfg = build_run_config({**BASE, "out": out, **kw})
        lay = cfg.layout
        lines = []
        for rank in [0] if lay.pp == 1 else [0, lay.world_size - 1]:
            c = rehearse.compared(rehearse.rehearse_rank(cfg, rank), cfg)
            m = c["memory"]
            got, want, ratio = m["total"]
            act = m[rehearse.ACT_PEAK][2]
            state = " ".join(f"{k} {m[k][2]:.3f}" for k in ("parameters", "gradients",
                             "optimizer", "buffers") if m[k][2] is not None)  # fmt: skip
            other = m["other"]
            off = {a: round(v[2], 4) for a, v in c["bytes"].items()
                   if v[2] is not None and abs(v[2] - 1) > 1e-6}  # fmt: skip
            flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                             for k, v in kw.items())  # fmt: skip
            lines.append(f"{i:2d} rank {rank}: peak {got / 2**20:8.1f} vs {want / 2**20:8.1f} MiB"
                         f" ({ratio:.3f})  activations {act:.3f}  {state}  other {other[0] / 2**20:.0f}/{(other[1] or 0) / 2**20:.0f} MiB  bytes "
                         f"{off or 'equal'}  [{flags}]")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case numbers (default: all)")
    args = ap.parse_args()
    cases = [int(x) for x in args.only.split(",")] if args.only else range(len(CASES))
    for i in cases:
        for line in run_case(i):
            print(line, flush=True)


if __name__ == "__main__":
    main()
