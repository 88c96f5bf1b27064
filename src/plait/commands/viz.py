"""``plait viz WHAT ...``: drawings. Each WHAT is one entry of ``SUBCOMMANDS``.

To add one (e.g. ``plait viz loss``), write ``add_X(parser)`` and ``run_X(args) -> int``
and call ``register("X", add_X, run_X, "one-line help")`` at the bottom of this file;
nothing else changes. The drawing itself is in ``plait.viz``.

Errors a user can cause print one line, ``plait viz: error: ...``, to stderr and
return 2 (as ``plait simulate`` does).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from plait.commands.common import die

SUBCOMMANDS: dict[str, tuple[Callable, Callable, str]] = {}


def register(
    name: str,
    add: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    help: str,
) -> None:
    SUBCOMMANDS[name] = (add, run, help)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("viz", allow_abbrev=False, help="draw schedules, timelines and curves")
    add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="viz_command", metavar="WHAT", required=True)
    for name, (add, _, help) in SUBCOMMANDS.items():
        add(sub.add_parser(name, help=help, description=help, allow_abbrev=False))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    _, run_one, _ = SUBCOMMANDS[args.viz_command]
    return run_one(args)


def fail(message: str) -> int:
    return die("viz", message)


# -- plait viz schedule ---------------------------------------------------------------------


def add_schedule(p: argparse.ArgumentParser) -> None:
    from plait.layout import SCHEDULES

    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaving)")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument(
        "--p2p", type=float, default=0.0, help="transfer time per message, in units of F (0)"
    )
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="PNG, SVG or PDF")


def run_schedule(args: argparse.Namespace) -> int:
    """Draw a schedule with the textbook unit costs (F = 1, B = 2, BI = W = 1, per chunk
    divided by --vpp) and its bubble fraction against the closed form."""
    import math
    from functools import partial

    from plait.parallel.pipeline.schedules import (
        MICRO_BATCHES_HINT,
        ScheduleError,
        bubble_formula,
        build_schedule,
    )
    from plait.sim.pipeline import replay, unit_cost
    from plait.viz.timeline import draw_timeline

    p, v, m = args.pp, args.vpp, args.micro_batches
    for flag, value in (("--pp", p), ("--vpp", v), ("--micro-batches", m)):
        if value < 1:
            return fail(f"{flag} must be at least 1, got {value}")
    if not (args.p2p >= 0 and math.isfinite(args.p2p)):
        return fail(f"--p2p must be a number >= 0, got {args.p2p}")
    hop = args.p2p / max(v, 1)
    try:
        lists = build_schedule(args.schedule, num_ranks=p, num_microbatches=m, num_chunks=v)
        timeline = replay(lists, partial(unit_cost, num_chunks=v), p2p=hop)
        waits = {}  # a compute that waited: the last `hop` of its wait is a message in flight
        for rank, events in enumerate(timeline.events):
            clock = 0.0
            for a, s, e in events:
                if a.is_compute:
                    if s > clock:
                        waits.setdefault(rank, []).append((max(clock, s - hop), s))
                    clock = e
        title = (
            f"{args.schedule}: pp={p} vpp={v} micro-batches={m} - bubble "
            f"{timeline.bubble_fraction():.3f} (formula {bubble_formula(args.schedule, p, m, v):.3f})"
        )
        extras = {r: [("p2p", s, e) for s, e in spans] for r, spans in waits.items()}
        draw_timeline(timeline, args.out, title=title, extras=extras, unit="time units (F = 1)")
    except ScheduleError as e:  # in this command's flags
        return fail(str(e).replace(MICRO_BATCHES_HINT, " (--micro-batches)"))
    except ValueError as e:
        return fail(f"-o {e}")
    print(f"wrote {args.out}: {title}")
    return 0


register("schedule", add_schedule, run_schedule, "draw a pipeline schedule with unit costs")


# -- plait viz timeline ---------------------------------------------------------------------


def add_timeline(p: argparse.ArgumentParser) -> None:
    from plait.sim.hardware import BUILTIN

    p.add_argument("run", metavar="RUN", help="run folder of plait train --trace (--pp > 1)")
    p.add_argument("--step", type=int, default=None, help="recorded step (default: the last)")
    p.add_argument("--compare", action="store_true",
                   help="the simulator's timeline of the same layout below it")  # fmt: skip
    p.add_argument("--hardware", metavar="FILE", default=None,
                   help="hardware spec for --compare (e.g. from plait calibrate)")  # fmt: skip
    p.add_argument("--gpu", choices=list(BUILTIN), default=None,
                   help="built-in hardware for --compare (default cpu)")  # fmt: skip
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="PNG, SVG or PDF")


def run_timeline(args: argparse.Namespace) -> int:
    """Draw a recorded step per pipeline rank like ``viz schedule`` draws a schedule;
    ``--compare`` draws the simulated step of the same layout under it."""
    from plait.viz.recorded import recorded_step, simulated_step
    from plait.viz.timeline import draw_timelines

    try:
        timeline, extras, info = recorded_step(args.run, args.step)
        lay = info["layout"]
        what = f"pp={lay.pp} dp={lay.dp} tp={lay.tp} {lay.schedule}, {lay.num_microbatches} micro-batches"
        name = Path(args.run).resolve().name
        panels = [(timeline, extras, f"recorded step {info['step']} of {name}: {what} - "
                   f"{info['makespan_s'] * 1e3:.4g} ms, bubble {info['bubble']:.3f}")]  # fmt: skip
        if args.compare:
            from plait.sim.hardware import load_hardware

            hw = load_hardware(args.gpu or ("cpu" if not args.hardware else None), args.hardware)
            sim, sim_extras, sinfo = simulated_step(args.run, hw)
            panels.append((sim, sim_extras, f"simulated on {sinfo['hardware']}: "
                           f"{sinfo['iter_time_s'] * 1e3:.4g} ms per step, bubble "
                           f"{sinfo['bubble']:.3f}"))  # fmt: skip
        draw_timelines(panels, args.out, unit="ms")
    except ValueError as e:
        return fail(str(e))
    print(f"wrote {args.out}: " + "; ".join(t for _, _, t in panels))
    return 0


register("timeline", add_timeline, run_timeline, "draw a run's recorded pipeline step")
