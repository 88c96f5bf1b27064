"""Chrome / Perfetto trace files of what a rank did and when (``plait train --trace``).

One file per rank, ``OUT/traces/rank-K.json``, in the Trace Event Format's object form::

    {"displayTimeUnit": "ms", "traceEvents": [
      {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "rank 3 (pp 1, dp 0, tp 1)"}},
      {"name": "thread_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "compute"}},
      {"name": "F m0 c0", "cat": "compute", "ph": "X", "pid": 3, "tid": 0,
       "ts": 1520.5, "dur": 812.25, "args": {"op": "F", "microbatch": 0, "chunk": 0, "step": 1}},
      ...
    ]}

``pid`` is the global rank, ``tid`` a lane (compute, comm, step), ``ts`` and ``dur`` are in
microseconds on the machine's monotonic clock, shared by every process of a node, so the
files of one node open side by side in https://ui.perfetto.dev (drag them in together) or
``chrome://tracing`` with their timelines aligned.

The file stays valid JSON after every ``flush``: new events are written over the closing
brackets, which are then written again, so a long run costs O(events) in all and a run
that dies mid-way still leaves a readable trace.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.nccl_p2p import Timeline
from plait.parallel.pipeline.schedules import Action, CommBatch, Op

_TAIL = "\n]}\n"


def now_us() -> float:
    """The trace clock: monotonic, in microseconds (the same clock for every process)."""
    return time.perf_counter_ns() / 1000.0


class TraceWriter:
    """Collects complete ("X") events for one process and appends them to its trace file."""

    def __init__(self, path: Path, *, pid: int, process_name: str, lanes: dict[int, str]):
        self.path = Path(path)
        self.pid = pid
        self.pending: list[dict] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        head = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
        ]
        head += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in lanes.items()
        ]
        body = ",\n".join(json.dumps(e) for e in head)
        self.path.write_text('{"displayTimeUnit": "ms", "traceEvents": [\n' + body + _TAIL)

    def add(
        self, name: str, start_us: float, end_us: float, *, tid: int, cat: str, args: dict
    ) -> None:
        self.pending.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": self.pid,
                "tid": tid,
                "ts": round(start_us, 3),
                "dur": round(max(end_us - start_us, 0.0), 3),
                "args": args,
            }
        )

    def flush(self) -> None:
        """Append the pending events; the file is complete JSON afterwards."""
        if not self.pending:
            return
        text = "".join(",\n" + json.dumps(e) for e in self.pending) + _TAIL
        with self.path.open("r+b") as f:
            f.seek(-len(_TAIL), 2)
            f.write(text.encode())
        self.pending.clear()


def read_trace(path: Path) -> list[dict]:
    """The complete ("X") events of a trace file, in file order; ValueError naming the
    file when it is not a trace."""
    try:
        events = json.loads(Path(path).read_text())["traceEvents"]
        return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not a trace file ({why})") from None


def timeline_from_traces(paths: list[Path], *, step: int) -> Timeline:
    """The recorded ``step`` of one pipeline as a ``nccl_p2p.Timeline`` (seconds from
    the step's first action, one row per file in ``paths`` order, e.g. ranks 0 .. p - 1
    of a pp-only run), for ``viz.timeline.draw_timeline`` or ``Timeline.bubble_fraction``."""
    rows = []
    for path in paths:
        events = [
            e
            for e in read_trace(path)
            if e.get("cat") in ("compute", "comm") and e["args"].get("step") == step
        ]
        if not events:
            raise ValueError(f"{path}: no actions recorded for step {step}")
        rows.append(events)
    origin = min(e["ts"] for events in rows for e in events)
    return Timeline(
        [
            [
                (
                    _item(e["args"]),
                    (e["ts"] - origin) / 1e6,
                    (e["ts"] + e["dur"] - origin) / 1e6,
                )
                for e in events
            ]
            for events in rows
        ]
    )


def _item(args: dict):
    """The schedule item a trace event records: a compute action, or a batch (whose
    messages the trace does not list)."""
    op = Op(args["op"])
    if op is Op.COMM:
        return CommBatch(())
    return Action(op, args["microbatch"], args["chunk"])
