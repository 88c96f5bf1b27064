"""What a run recorded, as the drawings want it: one pipeline step from the traces
(``plait train --trace``, ``OUT/traces/rank-K.json``) as a ``nccl_p2p.Timeline``, and the
simulator's timeline of the same model and layout to put beside it.

    timeline, extras, info = recorded_step(run)              # the last recorded step
    sim, sim_extras, sim_info = simulated_step(run, hardware)  # plait simulate's

A recorded step holds one row per pipeline rank, read from the ranks with dp and tp
coordinates 0 (their replicas run the same schedule). The executor's waits for messages
are drawn as time spent waiting on a message ("p2p"), as the simulator draws a transfer
still in flight.
"""

from __future__ import annotations

from pathlib import Path

from plait.nccl_p2p import Timeline
from plait.topology import rank_of
from plait.viz.trace import read_trace, timeline_from_traces


def run_config(run: Path):
    from plait.train.config import RunConfig

    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run}: no config.yaml there; pass a folder made by plait train")
    return RunConfig.load(path)


def trace_files(run: Path) -> list[Path]:
    """The traces of pipeline ranks 0 .. pp-1 (dp and tp coordinates 0), or [] if none."""
    cfg = run_config(run)
    lay = cfg.layout
    paths = [
        Path(run)
        / "traces"
        / f"rank-{rank_of(pp_rank=r, dp_rank=0, tp_rank=0, dp=lay.dp, tp=lay.tp)}.json"
        for r in range(lay.pp)
    ]
    return paths if all(p.is_file() for p in paths) else []


def recorded_step(run: Path, step: int | None = None) -> tuple[Timeline, dict, dict]:
    """(timeline in seconds, extras, info) of ``step`` (default: the last recorded)."""
    paths = trace_files(run)
    if not paths:
        raise ValueError(
            f"{run}: no pipeline traces (OUT/traces/rank-K.json); they are recorded by "
            "plait train --trace with --pp > 1"
        )
    steps = sorted({e["args"]["step"] for e in read_trace(paths[0]) if e.get("cat") == "step"})
    if not steps:
        raise ValueError(f"{paths[0]}: no complete step recorded")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"--step {step}: recorded steps are {steps[0]} .. {steps[-1]}")
    timeline = timeline_from_traces(paths, step=step)
    extras = _waits(paths, step)
    cfg = run_config(run)
    info = {"step": step, "makespan_s": timeline.makespan, "bubble": timeline.bubble_fraction(),
            "layout": cfg.layout, "model": cfg.model}  # fmt: skip
    return timeline, extras, info


def _waits(paths: list[Path], step: int) -> dict[int, list[tuple[str, float, float]]]:
    """Per rank, the executor's waits for messages ("wait" events) during ``step``, in
    seconds on the axis of ``timeline_from_traces`` (its first action is 0)."""
    ranks = [read_trace(p) for p in paths]
    origin = min(e["ts"] for events in ranks for e in events
                 if e.get("cat") in ("compute", "comm") and e["args"].get("step") == step)  # fmt: skip
    out = {}
    for r, events in enumerate(ranks):
        span = next(e for e in events if e.get("cat") == "step" and e["args"]["step"] == step)
        lo, hi = span["ts"], span["ts"] + span["dur"]
        out[r] = [
            ("p2p", (e["ts"] - origin) / 1e6, (e["ts"] + e["dur"] - origin) / 1e6)
            for e in events
            if e.get("cat") == "wait" and lo <= e["ts"] <= hi and e["dur"] > 0
        ]
    return out


def simulated_step(run: Path, hardware) -> tuple[Timeline, dict, dict]:
    """The simulator's step of the run's model and layout on ``hardware`` (seconds)."""
    from plait.sim.simulate import simulate

    cfg = run_config(run)
    res = simulate(cfg.model, cfg.layout, hardware, keep_timeline=True)
    info = {"iter_time_s": res.iter_time_s, "hardware": hardware.name,
            "bubble": res.timeline.bubble_fraction()}  # fmt: skip
    return res.timeline, res.extras, info
