"""The coordinator of a resilient run: a loop in the launcher process (a process that never
dies while the run lives: DESIGN.md section 7) that hosts the store, starts the workers,
watches them, and decides each generation.

Communication: none through process groups. The store it hosts carries the liveness keys
(``train/liveness.py``) and the resilience protocol (``protocol.py``). It listens on
127.0.0.1 for one node, on ``--rdzv-endpoint``'s address for several, and every message on
it is signed with a secret this coordinator makes for the run (``signed_store.py``): its
workers get it in their environment, the other nodes' agents from ``.run-secret`` (mode
0600) in the shared run folder. A message that does not verify is ignored and logged to
``logs/coordinator.jsonl`` (event "rejected"). Signals go only to the processes it (or a
node's agent) started: ``nodes.Local`` holds the ``Popen``.

What it does, every 20 ms:

- **Liveness.** A worker is dead when its process exits without its last word (a signal,
  an out-of-memory kill, a crash of the interpreter), or when its heartbeat stopped for
  ``--heartbeat-timeout`` seconds, or when it does not leave an aborted generation; a
  generation is broken too when no member starts a step for 10 x the median step time
  (``stall_check``). The coordinator publishes ``ft/abort``: every survivor aborts the
  generation's groups from its side thread, and recovery never waits on killing anyone
  (a dead worker that runs again finds itself expelled and exits, writing nothing). A worker whose last word is an error (bad input, a bug, gradients that are
  not finite) ends the run with that line, as a failure no re-forming would cure.
- **Chaos.** ``--inject-failure`` / ``--chaos-every`` (``chaos.py``): SIGKILL or SIGSTOP to
  real worker processes. A shot due while a replacement is on its way holds the run
  (``ft/hold``) at the boundary before its step until the replacement has joined.
- **Re-forming.** On a death, or when a worker reports it left the generation, it waits
  for every living member to report (each aborts and drops the broken generation at once,
  so a peer waiting in a collective fails within milliseconds; one that still has not
  reported after the heartbeat timeout + 5 s is expelled), then decides the next generation
  (``decide``): where the run is (the most steps any survivor applied), who rolls
  forward, the template combination for the workers it has (``templates.choose``), who
  holds what (``assignment.assign``), who sends what to whom (``assignment.sources``) -- or, when
  some unit has no copy left, a restart from the newest checkpoint.
- **Rejoining.** Each dead worker is replaced by a new process (``--no-respawn`` turns this
  off); when it is ready the coordinator asks the members to leave at the next step
  boundary (``ft/request``) and forms a generation that includes it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from plait import signed_store
from plait.errors import LaunchError, printable
from plait.resilience import nodes, protocol
from plait.resilience.assignment import (
    assign,
    expand_moves,
    grid_assignment,
    sources,
    strip_tp,
)
from plait.resilience.chaos import Chaos
from plait.resilience.templates import build_templates, choose
from plait.train import liveness
from plait.train.config import RunConfig
from plait.train.run_folder import open_nofollow

POLL_S = 0.02
# The step-progress watchdog (``stall_check``). 10 x the median: stragglers (a garbage
# collection, a slow data read, a noisy neighbour) stay within 2-3 x; a step 10 x slower is
# a hang for any practical purpose. The floor, 2 x --heartbeat-timeout (20 s by default):
# steps of milliseconds would otherwise trip on a scheduling hiccup, and a hang that stops
# the heartbeat too is the heartbeat's to find, sooner.
STALL_K, STALL_FLOOR_X, STALL_WINDOW, STALL_POLL_S = 10.0, 2.0, 50, 1.0
SHUTDOWN_S, KILL_WAIT_S = 3.0, 2.0  # at the end: SIGTERM's grace, then SIGKILL's wait
READY_TIMEOUT_S = 300.0  # a replacement that is not ready by then no longer holds chaos


@dataclass
class Proc:
    worker: int
    handle: nodes.Local | nodes.Remote  # the process, on this node or through its agent
    node: int = 0
    local_rank: int = 0
    ready: bool = False
    dead: bool = False
    finished: bool = False
    spawned: float = 0.0  # monotonic time it was started
    signal: str | None = None  # what chaos sent it


def hardware_for(device_type: str):
    """The simulator's entry for this machine's devices (templates are timed on it)."""
    from plait.sim import get_hardware

    if device_type != "cuda":
        return get_hardware("cpu")
    import torch

    name = torch.cuda.get_device_name(0)
    for key, entry in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"),
                       ("V100", "v100")):  # fmt: skip
        if key in name:
            return get_hardware(entry)
    return get_hardware("h100-sxm")


class Coordinator:
    def __init__(self, cfg: RunConfig, *, nnodes: int = 1, endpoint: str | None = None):
        import torch

        self.cfg, self.res = cfg, cfg.resilience
        self.out = Path(cfg.out)
        lay = cfg.layout
        self.world = lay.world_size
        self.nnodes, self.per_node = nnodes, self.world // nnodes
        self.events = open_nofollow(self.out / "logs" / "coordinator.jsonl", "a")
        self.secret = signed_store.new_secret()
        if nnodes > 1:  # node 0 hosts the store where every node's agent and worker finds it
            host, _, port = endpoint.rpartition(":")
            liveness.check_shared(host)
            signed_store.write_secret(self.out, self.secret)  # for the other nodes' agents
            self.store = self._host(port=int(port), bind=host)
            self.address = endpoint
        else:
            self.store = self._host()
            self.address = f"127.0.0.1:{self.store.port}"
        self.store.set(protocol.RUN, "1")
        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.rows, self.mbs = lay.global_batch_size, lay.micro_batch_size
        hw = hardware_for("cuda" if self.gpus else "cpu")
        # ZeRO inside a replica: pipelines come K at a time, one template per replica
        self.shard_group = lay.zero_shard_group if lay.zero else 1
        # tensor parallelism: a tp group of ``tp`` consecutive workers is the unit that
        # fails, is replaced and is planned (assignment.py); templates count groups
        self.tp = lay.tp
        groups = self.world // self.tp
        max_nodes = max(lay.pp, groups // self.shard_group // (self.res.fault_tolerance + 1))
        every = build_templates(cfg.model, lay, hw, max_nodes=max_nodes, rows=self.rows // lay.dp)
        # those that fit in memory, and the user's own (it runs, whatever the model says)
        self.templates = {s: t for s, t in every.items() if t.fits or s == lay.pp}
        self.procs: dict[int, Proc] = {}
        self.next_worker = 0
        self.gen, self.assignment = -1, None
        self.printed = 0  # generations whose recovery line is printed
        self.chaos = Chaos(self.res, steps=cfg.train.steps)
        self.held: tuple[int, int] | None = None  # the ft/hold published last (gen, step)
        self.dog = liveness.Watchdog(self.store, ranks=[], stale_s=self.res.heartbeat_timeout)
        self.nodes = nodes.NodeWatch(self.store, nnodes=nnodes, stale_s=self.res.heartbeat_timeout)
        self.spawns: dict[int, list[str]] = {}  # node -> the "w:l" items asked of its agent
        self.failure: tuple[float, str] | None = None  # (when, what) of the first evidence
        self.requested = False
        self.aborted: tuple[int, int] = (-1, 0)  # the ft/abort published last (gen, dead)
        self.broken = -1  # the newest generation declared broken
        self.stall: tuple[int, float] | None = None  # (newest step started, when) of members
        self.step_times: list[float] = []  # the last STALL_WINDOW step times
        self.stall_polled = 0.0
        self.last_progress: dict[int, tuple[int, float, float]] = {}
        self.durations: dict[int, float] = {}  # each worker's last step time before a pause

    def _host(self, *, port: int = 0, bind: str = "127.0.0.1"):
        def rejected(key: str, why: str, n: int) -> None:
            self.log("rejected", key=key, why=why, count=n)

        try:
            return liveness.host(port, bind=bind, secret=self.secret, on_reject=rejected)
        except OSError as e:
            raise ValueError(f"--rdzv-endpoint {bind}:{port}: node 0 cannot listen there "
                             f"({e.strerror or e}); give an address of this machine and a "
                             "free port") from None  # fmt: skip

    # -- processes -------------------------------------------------------------------

    def spawn(self, node: int = 0, local_rank: int = 0) -> int:
        """Start a new worker on ``node`` (node 0: this one; others through their agent)
        with ``local_rank`` (its device there: a replacement takes the dead one's)."""
        w = self.next_worker
        self.next_worker += 1
        if node == 0:
            cmd, env = nodes.worker_command(config=self.out / "config.yaml", address=self.address,
                                            worker=w, local_rank=local_rank, world=self.world,
                                            secret=self.secret)  # fmt: skip
            handle = nodes.Local(subprocess.Popen(cmd, env=env))
        else:
            self.spawns.setdefault(node, []).append(f"{w}:{local_rank}")
            self.store.set(nodes.SPAWN.format(node), ",".join(self.spawns[node]))
            handle = nodes.Remote(self.store, w)
        self.procs[w] = Proc(w, handle, node, local_rank, spawned=time.monotonic())
        self.dog.ranks.append(w)
        self.log("spawn", worker=w, node=node, pid=handle.pid)
        return w

    def place_replacements(self, group: list[Proc]) -> list[tuple[int, int]]:
        """(node, local rank) for the replacement of each worker of a tp group (one
        worker at tp 1): its node and device, or, if its node is gone, the node alive with
        the fewest workers and its lowest free local ranks (several workers per device if
        none is free), the whole group on one node."""
        if self.nodes.fresh(group[0].node):
            return [(p.node, p.local_rank) for p in group]
        live = {n: [] for n in {0} | {q.node for q in self.procs.values()} if self.nodes.fresh(n)}
        for q in self.procs.values():
            if q.node in live and not q.dead:
                live[q.node].append(q.local_rank)
        node = min(live, key=lambda n: (len(live[n]), n))
        out = []
        for _ in group:
            free = [r for r in range(self.per_node) if r not in live[node]]
            r = free[0] if free else min(range(self.per_node), key=live[node].count)
            live[node].append(r)
            out.append((node, r))
        return out

    def send(self, w: int, sig: str) -> None:
        p = self.procs[w]
        p.signal = p.signal or sig
        p.handle.signal(signal.SIGKILL if sig == "kill" else signal.SIGSTOP)

    def log(self, event: str, **kw) -> None:
        self.events.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\n")
        self.events.flush()

    def members(self) -> list[int]:
        return self.assignment.members if self.assignment is not None else []

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        lay = self.cfg.layout
        self.assignment = grid_assignment(
            dp=lay.dp, template=self.templates[lay.pp], rows=self.rows,
            n_layers=self.cfg.model.n_layers, tied=self.cfg.model.tied_embeddings,
            shard_group=self.shard_group, tp=self.tp)  # fmt: skip
        slot = node_slots(self.assignment)
        for w in range(self.world):
            self.spawn(node=slot[w] // self.per_node, local_rank=slot[w] % self.per_node)
        sizes = ", ".join(f"{s}: {'+'.join(str(b - a) for a, b in t.stages)}"
                          for s, t in sorted(self.templates.items()))  # fmt: skip
        print(f"plait: fault tolerance {self.res.fault_tolerance}: pipeline templates by "
              f"stages (layers each) {sizes}", flush=True)  # fmt: skip
        self.publish({"assignment": self.assignment.to_json(), "step": 0, "moves": [],
                      "keep": {}, "current": [],
                      "start": "checkpoint" if self.cfg.train.resume else "fresh",
                      "why": "start", "redone": 0})  # fmt: skip
        while True:
            now = time.time()
            self.watch(now)
            self.print_recoveries()
            if self.all_finished():
                self.finish()
                return
            if self.failure is not None or self.requested:
                if self.reform():
                    continue
            elif self.grows():
                protocol.request(self.store, self.gen + 1)
                self.requested, self.request_t = True, now
            time.sleep(POLL_S)

    def watch(self, now: float) -> None:
        """Exits, silences, chaos, and reports of members that left the generation."""
        self.nodes.poll()
        for w, p in list(self.procs.items()):
            if p.dead or p.finished:
                continue
            code = p.handle.poll()
            if code is None:
                if not p.ready and not p.dead and self.store.check([protocol.READY.format(w)]):
                    p.ready = True
                continue
            word = liveness.reports(self.store, [w]).get(w)
            if word is not None and word["code"] == 0:
                p.finished = True
                continue
            if word is not None:  # an error no re-forming cures: the run ends with it
                raise self.fatal(word)
            self.expel(p, _signal_name(code), now, code=code)
        for s in self.dog.poll():
            p = self.procs[s.rank]
            if p.dead or p.finished:
                continue
            self.log("silent", worker=s.rank, silent_s=s.silent_s)
            how = (f"no heartbeat for {s.silent_s:.1f} s" if self.nodes.alive(p.node) else
                   f"lost with node {p.node}: no heartbeat, no exit report")  # fmt: skip
            self.expel(p, how, now)
        if self.gen >= 0:
            self.stall_check(now)
        if self.gen >= 0 and self.chaos.enabled:
            reforming = self.failure is not None or self.requested
            copies, coming = 0 if reforming else self.copies(), self.coming()
            for shot in self.chaos.tick(self.progress(), set(self.members()), time.monotonic(),
                                        copies=copies, coming=coming):  # fmt: skip
                p = self.procs[shot.worker]
                if not p.dead and not p.finished:
                    self.log("chaos", worker=shot.worker, signal=shot.signal, step=shot.step)
                    self.send(shot.worker, shot.signal)
                    if shot.signal == "kill":  # the failure starts now, not when it is seen
                        self.note_failure(time.time(), f"worker {shot.worker} died (SIGKILL)"
                                          f"{self._during(shot.worker)}{self._with_group(shot.worker)}",
                                          declared=False)  # fmt: skip
                    else:
                        self.note_failure(time.time(), f"worker {shot.worker} hung (SIGSTOP)"
                                          f"{self._during(shot.worker)}{self._with_group(shot.worker)}",
                                          declared=False)  # fmt: skip
            self.hold(self.chaos.hold_step(copies=copies, coming=coming))
        left = protocol.reports(self.store, self.gen, self.members())
        if left and self.broken != self.gen and not self.requested:
            first = min(left.values(), key=lambda r: r["t"])
            self.note_failure(first["t"], f"a worker saw: {first['why']}")

    def stall_check(self, now: float) -> None:
        """The step-progress watchdog: a failure of the generation when no member has
        started a new step for ``STALL_K`` x the median step time (at least
        ``STALL_FLOOR_X`` x --heartbeat-timeout) while nothing explains it (a checkpoint
        or an evaluation in progress, a hold, a re-forming) -- a hang whose heartbeats
        still beat (a stuck kernel, a collective that never completes). The generation is
        aborted on every member; those that leave re-form as usual (the step redone), and
        one that does not (stuck outside any collective) is expelled as unresponsive."""
        if self.failure is not None or self.requested or (self.held and self.held[1]):
            self.stall = None
            return
        if not self.chaos.enabled and now - self.stall_polled < STALL_POLL_S:
            return  # a read per member: not every 20 ms on a thousand workers
        self.stall_polled = now
        seen = self.progress()
        if not seen or any(p[3] != "step" for p in seen.values()):
            self.stall = None  # saving or evaluating: as long as it takes
            return
        step, t = max(p[0] for p in seen.values()), time.monotonic()
        if self.stall is None or self.stall[0] != step:
            if self.stall is not None and step == self.stall[0] + 1:
                self.step_times = [*self.step_times[-(STALL_WINDOW - 1) :], t - self.stall[1]]
            self.stall = (step, t)
            return
        if len(self.step_times) < 3:
            return
        median = sorted(self.step_times)[len(self.step_times) // 2]
        limit = max(STALL_K * median, STALL_FLOOR_X * self.res.heartbeat_timeout)
        if t - self.stall[1] > limit:
            self.log("stall", gen=self.gen, step=step, waited_s=t - self.stall[1], median_s=median)
            self.note_failure(now, f"no step completed in {t - self.stall[1]:.1f} s (median "
                              f"step {median:.2f} s) during step {step}")  # fmt: skip

    def expel(self, p: Proc, how: str, now: float, *, code: int | None = None) -> None:
        """Declare worker ``p`` dead -- with tp groups, its whole group: the peers' shards
        are useless alone -- a failure of its generation (every survivor aborts its
        groups: ``ft/abort``), replacements started (a new tp group, consecutive ids).
        Nothing is sent to them: a hung or cut-off worker, or a peer, that runs on finds
        itself expelled and exits writing nothing (``elastic.Watcher``), so recovery never
        waits on a kill reaching it."""
        if p.dead:  # already declared (with a peer of its tp group, say)
            return
        w, lead = p.worker, p.worker - p.worker % self.tp
        group = [self.procs[v] for v in range(lead, lead + self.tp) if v in self.procs]
        for q in group:
            if q.dead:
                continue
            q.dead = True
            if q.worker in self.dog.ranks:
                self.dog.ranks.remove(q.worker)
            self.log("death", worker=q.worker, returncode=code if q is p else None,
                     signal=q.signal, how=how if q is p else f"left with worker {w}")  # fmt: skip
        if w in self.members():
            self.note_failure(now, f"worker {w} died ({how}){self._during(w)}{self._with_group(w)}")
        else:
            self.publish_abort()  # the expelled list only
        if self.res.respawn and not self.all_finished_soon():
            for node, local_rank in self.place_replacements(group):
                self.spawn(node, local_rank)

    def publish_abort(self) -> None:
        """``ft/abort``: the current generation is broken (once a failure is noted) and
        who is expelled (every worker declared dead so far)."""
        dead = [w for w, p in self.procs.items() if p.dead]
        gen = self.broken
        if (gen, len(dead)) != self.aborted:
            protocol.abort(self.store, gen, dead)
            self.aborted = (gen, len(dead))
            if gen >= 0:
                self.log("abort", gen=gen, dead=dead)

    def coming(self) -> bool:
        """Whether a replacement is on its way: a worker started less than
        READY_TIMEOUT_S ago that is not ready yet, or ready ones that make a larger
        combination (the coordinator is about to ask the members to let them in)."""
        members, now = set(self.members()), time.monotonic()
        starting = any(
            not p.ready and not p.dead and not p.finished and w not in members
            and now - p.spawned < READY_TIMEOUT_S
            for w, p in self.procs.items()
        )  # fmt: skip
        return starting or self.grows()

    def hold(self, step: int) -> None:
        """Publish ``ft/hold``: the members of this generation stop at the boundary before
        ``step`` (0: nowhere) until it changes."""
        if (self.gen, step) != self.held:
            self.store.set(protocol.HOLD, f"{self.gen} {step}")
            if step or (self.held and self.held[1]):
                self.log("hold" if step else "release", gen=self.gen, step=step)
                self.pause_progress()  # a step across the hold is not a step's time
            self.held = (self.gen, step)

    def pause_progress(self) -> None:
        """Forget where the workers were, keeping their last step times: the next step
        after a re-forming or a hold is timed from that, not from the gap."""
        self.durations.update({w: p[2] for w, p in self.last_progress.items()})
        self.last_progress.clear()

    def copies(self) -> int:
        """Replicas (pipelines; with ZeRO inside replicas, groups of K) of the generation
        whose workers all train in it: a worker reports progress only once its state copy
        is done (``publish`` clears the keys), so a replica of a worker still receiving
        holds no copy yet."""
        pipes, k = self.assignment.pipelines, self.shard_group
        return sum(
            all(self.store.check([protocol.PROGRESS.format(w)]) for p in pipes[i : i + k]
                for w in p.workers)
            for i in range(0, len(pipes), k)
        )  # fmt: skip

    def _with_group(self, w: int) -> str:
        """``, with its tp group 4-5`` (nothing at tp 1): what a worker's failure takes out."""
        lead = w - w % self.tp
        return f", with its tp group {lead}-{lead + self.tp - 1}" if self.tp > 1 else ""

    def _during(self, w: int) -> str:
        p = self.last_progress.get(w)
        return f" during step {p[0]}" if p else ""

    def note_failure(self, when: float, what: str, *, declared: bool = True) -> None:
        """A failure of the current generation, from ``when``. ``declared``: the
        coordinator's own finding (an exit, a silence, a member's report), which aborts the
        generation on every survivor; a chaos shot only dates it (the finding must come
        from the detection, as for a real failure)."""
        if self.failure is None or when < self.failure[0]:
            self.failure = (when, what)
        if declared:
            self.broken = self.gen
            self.publish_abort()

    def progress(self) -> dict[int, tuple[int, float, float]]:
        out = {}
        for w in self.members():
            seen = protocol.progress(self.store, w)
            if seen is None:
                continue
            step, t, phase = seen
            prev = self.last_progress.get(w)
            if prev is not None and prev[0] == step:
                out[w] = (*prev[:3], phase)
            else:  # a new step: the previous one took t - its start
                took = t - prev[1] if prev is not None else self.durations.get(w, 0.0)
                out[w] = (step, t, took, phase)
        self.last_progress.update(out)
        return out

    def grows(self) -> bool:
        """Whether the workers ready to join would make a larger combination (a spare that
        no template can use waits)."""
        joiners = self.joiners()
        if not joiners:
            return False
        sizes = self.choose(len(self.members()) + len(joiners))
        return sizes is not None and sum(sizes) * self.shard_group * self.tp > len(self.members())

    def choose(self, n: int) -> tuple[int, ...] | None:
        """Template sizes for ``n`` workers: one per pipeline, or one per replica of K
        pipelines (ZeRO inside a replica), at least F + 1 of them when they fit."""
        return choose(n // self.tp // self.shard_group, self.templates,
                      min_pipelines=self.res.fault_tolerance + 1,
                      max_pipelines=self.rows // self.mbs // self.shard_group)  # fmt: skip

    def joiners(self) -> list[int]:
        """New workers ready to join: whole tp groups only (every worker of one ready)."""
        members = set(self.members())
        ok = {w for w, p in self.procs.items() if p.ready and not p.dead and w not in members}
        return sorted(w for w in ok if all(v in ok for v in self.group(w)))

    def group(self, w: int) -> range:
        """The tp group of worker ``w`` (consecutive ids, aligned: ``assignment.py``)."""
        return range(w - w % self.tp, w - w % self.tp + self.tp)

    def all_finished(self) -> bool:
        return bool(self.members()) and all(self.procs[w].finished or self.procs[w].dead
                                            for w in self.members()) and any(
            self.procs[w].finished for w in self.members())  # fmt: skip

    def all_finished_soon(self) -> bool:
        return any(self.procs[w].finished for w in self.members())

    # -- re-forming --------------------------------------------------------------------

    def reform(self) -> bool:
        """Once every living member reported leaving, decide and publish the next
        generation. True when it did."""
        living = [w for w in self.members() if not self.procs[w].dead]
        if any(self.procs[w].finished for w in self.members()):
            # the members finished before they saw the request: the last checkpoint is
            # committed, and they all wrote their fingerprints (they decide alike)
            self.finish()
            raise _Finished
        left = protocol.reports(self.store, self.gen, living)
        started = self.failure[0] if self.failure else self.request_t
        if len(left) < len(living):
            if time.time() - started < self.res.heartbeat_timeout + 5:
                return False
            for w in sorted(set(living) - set(left)):  # beating, but it does not leave
                self.log("unresponsive", worker=w)
                self.expel(self.procs[w], "did not leave its aborted generation", time.time())
            return False
        decision = self.decide(left)
        if decision is None:
            return False
        self.publish(decision)
        self.failure, self.requested = None, False
        return True

    def decide(self, left: dict[int, dict]) -> dict | None:
        res, cfg = self.res, self.cfg
        resume = max((r["done"] for r in left.values()), default=0)
        leaders = [r for r in left.values() if r["done"] == resume and r["stats"]
                   and r["stats"]["step"] == resume - 1]  # fmt: skip
        # the statistics of the last step, as a leader reduced them (loop.StepStats)
        last = leaders[0]["stats"] if leaders else None
        current = {}
        for w, r in left.items():
            if r["done"] == resume or (last and r["done"] == resume - 1 and r["reduced"]):
                current[w] = frozenset(r["units"])
        candidates = set(left) | set(self.joiners())
        # planned by tp group, each named by its lead (assignment.py); whole groups only
        leads = sorted(w for w in candidates if w % self.tp == 0
                       and all(v in candidates for v in self.group(w)))  # fmt: skip
        sizes = self.choose(len(leads) * self.tp)
        if sizes is None:
            if any(not p.ready and not p.dead for p in self.procs.values()):
                return None  # replacements are starting: wait for them
            raise LaunchError(f"{len(candidates)} workers left, too few for the smallest "
                              f"pipeline template ({min(self.templates) * self.shard_group * self.tp} "
                              "workers)")  # fmt: skip
        holdings = {g: self.group_holds(g, current) for g in leads}
        plan = assign(sizes, self.templates, holdings=holdings, rows=self.rows,
                      micro_batch=self.mbs, n_layers=cfg.model.n_layers,
                      tied=cfg.model.tied_embeddings, shard_group=self.shard_group)  # fmt: skip
        moves, missing = sources(plan, {g: h for g, h in holdings.items() if h})
        assignment, moves = plan.expand(self.tp), expand_moves(moves, self.tp)
        why = self.failure[1] if self.failure else (
            "worker(s) " + ", ".join(map(str, sorted(set(assignment.members)
                                                     - set(self.members())))) + " joined")  # fmt: skip
        when = self.failure[0] if self.failure else self.request_t
        d = {"assignment": assignment.to_json(), "step": resume, "moves": moves,
             "current": sorted(current),
             "keep": {str(w): sorted(current[w] & assignment.units_of(w)) for w in current
                      if w in assignment.members},
             "start": "transfer", "rollforward": last, "last": last, "why": why,
             "t_failure": when,
             "t_detect": min((r.get("t_error", r["t"]) for r in left.values()), default=time.time()),
             # the step in flight when a worker that was in it has no later step applied
             "redone": int(any(r.get("in_step") and r["done"] == resume for r in left.values()))}  # fmt: skip
        if missing:
            from plait.train.checkpoint import latest

            ckpt = latest(self.out / "checkpoints")
            if ckpt is None:
                self.log("no copy", missing=missing, current=sorted(current), resume=resume,
                         reports={w: {k: r.get(k) for k in ("done", "reduced", "in_step", "units", "stats", "why")}
                                  for w, r in left.items()})  # fmt: skip
                raise LaunchError(f"{why}: no copy of {', '.join(missing)} is left and there is "
                                  "no checkpoint to restart from (use --save-every N)")  # fmt: skip
            step = int(ckpt.name.removeprefix("step-"))
            print(f"plait: {why}: no copy of {', '.join(missing)} is left (more than "
                  f"--fault-tolerance {res.fault_tolerance} failures); restarting from "
                  f"{ckpt.name}, redoing steps {step + 1}-{resume}", flush=True)  # fmt: skip
            d.update(start="checkpoint", moves=[], keep={}, rollforward=None, last=None,
                     redone=resume - step)  # fmt: skip
        self.log("decision", gen=self.gen + 1, assignment=assignment.describe(), start=d["start"],
                 step=resume, why=why, redone=d["redone"], moves=len(moves), t_failure=when,
                 reports={w: {k: r.get(k) for k in ("done", "reduced", "in_step", "units", "t_error", "t", "drop_s", "abort_s", "gc_s", "alive_groups", "why")}
                          for w, r in left.items()})  # fmt: skip
        self.assignment = assignment
        return d

    def group_holds(self, lead: int, current: dict[int, frozenset]) -> frozenset[str]:
        """What the tp group of ``lead`` holds up to date, as the plan names units
        (``strip_tp``): what all of its workers hold, each its own tp shard of it."""
        if self.tp == 1:
            return current.get(lead, frozenset())
        held = [frozenset(map(strip_tp, current.get(w, ()))) for w in self.group(lead)]
        return frozenset.intersection(*held)

    def finish(self) -> None:
        """The run is done: tell whoever still waits, let every process exit, then compare
        the replicas (``--verify-replicas``). Both ends of the loop come here: all members
        finished in a steady generation, or they finished while a re-form (a failure, or a
        replacement ready to join) was pending."""
        self.publish({"stop": "finished"})
        self._wait_exit()
        if self.res.verify_replicas:
            self.verify_replicas()

    def verify_replicas(self) -> None:
        """Every tensor (parameters, AdamW moments and step) bitwise equal on every worker
        holding it, from the fingerprints the workers wrote as they finished."""
        prints = {}
        for w in self.members():
            path = self.out / "logs" / f"replica-{w}.json"
            if path.exists():
                prints[w] = json.loads(path.read_text())
        holders: dict[str, dict[str, list[int]]] = {}
        for w, fp in sorted(prints.items()):
            for name, digest in fp.items():
                holders.setdefault(name, {}).setdefault(digest, []).append(w)
        for name, by_digest in sorted(holders.items()):
            if len(by_digest) > 1:
                groups = " vs ".join(str(ws) for ws in by_digest.values())
                raise LaunchError(f"--verify-replicas: {name} differs between workers {groups}")
        copies = [sum(len(ws) for ws in d.values()) for d in holders.values()]
        print(f"plait: replicas verified: {len(holders)} tensors on {len(prints)} workers, each "
              f"bitwise equal on its {min(copies, default=0)}-{max(copies, default=0)} holders",
              flush=True)  # fmt: skip

    def print_recoveries(self) -> None:
        """The log line of each generation past the first, once its lead resumed training
        (it stores the line: the lead may run on another node)."""
        for g in range(self.printed + 1, self.gen + 1):
            timing = protocol.load_json(self.store.get(protocol.TIMING.format(g)))
            if timing is not None:  # an earlier one without a line never resumed
                print(printable(str(timing.get("line"))), flush=True)
                self.printed = g

    def publish(self, decision: dict) -> None:
        self.gen += 1
        # progress starts afresh: a key now means "copied and training"
        if "assignment" in decision:
            for w in self.procs:
                self.store.delete_key(protocol.PROGRESS.format(w))
            self.pause_progress()
            if self.chaos.enabled:  # in the store before any member can start a step of it
                self.hold(self.chaos.hold_step(copies=0, coming=self.coming()))
        protocol.publish(self.store, {"gen": self.gen, **decision})

    def _wait_exit(self, grace: float = 10.0) -> None:
        """Until every process has exited, for ``grace`` seconds in all; SIGKILL to those
        left, then at most ``KILL_WAIT_S`` more (a node that is gone reports no exit)."""
        deadline = time.monotonic() + grace
        left = [p for p in self.procs.values() if p.handle.poll() is None
                and (self.nodes.alive(p.node) or not p.dead)]  # fmt: skip
        for p in left:  # (one lost with its node is skipped: no exit will be reported)
            if p.dead:  # expelled (hung, or cut off) and still there: it holds nothing
                p.handle.signal(signal.SIGKILL)
        for p in left:
            try:
                p.handle.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.handle.signal(signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        for p in left:
            try:
                p.handle.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # on a node that is gone: nobody reports
                self.log("unreported exit", worker=p.worker, node=p.node)

    def fatal(self, word: dict) -> LaunchError:
        log = word.get("log")
        where = f" (details in {log})" if log and Path(log).is_file() else ""
        return LaunchError(word["message"] + where, code=word["code"], detail=word.get("detail"))

    def shutdown(self) -> None:
        """Within ``SHUTDOWN_S`` + ``KILL_WAIT_S`` + 2 s whatever the workers and nodes do
        (a SIGTERM to the launcher must end it in seconds): SIGCONT + SIGTERM to every
        process, SIGKILL to those left, and the agents' goodbyes."""
        self.store.set(nodes.STOP, "1")  # the agents end once their workers have
        for p in self.procs.values():
            if p.handle.poll() is None:
                p.handle.signal(signal.SIGCONT)  # an expelled worker still stopped, say
                p.handle.signal(signal.SIGTERM)
        self._wait_exit(SHUTDOWN_S)
        alive = [n for n in range(1, self.nnodes) if self.nodes.alive(n)]
        nodes.wait_agents(self.store, alive, timeout=2.0)  # then the store may go
        self.events.close()


class _Finished(Exception):
    pass


def node_slots(assignment) -> dict[int, int]:
    """{worker: its place k in the run's node order}: node k // (workers per node), local
    rank k % (workers per node). Pipeline by pipeline (replica by replica), so that a node
    holds whole pipelines and losing it leaves the other pipelines' copies. The grid's own
    rank order puts a stage on a node instead: --dp 2 --pp 2 on two nodes is workers 0, 2
    (pipeline 0) and 1, 3 (pipeline 1), ranks 0, 1 (stage 0 of both) on node 0 -- a node
    lost would take every copy of a stage.

    >>> from plait.resilience.assignment import Assignment, Pipeline
    >>> two = ((0, 1), (1, 2))
    >>> node_slots(Assignment(n_layers=2, tied=False, pipelines=(
    ...     Pipeline(workers=(0, 2), stages=two, rows=(0, 4)),
    ...     Pipeline(workers=(1, 3), stages=two, rows=(4, 8)))))
    {0: 0, 2: 1, 1: 2, 3: 3}
    """
    return {w: k for k, w in enumerate(w for p in assignment.pipelines for w in p.workers)}


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"exit code {code}"


def coordinate(cfg: RunConfig, *, nnodes: int = 1, endpoint: str | None = None) -> None:
    """Run a resilient training run to its end; raise LaunchError with one line if it
    cannot go on. With ``nnodes`` > 1 the other nodes' launchers run ``nodes.serve``."""
    (Path(cfg.out) / "logs").mkdir(parents=True, exist_ok=True)
    coord = Coordinator(cfg, nnodes=nnodes, endpoint=endpoint)
    try:
        coord.run()
        coord._wait_exit()
    except _Finished:
        pass
    finally:
        coord.print_recoveries()
        coord.shutdown()
        if nnodes > 1:  # the agents have read it; the run's secret dies with the run
            (Path(cfg.out) / signed_store.SECRET_FILE).unlink(missing_ok=True)
