"""What the coordinator and the workers of a resilient run say to each other, through the
coordinator's ``TCPStore`` (the liveness keys of ``train/liveness.py`` are the rest).

Communication: store reads and writes only, never a process group; so a worker's side
thread may use it (DESIGN.md section 8). Every key is signed with the run's secret
(``signed_store.py``); a value that does not verify, or is not the JSON (or numbers) this
module writes, is ignored as if absent. Keys (``G`` a generation, ``W`` a worker id)::

    ft/run              "1", set first by the coordinator: a node agent checks its secret on it
    ft/gen              the newest generation with a decision (an integer)
    ft/decision/G       the coordinator's decision for generation G (JSON, below)
    ft/request          a generation number: the workers of any older one leave it at the
                        next step boundary (a new worker is ready; the coordinator's call)
    ft/ready/W          worker W has started and waits for a decision that includes it
    ft/left/G/W         worker W has left generation G (JSON report, below)
    ft/progress/W       the step worker W is running ("STEP TIME"), with chaos only
    ft/hold             "G S": the members of generation G stop at the boundary before
                        step S (S = 0: nowhere) -- chaos waits for a replacement
    ft/timing/G         the new generation's rank 0: when it formed, copied state, resumed
    ft/abort            {"gen": G, "dead": [W, ...]}: generation G is broken (the coordinator
                        declared a failure in it): every member aborts its groups from its
                        side thread; the workers in "dead" (every one declared dead so far:
                        silent, exited, lost, unresponsive) are expelled and exit, writing
                        nothing, whenever they run again

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

RUN = "ft/run"
GEN = "ft/gen"
DECISION = "ft/decision/{}"
REQUEST = "ft/request"
READY = "ft/ready/{}"
LEFT = "ft/left/{}/{}"
PROGRESS = "ft/progress/{}"
HOLD = "ft/hold"
TIMING = "ft/timing/{}"
ABORT = "ft/abort"


def number(payload: bytes | None, default: int = -1) -> int:
    """An integer written by ``store.set(key, str(n))``; ``default`` when absent or not one."""
    if payload is None or not payload.lstrip(b"-").isdigit():
        return default
    return int(payload)


def load_json(payload: bytes | None, kind: type = dict):
    """A JSON value of type ``kind`` read from the store; None when absent or malformed."""
    try:
        value = json.loads(payload) if payload is not None else None
    except ValueError:
        return None
    return value if isinstance(value, kind) else None


def current_gen(store) -> int:
    """The newest generation with a decision (-1: none yet)."""
    return number(store.get(GEN))


def publish(store, decision: dict) -> None:
    """Write a decision, then announce it (a reader that sees the number finds the JSON)."""
    g = decision["gen"]
    store.set(DECISION.format(g), json.dumps(decision))
    store.set(GEN, str(g))


def request(store, gen: int) -> None:
    """Ask the members of generations before ``gen`` to leave at their next boundary."""
    store.set(REQUEST, str(gen))


def requested(store) -> int:
    return number(store.get(REQUEST), default=0)


def wait_decision(store, *, after: int, poll: float = 0.005, timeout: float | None = None) -> dict:
    """Block until a decision newer than generation ``after`` exists; return the newest."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        g = current_gen(store)
        if g > after:
            d = load_json(store.get(DECISION.format(g)))
            if d is not None and d.get("gen") == g:
                return d
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no decision after generation {after} in {timeout:g} s")
        time.sleep(poll)


def report_left(store, gen: int, worker: int, report: dict) -> None:
    store.set(LEFT.format(gen, worker), json.dumps({**report, "t": time.time()}))


def reports(store, gen: int, workers) -> dict[int, dict]:
    """The reports of ``workers`` that have left generation ``gen`` (well-formed ones)."""
    out = {}
    for w in workers:
        r = load_json(store.get(LEFT.format(gen, w)))
        if r is not None and _report_ok(r):
            out[w] = r
    return out


def _report_ok(r: dict) -> bool:
    return (
        type(r.get("done")) is int
        and isinstance(r.get("units"), list)
        and all(isinstance(u, str) for u in r["units"])
        and isinstance(r.get("t"), int | float)
        and isinstance(r.get("stats"), dict | type(None))
        and isinstance(r.get("why", ""), str)
    )


def hold(store) -> tuple[int, int] | None:
    """``ft/hold`` as (generation, step), or None."""
    payload = store.get(HOLD)
    parts = payload.split() if payload is not None else []
    if len(parts) != 2 or not all(p.lstrip(b"-").isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def progress(store, worker: int) -> tuple[int, float, str] | None:
    """``ft/progress/W`` as (step, wall time, phase), or None."""
    payload = store.get(PROGRESS.format(worker))
    try:
        step, t, phase = payload.decode().split()
        return int(step), float(t), phase
    except (AttributeError, ValueError):
        return None


def abort(store, gen: int, dead) -> None:
    """Declare generation ``gen`` broken and the workers ``dead`` expelled (``ft/abort``)."""
    store.set(ABORT, json.dumps({"gen": gen, "dead": sorted(dead)}))


def aborted(store) -> tuple[int, frozenset[int]]:
    """``ft/abort`` as (generation, expelled workers); (-1, {}) when absent or malformed."""
    d = load_json(store.get(ABORT))
    if d is None or type(d.get("gen")) is not int or not isinstance(d.get("dead"), list):
        return -1, frozenset()
    return d["gen"], frozenset(w for w in d["dead"] if type(w) is int)
