"""What the coordinator and the workers of a resilient run say to each other, through the
coordinator's ``TCPStore`` (the liveness keys of ``train/liveness.py`` are the rest).

Communication: store reads and writes only, never a process group; so a worker's side
thread may use it (DESIGN.md section 8). Keys (``G`` a generation, ``W`` a worker id)::

    ft/gen              the newest generation with a decision (an integer, "add" 0 to read)
    ft/decision/G       the coordinator's decision for generation G (JSON, below)
    ft/request          a generation number: the workers of any older one leave it at the
                        next step boundary (a new worker is ready; the coordinator's call)
    ft/ready/W          worker W has started and waits for a decision that includes it
    ft/left/G/W         worker W has left generation G (JSON report, below)
    ft/progress/W       the step worker W is running ("STEP TIME"), with chaos only
    ft/hold             "G S": the members of generation G stop at the boundary before
                        step S (S = 0: nowhere) -- chaos waits for a replacement
    ft/timing/G         the new generation's rank 0: when it formed, copied state, resumed

A decision: ``{"gen": G, "assignment": Assignment JSON, "step": S, "moves": [[receiver, unit,
sender], ...], "keep": {W: [units]}, "fallback": bool, "rollforward": {...} | null,
"last": {...} | null, "why": "...", "t_failure": wall time, "t_detect": wall time}``,
or ``{"gen": G, "stop": "finished" | "<one line>"}``. A report: ``{"done": steps whose
update this worker applied, "units": [units it holds], "reduced": whether its gradients
of step ``done`` are reduced, "stats": its last reduced step's ``loop.StepStats`` as
{"step", "grad_sq_sum", "loss"} or null, "in_step": whether it was inside a step,
"why": "<what it saw>", "t_error": when it saw it, "t": wall time, and how long dropping
the generation took}``.

Times are wall-clock seconds of the one machine the run is on (multi-node runs are not
covered yet), used only for the recovery log line.
"""

from __future__ import annotations

import json
import time

GEN = "ft/gen"
DECISION = "ft/decision/{}"
REQUEST = "ft/request"
READY = "ft/ready/{}"
LEFT = "ft/left/{}/{}"
PROGRESS = "ft/progress/{}"
HOLD = "ft/hold"
TIMING = "ft/timing/{}"


def current_gen(store) -> int:
    return int(store.add(GEN, 0))


def publish(store, decision: dict) -> None:
    """Write a decision, then announce it (a reader that sees the number finds the JSON)."""
    g = decision["gen"]
    store.set(DECISION.format(g), json.dumps(decision))
    store.add(GEN, g - current_gen(store))


def wait_decision(store, *, after: int, poll: float = 0.005, timeout: float | None = None) -> dict:
    """Block until a decision newer than generation ``after`` exists; return the newest."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        g = current_gen(store)
        if g > after:
            return json.loads(store.get(DECISION.format(g)))
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no decision after generation {after} in {timeout:g} s")
        time.sleep(poll)


def report_left(store, gen: int, worker: int, report: dict) -> None:
    store.set(LEFT.format(gen, worker), json.dumps({**report, "t": time.time()}))


def reports(store, gen: int, workers) -> dict[int, dict]:
    """The reports of ``workers`` that have left generation ``gen``."""
    keys = {w: LEFT.format(gen, w) for w in workers}
    return {w: json.loads(store.get(k)) for w, k in keys.items() if store.check([k])}
