"""``plait rehearse``: run one rank's real training program at full size on this CPU --
fake process group, fake tensors -- and hold what it allocates and sends against the
performance model.

    plait rehearse --model gpt3-175b --tp 8 --pp 16 --dp 8 --global-batch-size 1536 \\
        --micro-batch-size 1 --dtype bf16                  # ranks 0 and the last
    plait rehearse ... --ranks all-stages                  # one rank per pipeline stage
    plait rehearse ... --ranks 0,5,LAST --json             # one JSON object
    plait rehearse ... --full-steps                        # every micro-batch of a step

Communication: none on a wire (``plait.rehearse``: the fake process group completes every
call at once; each is logged). The flags are ``plait train``'s (the data flags are taken
and not read: the batches are synthetic) plus ``--ranks``, ``--full-steps`` and
``--json``; ``--dtype`` defaults to bf16, a GPU run's. Errors a user can cause print one
line and return 2.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from plait.cli_args import model_layout_parser
from plait.commands.common import UserError, die, merged_values

GiB = 2**30


def add_parser(sub) -> argparse.ArgumentParser:
    from plait.commands.train import add_train_arguments

    p = model_layout_parser(
        sub, "rehearse", config_help="YAML or TOML file of flag values (flags override it)",
        help="run one rank's real step at full size on fake tensors; compare with simulate",
        description="Build the trainer of the given ranks of the full layout on fake "
        "tensors under a fake process group, run two optimizer steps, save and load a "
        "checkpoint, and report peak memory by category, every collective, the "
        "checkpoint's bytes, and the performance model's figures.",
    )  # fmt: skip
    g = p.add_argument_group("rehearse")
    g.add_argument("--ranks", default="0,LAST", metavar="0,LAST|all-stages",
                   help="ranks to rehearse: a comma list of ranks and LAST, or all-stages "
                   "(one rank per pipeline stage; then the NCCL point-to-point check runs)")  # fmt: skip
    g.add_argument("--full-steps", action="store_true",
                   help="run every micro-batch of a step; by default a pipeline rank runs the "
                   "fewest whose schedule reaches the full step's states (the same peaks) and "
                   "counts the calls of the full step")  # fmt: skip
    g.add_argument("--moe-imbalance", type=float, metavar="G", default=None,
                   help="MoE: the most-loaded expert's assignments over the mean, routed on "
                   "the rehearsed rank's experts as plait simulate prices it (default 1.0, "
                   "balanced)")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_train_arguments(p)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from plait import rehearse
    from plait.commands.train import build_run_config

    try:
        values = merged_values(args, parser, run=True)
        if values.get("dtype") is None:
            values["dtype"] = "bf16"  # the run being sized is a GPU's
        cfg = build_run_config(values)
        ranks = rehearse.parse_ranks(args.ranks, cfg.layout)
        imbalance = args.moe_imbalance
        if imbalance is not None:
            from plait.sim.expert import check_imbalance

            if not cfg.model.moe:
                raise UserError("--moe-imbalance needs a mixture of experts (--moe-experts)")
            check_imbalance(cfg.model, imbalance)
    except (UserError, ValueError) as e:
        return die("rehearse", str(e).strip().splitlines()[0])
    say = None if args.json else (lambda line: print(f"plait rehearse: {line} ...", flush=True))
    if say:
        say(_header(cfg, values))
    reports = rehearse.rehearse(cfg, ranks, progress=say, full_steps=args.full_steps,
                                moe_imbalance=1.0 if imbalance is None else imbalance)  # fmt: skip
    p2p = rehearse.check_p2p(reports, cfg.layout)
    if args.json:
        out = {"layout": cfg.layout.to_dict(), "model": cfg.model.to_dict(), "p2p_check": p2p,
               "ranks": []}  # fmt: skip
        for r in reports:
            d = r.to_dict()
            d["simulated"] = _jsonable(rehearse.compared(r, cfg))
            out["ranks"].append(d)
        print(json.dumps(out, indent=1))
    else:
        for r in reports:
            print(report(r, rehearse.compared(r, cfg)))
        print(f"p2p check  {p2p}")
    return 0 if not p2p.startswith("FAILED") else 1


def _jsonable(c: dict) -> dict:
    return {part: {k: dict(zip(("rehearsed", "simulated", "ratio"), v)) for k, v in rows.items()}
            for part, rows in c.items()}  # fmt: skip


def _header(cfg, values) -> str:
    from plait.sim.costs import residual_note

    lay, m = cfg.layout, cfg.model
    return (
        f"{values.get('model') or 'tiny'} ({m.n_layers} x {m.hidden}, seq {m.seq_len}), "
        f"dp={lay.dp} tp={lay.tp} pp={lay.pp} vpp={lay.vpp} {lay.schedule} zero={lay.zero} "
        f"{lay.dtype}{residual_note(lay)}, {lay.num_microbatches} micro-batches of "
        f"{lay.micro_batch_size}, "
        f"{lay.world_size:,} ranks; fake process group and tensors"
    )


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.3f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def report(r, compared: dict) -> str:
    """One rank's table: peak memory per phase and category beside the model's (step 2's
    peak), counted bytes per axis beside the model's, the checkpoint's bytes and its peaks
    against training's, and the calls of a step."""
    times = ", ".join(f"{p.name} {p.seconds:.1f} s" for p in r.phases)
    ran = (f"ran {r.microbatches_run} of {r.microbatches} micro-batches a step (the same "
           f"states: --full-steps runs all); counts of the full step"
           if r.microbatches_run < r.microbatches
           else f"ran all {r.microbatches} micro-batches a step")  # fmt: skip
    if r.second_step != 1:  # ``volume.characteristic_step``: a --dp-algo's own step
        ran += (f"; step 2 is optimizer step {r.second_step + 1}, where the data-parallel "
                f"algorithm does its own work (a sync, a compressed or gossip step)")  # fmt: skip
    lines = [f"rank {r.rank} (pp {r.pp_rank}, dp {r.dp_rank}, cp {r.cp_rank}, tp {r.tp_rank}): "
             f"{times}", f"  {ran}",
             f"  {'memory (GiB) at the peak':26s}" + "".join(f"{p.name:>9s}" for p in r.phases)
             + f"{'simulated':>11s}{'ratio':>8s}"]  # fmt: skip
    for cat, (_, want, ratio) in compared["memory"].items():
        got = [p.peak if cat == "total" else p.split.get(cat, p.activations_peak)
               for p in r.phases]  # fmt: skip
        lines.append(f"  {cat:26s}" + "".join(f"{_gib(x):>9s}" for x in got)
                     + f"{_gib(want):>11s}{_ratio(ratio):>8s}")  # fmt: skip
    lines.append(f"  {'bytes per step (GiB)':26s}{'rehearsed':>9s}{'simulated':>11s}{'ratio':>8s}")
    for axis, (got, want, ratio) in compared["bytes"].items():
        lines.append(f"  {axis:26s}{_gib(got):>9s}{_gib(want):>11s}{_ratio(ratio):>8s}")
    train = r.training_peak()
    ratios = ", ".join(f"{p.name} / training peak {p.peak / train:.3f}" for p in r.phases
                       if p.name in ("save", "load"))  # fmt: skip
    lines.append(f"  checkpoint: {r.bytes_written / GiB:.3f} GiB written (at most: boxes other "
                 f"ranks hold too count here), {r.bytes_read / GiB:.3f} GiB read; {ratios}")  # fmt: skip
    calls = defaultdict(lambda: [0, 0])
    for c in r.step_calls:
        if c.op != "wait":
            calls[(c.axis, c.op, c.dtype)][0] += 1
            calls[(c.axis, c.op, c.dtype)][1] += c.nbytes
    lines.append("  calls per step: " + "; ".join(
        f"{axis} {n} x {op} {dtype} ({b / GiB:.3f} GiB)"
        for (axis, op, dtype), (n, b) in sorted(calls.items())))  # fmt: skip
    return "\n".join(lines)
