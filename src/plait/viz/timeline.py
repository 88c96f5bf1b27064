"""Per-rank timelines of a pipeline schedule, drawn like the figures of the GPipe and
Megatron-LM papers: one row per pipeline rank, time to the right, a box per action.

Forwards are blue, backwards green (input-gradient halves of a zero-bubble split a
lighter green), weight-gradient passes teal; each box carries its micro-batch number, and
with interleaving a rank's later model chunks are drawn in darker shades. Time a rank
spends waiting for a message still in flight is hatched orange (``extras`` kind "p2p":
exposed pipeline communication); any other time the rank does nothing is left blank
(idle: the bubble). The simulator's exposed gradient reduction ("dp_comm") and
optimizer step ("optimizer") are drawn in red and purple.

Input is a ``nccl_p2p.Timeline`` (from ``sim.pipeline.replay`` or the simulator), so the
same drawing serves the textbook unit-cost schedule (``plait viz schedule``) and a
simulated step (``plait simulate --timeline``).
"""

from __future__ import annotations

from pathlib import Path

from plait.nccl_p2p import Timeline
from plait.parallel.pipeline.schedules import Op

_COLORS = {  # op -> shades for chunk 0, 1, 2, ... (later chunks darker)
    Op.FORWARD: ("#9ecae1", "#4292c6", "#2171b5", "#08519c"),
    Op.BACKWARD: ("#a1d99b", "#41ab5d", "#238b45", "#006d2c"),
    Op.BACKWARD_INPUT: ("#c7e9c0", "#74c476", "#41ab5d", "#238b45"),
    Op.BACKWARD_WEIGHT: ("#99d8c9", "#41ae76", "#238b45", "#005824"),
}
_EXTRA_COLORS = {"dp_comm": "#ef3b2c", "optimizer": "#807dba"}
_WAIT_COLOR = "#fd8d3c"
_LABELS = {
    Op.FORWARD: "forward",
    Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "backward (input grad)",
    Op.BACKWARD_WEIGHT: "weight grad",
}


def draw_timeline(
    timeline: Timeline,
    path: str | Path,
    *,
    title: str | None = None,
    extras: dict[int, list[tuple[str, float, float]]] | None = None,
    unit: str = "s",
) -> Path:
    """Draw ``timeline`` and ``extras[rank]`` = [(kind, start, end)] with kind "p2p",
    "dp_comm" or "optimizer" to ``path`` (PNG, SVG or PDF by suffix). ``unit`` labels
    the time axis ("s", "ms", or any text for unscaled units). Raises ValueError if the
    file cannot be written."""
    return draw_timelines([(timeline, extras, title)], path, unit=unit)


def draw_timelines(
    panels: list[tuple[Timeline, dict | None, str | None]],
    path: str | Path,
    *,
    unit: str = "s",
    shared_axis: bool = False,
) -> Path:
    """Several timelines (timeline, extras, title) one above the other in one figure,
    e.g. a recorded step above the simulator's prediction of it; ``shared_axis`` puts
    them on one time scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    spans = [_span(t, x or {}) for t, x, _ in panels]
    width = max(
        min(24.0, max(8.0, 0.12 * sum(1 for a, *_ in t.events[0] if a.is_compute)))
        for t, _, _ in panels
    )
    heights = [0.5 * t.num_ranks + 1.6 for t, _, _ in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(width, sum(heights)), squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )  # fmt: skip
    for ax, (timeline, extras, title), span in zip(axes[:, 0], panels, spans):
        _draw_on(ax, timeline, extras or {}, unit, max(spans) if shared_axis else span)
        if title:
            ax.set_title(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=150)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)
    return path


def _span(timeline: Timeline, extras: dict) -> float:
    return max([timeline.makespan] + [e for spans in extras.values() for _, _, e in spans])


def _draw_on(ax, timeline: Timeline, extras: dict, unit: str, span: float) -> None:
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3}.get(unit, 1.0)
    p = timeline.num_ranks
    span = span * scale or 1.0
    used: dict[str, str] = {}
    for rank, events in enumerate(timeline.events):
        y = p - 1 - rank  # rank 0 on top
        for action, start, end in events:
            dt = (end - start) * scale
            if dt <= 0:
                continue
            if action.is_compute:
                shades = _COLORS[action.op]
                color = shades[min(action.chunk, len(shades) - 1)]
                ax.broken_barh(
                    [(start * scale, dt)],
                    (y - 0.4, 0.8),
                    facecolors=color,
                    edgecolors="white",
                    linewidth=0.5,
                )
                used[_LABELS[action.op]] = shades[0]
                if dt > span / 90:
                    ax.text(
                        start * scale + dt / 2,
                        y,
                        str(action.microbatch),
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
        for kind, start, end in extras.get(rank, []):
            if end <= start:
                continue
            if kind == "p2p":  # waiting for a message in flight
                ax.broken_barh(
                    [(start * scale, (end - start) * scale)],
                    (y - 0.25, 0.5),
                    facecolors="none",
                    edgecolors=_WAIT_COLOR,
                    hatch="////",
                    linewidth=0.0,
                )
                used["waiting on p2p"] = _WAIT_COLOR
            else:
                color = _EXTRA_COLORS.get(kind, "#969696")
                ax.broken_barh(
                    [(start * scale, (end - start) * scale)],
                    (y - 0.4, 0.8),
                    facecolors=color,
                    edgecolors="white",
                    linewidth=0.5,
                )
                used[kind.replace("_", " ")] = color
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p - 1, -1, -1)])
    ax.set_xlim(0, span * 1.01)
    ax.set_ylim(-0.7, p - 0.3)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    chunks = any(a.is_compute and a.chunk for events in timeline.events for a, _, _ in events)
    handles = [
        Patch(facecolor=c, label=name + (" (darker: later chunks)" if chunks and i == 0 else ""))
        for i, (name, c) in enumerate(x for x in used.items() if x[0] != "waiting on p2p")
    ]
    if "waiting on p2p" in used:
        handles.append(
            Patch(facecolor="none", edgecolor=_WAIT_COLOR, hatch="////", label="waiting on p2p")
        )
    handles.append(Patch(facecolor="white", edgecolor="#bdbdbd", label="idle (bubble)"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 - 0.2 / p),
        ncol=min(len(handles), 6),
        frameon=False,
        fontsize=8,
    )
