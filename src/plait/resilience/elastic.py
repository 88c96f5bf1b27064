"""A worker of a resilient run: it trains generation after generation, as the coordinator
decides, and carries its state across them in memory.

One generation, from the worker's side::

    wait for the coordinator's decision (store)      -> assignment, step, moves, keep
    roll forward: a step whose statistics a peer has but this worker lost, applied
    form the generation's groups (gen{G} prefix)     -> Topology, replica groups
    Trainer.build on its place in the assignment        -> model, engine, runner
    copy state: keep what it holds, receive the rest (transfer.py) -- or restore the
      newest checkpoint (fallback) -- or start fresh (generation 0)
    steps: at each boundary one all-reduce asks "is a new generation wanted?"; then
      Trainer.step, metrics, evaluation, checkpoints
    on a communication error or at a wanted boundary: drop the generation, report
      (steps done, units held, whether its gradients are reduced, its last statistics)

Communication: the generation's (``generation.py``: the groups; ``transfer.py``: the state
copy; ``engines.py``: gradients; the pipeline executor and the trainer's statistics),
plus one world all-reduce (MAX) of two flags per step (leave; hold), and the store
(``protocol.py``, every message signed: ``signed_store.py``) between generations; the
generation's process groups are set up on the store's raw interface (torch's own keys). The side thread (``Watcher``) reads store keys and
issues no collective; on the coordinator's ``ft/abort`` it aborts the current generation's
groups (``Generation.abort``), which only makes the training thread's pending and later
collectives of that generation fail. A chaos hold repeats the flags' all-reduce on every rank alike
(each repeat is decided by the previous one's result), so the ranks' collectives still
match one for one.

Why nothing is left pending and why recovery cannot deadlock (under NCCL as on gloo):

- Every rank leaves a broken generation at a known point: the collective that failed, or
  that the coordinator's abort ended (a failure it declared: a silent or exited worker, a
  stalled step), raises in the training thread (this rank issues nothing after it), or, for a planned
  change, at a step boundary all ranks agree on by the flag's all-reduce (every rank
  has issued exactly the same collectives before it). The generation is then dropped
  at once (NCCL: communicators aborted, never reused; gloo: destroyed), which also makes
  the collectives peers still wait in fail within milliseconds (measured: 20-400 ms).
- The next generation is formed by all its members from the same decision, read from the
  store: the same groups in the same order (``generation.py``); the state copy is one
  batched point-to-point call per rank from one shared list (``transfer.py``); after it
  the step's collectives follow the usual order of the trainer.
- Agreement about where the run is needs no collective on a broken group: each worker
  reports through the store the steps whose update it applied. If a peer finished the
  statistics' all-reduce of step k (so every rank had entered it, after reducing its
  gradients) the coordinator hands its (|g|^2, loss) to the ranks that did not see the
  all-reduce end, and they apply step k's update themselves ("roll forward"); otherwise
  step k is redone by everyone. No completed step is lost, none is applied twice.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from plait import comm
from plait.resilience import async_checkpoint, engines, protocol, transfer
from plait.resilience.assignment import Assignment
from plait.resilience.generation import Generation, abort_partial
from plait.resilience.templates import template_layout
from plait.train import optim
from plait.train.config import RunConfig
from plait.train.loop import Part, StepStats, Trainer, record_of
from plait.train.metrics import MetricsWriter


def is_comm_failure(e: BaseException) -> bool:
    """A failure of communication (a peer died or hung), as opposed to a bug or bad input."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, comm.CollectiveError | dist.DistError | CheckpointException | TimeoutError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("Gloo", "gloo", "NCCL", "Connection", "connection", "Socket")
    )


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


EXPELLED_EXIT = 3  # the exit code of a worker that finds itself expelled (ft/abort)


class Watcher:
    """Side thread: reads ``ft/request``, ``ft/abort`` (and, with chaos, ``ft/hold``) ten
    times a second on a store client of its own. On ``ft/abort`` it aborts the current
    generation's groups (``Worker.abort``: NCCL's abort, or gloo's connections shut down),
    which issues nothing and only makes the training thread's collectives fail; it issues
    no collective itself (DESIGN.md section 8). Finding this worker among the expelled, it
    ends the process at once (``EXPELLED_EXIT``): a worker that was stopped or cut off
    while the run went on without it must not write."""

    def __init__(self, store, *, chaos: bool = False, worker: int = -1, on_abort=None):
        self.store, self.request, self.chaos = store, 0, chaos
        self.worker, self.on_abort = worker, on_abort
        self.hold = (-1, 0)  # (generation, step) of ft/hold
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="plait-watcher", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.request = protocol.requested(self.store)
                hold = protocol.hold(self.store) if self.chaos else None
                if hold is not None:
                    self.hold = hold
                gen, dead = protocol.aborted(self.store)
            except Exception:  # noqa: BLE001 - the coordinator is gone; the run is over
                return
            if self.worker in dead:
                expelled(self.worker, gen)
            if gen >= 0 and self.on_abort is not None:
                self.on_abort(gen)
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()


def expelled(worker: int, gen: int) -> None:
    """End this process now, writing nothing but one line to its own log: the coordinator
    declared it dead and generation ``gen`` went on without it."""
    import os
    import sys

    sys.stderr.write(f"worker {worker}: expelled (declared dead in generation {gen}); exiting\n")
    sys.stderr.flush()
    os._exit(EXPELLED_EXIT)


@dataclass
class Held:
    """The state this worker carries: the trainer whose state is complete and current,
    the steps applied to it, the units it holds."""

    trainer: Trainer | None = None
    done: int = 0
    units: frozenset = frozenset()


class Worker:
    """One worker process of a resilient run (module docstring)."""

    def __init__(self, cfg: RunConfig, *, store, watcher_store, worker: int, device):
        self.cfg, self.store, self.worker = cfg, store, worker
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.timeout = datetime.timedelta(seconds=cfg.train.collective_timeout)
        res = cfg.resilience
        self.chaos = bool(res.inject_failure or res.chaos_every)
        self._lock = threading.Lock()  # the current generation, between the two threads
        self.current: Generation | None = None  # set once formed, cleared before its drop
        self.watcher = Watcher(watcher_store, chaos=self.chaos, worker=worker,
                               on_abort=self.abort)  # fmt: skip
        self.held = Held()
        self.metrics_path = Path(cfg.out) / "metrics.jsonl"
        self.saver = None  # --async-checkpoint: this generation's writer
        self.t_error = 0.0
        self.in_step = False
        self.in_gen = -1  # the generation this worker is forming or training in
        self.left_gen = -1  # the newest generation this worker reported leaving
        self._abort_seen: dict[int, float] = {}  # generation -> when its abort was seen
        self._dumped: set[int] = set()

    def run(self) -> str:
        """Train until the run is finished; returns "finished" or the coordinator's reason
        to stop."""
        self.store.set(protocol.READY.format(self.worker), "1")
        seen = -1
        try:
            while True:
                d = protocol.wait_decision(self.store, after=seen)
                seen = d["gen"]
                if "stop" in d:
                    return d["stop"]
                assignment = Assignment.from_json(d["assignment"])
                if self.worker not in assignment.members:
                    continue  # a spare, or started after this decision: the next one
                if self.generation(d, assignment) == "finished":
                    return "finished"
        finally:
            self.watcher.stop()

    # -- the coordinator's word --------------------------------------------------------

    def abort(self, number: int) -> None:
        """From the watcher: generation ``number`` is broken; if it is this worker's
        current one, abort its groups (once), so that the training thread returns from the
        collective it waits in, with an error, and leaves as from any failure."""
        with self._lock:
            gen = self.current
            if gen is not None and gen.number == number and not gen.aborted:
                gen.abort()
        self._stuck(number)

    def _stuck(self, number: int) -> None:
        """A worker that has not left generation ``number`` 5 s after its abort is stuck
        where no abort reaches: its threads' stacks go to its log, once per generation,
        so that the coordinator's later "did not leave" has a where."""
        if number != self.in_gen or number <= self.left_gen:
            return
        first = self._abort_seen.setdefault(number, time.time())
        if time.time() - first > 5 and number not in self._dumped:
            import faulthandler
            import sys

            self._dumped.add(number)
            sys.stderr.write(f"worker {self.worker}: has not left generation {number} "
                             f"{time.time() - first:.1f} s after its abort; stacks:\n")  # fmt: skip
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def fence(self) -> None:
        """Before a write that only a member may make (metrics, checkpoint, report): exit
        if the coordinator has expelled this worker meanwhile (stopped, or cut off, and
        resumed since): its steps are the past of a generation that went on without it."""
        gen, dead = protocol.aborted(self.store)
        if self.worker in dead:
            expelled(self.worker, gen)

    # -- one generation --------------------------------------------------------------

    def generation(self, d: dict, assignment: Assignment) -> str:
        gen, why = None, None
        self.in_gen = d["gen"]
        if self.chaos:  # the hold the coordinator set before this decision, read now: the
            held = protocol.hold(self.store)  # watcher may not have polled it yet
            if held is not None and held[0] == d["gen"]:
                self.watcher.hold = held
        try:
            self._roll_forward(d.get("rollforward"))
            gen = Generation(store=self.store.raw, number=d["gen"], assignment=assignment,
                             worker=self.worker, backend=self.backend, device=self.device, timeout=self.timeout)  # fmt: skip
            with self._lock:
                self.current = gen
            t_formed = time.time()
            trainer, start, received = self._build(gen, assignment, d)
            t_copied = time.time()
            return self._steps(gen, trainer, start, d, (t_formed, t_copied, received))
        except BaseException as e:  # noqa: BLE001 - a failure of communication, or re-raised
            if not is_comm_failure(e):
                raise
            why, self.t_error = _line(e), time.time()
            if gen is not None and gen.aborted:
                why = f"aborted by the coordinator ({why})"
        return self._leave(gen, d["gen"], why)  # out of the except: the traceback is gone

    def _roll_forward(self, rf: dict | None) -> None:
        held = self.held
        if rf is None or held.trainer is None or held.done != rf["step"]:
            return
        if held.trainer.engine.reduced:
            stats = StepStats.from_json(rf)
            held.trainer.update(stats, lr=optim.lr_at(stats.step, self.cfg.train))
            held.done += 1

    def _build(self, gen: Generation, assignment: Assignment, d: dict) -> tuple[Trainer, int, int]:
        i, _ = assignment.place(self.worker)
        pipe = assignment.pipelines[i]
        layout = template_layout(
            self.cfg.layout, pipe.num_stages, pipe.rows[1] - pipe.rows[0],
            [b - a for a, b in pipe.stages], vpp=pipe.vpp,
        )  # fmt: skip
        if self.cfg.layout.zero == 3:  # built on meta, each shard made one parameter at a
            layout = layout.replace(zero=3)  # time (Trainer.build): never a whole stage
        part = Part(
            layout=layout,
            rows=pipe.rows,
            make_engine=engines.factory(gen, zero=self.cfg.layout.zero),
        )
        trainer = Trainer(self.cfg, topo=gen.topo, part=part)
        received = 0
        if d["start"] == "checkpoint":
            start = self._restore(trainer, first=d["gen"] == 0)
        elif d["start"] == "fresh":
            start = 0
        else:
            current = self.worker in d["current"]
            old = self.held.trainer if current else None
            keep = frozenset(d["keep"].get(str(self.worker), []))
            received = transfer.copy_state(gen=gen, moves=d["moves"], keep=keep, old=old,
                                           new=trainer)  # fmt: skip
            start = d["step"]
        if self.held.trainer is not None:
            self.held.trainer.close()
        self.held = Held(trainer=trainer, done=start, units=assignment.units_of(self.worker))
        return trainer, start, received

    def _restore(self, trainer: Trainer, *, first: bool) -> int:
        """The newest checkpoint that verifies (or --resume-from's, at the first start)."""
        tcfg = self.cfg.train
        if not first:
            tcfg = dataclasses.replace(tcfg, resume=True, resume_from=None)
        trainer.cfg = dataclasses.replace(self.cfg, train=tcfg)
        try:
            return trainer.restore()
        finally:
            trainer.cfg = self.cfg

    def _leave(self, gen: Generation | None, number: int, why: str | None) -> str:
        """Drop the generation at once, then report what this worker holds."""
        held = self.held
        engine = held.trainer.engine if held.trainer is not None else None
        if engine is not None:
            engine.close()  # its in-flight handles hold the groups too
        if self.saver is not None:  # no commit may race the next generation's saves
            self.saver.abandon()
            self.saver.wait()
            self.saver = None
        t_drop = time.time()
        with self._lock:  # the watcher aborts nothing of it from here on
            self.current = None
        alive = gen.drop() if gen is not None else abort_partial()
        stats = held.trainer.last_reduced() if held.trainer is not None else None
        if stats is not None and stats.step == held.done:
            held.done += 1  # the statistics came back, so the update was applied
            self.in_step = False  # and that step's work is kept
        report = {
            "done": held.done,
            "units": sorted(held.units),
            "reduced": bool(engine is not None and engine.reduced),
            "stats": stats.to_json() if stats is not None else None,
            "why": why or "left at a step boundary",
            "in_step": self.in_step,
            "t_error": self.t_error if why else t_drop,  # when it saw the failure
            "drop_s": time.time() - t_drop,
            "alive_groups": alive,  # of the dropped generation, still referenced (0)
            **(getattr(gen, "drop_times", None) or {}),
        }
        self.fence()
        protocol.report_left(self.store, number, self.worker, report)
        self.left_gen = max(self.left_gen, number)
        self.in_step = False
        return "left"

    # -- the steps of a generation ---------------------------------------------------

    def _steps(self, gen: Generation, trainer: Trainer, start: int, d: dict, times) -> str:
        tcfg, assignment = self.cfg.train, gen.assignment
        lead = gen.rank == 0
        metrics = MetricsWriter(
            self.metrics_path,
            enabled=lead,
            truncate_after=None if d["gen"] == 0 and not tcfg.resume else start,
        )
        if lead:
            self._fill_gap(metrics, start, d.get("last"))
        if start and _due(start, tcfg) and not _saved(self.cfg, start):
            trainer.save(start)  # the save of step ``start`` did not complete
        trainer.model.train()
        if self.cfg.resilience.async_checkpoint:
            self.saver = async_checkpoint.AsyncSaver(
                store=self.store, generation=d["gen"], rank=gen.rank, world=gen.world,
                root=Path(self.cfg.out) / "checkpoints", keep=tcfg.keep_checkpoints,
                timeout=tcfg.collective_timeout,
            )  # fmt: skip
        t_resumed = time.time()
        recovery = t_resumed - d["t_failure"] if d.get("t_failure") else None
        if lead and d["gen"] > 0:  # the coordinator prints the line (node 0's console)
            self.store.set(protocol.TIMING.format(d["gen"]), json.dumps(
                {"formed": times[0], "copied": times[1], "resumed": t_resumed,
                 "received": times[2],
                 "line": _recovery_line(d, assignment, times, t_resumed, start)}))  # fmt: skip
        for step in range(start, tcfg.steps):
            if self._boundary(gen, step + 1):
                return self._leave(gen, d["gen"], None)
            self._progress(step + 1, "step")
            self.in_step = True  # a failure from here on loses this step's work
            rec = trainer.step(step)
            self.in_step = False
            self.held.done = done = step + 1
            rec.update(
                world_size=gen.world, pipelines=len(assignment.pipelines), generation=d["gen"]
            )
            rec["recovery_s"] = recovery if step == start and recovery is not None else 0.0
            if done == tcfg.steps or (tcfg.eval_every and done % tcfg.eval_every == 0):
                self._progress(done, "eval")
                rec["val_loss"] = trainer.evaluate()
            if lead:
                self.fence()
            metrics.write(rec)
            if lead and tcfg.progress and (done % tcfg.log_every == 0 or done in (1, tcfg.steps)):
                print(f"step {done:>6}/{tcfg.steps}  loss {rec['loss']:.4f}  "
                      f"{rec['tokens_per_s']:,.0f} tok/s  ({gen.world} workers, "
                      f"{len(assignment.pipelines)} pipelines)", flush=True)  # fmt: skip
            if _due(done, tcfg):
                self._progress(done, "save")
                self._save(trainer, done)
        if self.saver is not None:
            self.saver.wait()  # rank 0: until the last checkpoint is committed
            if self.saver.error is not None:
                raise self.saver.error
        if self.cfg.resilience.verify_replicas:
            write_fingerprints(trainer, Path(self.cfg.out) / "logs" / f"replica-{self.worker}.json")
        return "finished"

    def _save(self, trainer: Trainer, step: int) -> None:
        self.fence()
        if self.saver is None:
            trainer.save(step)
            return
        if self.saver.error is not None:  # the previous asynchronous write failed
            raise self.saver.error
        meta = {"model": self.cfg.model.to_dict(), "loss_scale": trainer.scaler.state_dict()}
        self.saver.save(step, async_checkpoint.owned_state(trainer), meta)

    def _progress(self, step: int, phase: str) -> None:
        """The step this worker runs (or saves, or evaluates after), for the coordinator's
        step-progress watchdog and chaos: one store write per step."""
        self.store.set(protocol.PROGRESS.format(self.worker), f"{step} {time.time()} {phase}")

    def _boundary(self, gen: Generation, step: int) -> bool:
        """Whether every rank leaves the generation before ``step``: one all-reduce (MAX)
        of this rank's view of ``ft/request`` and of ``ft/hold``, so that all decide alike
        at the same step. While the maximum says hold (a chaos shot waits for a
        replacement: ``chaos.py``), every rank sleeps and repeats the all-reduce, so all
        run the same collectives until all see the release or the request to leave."""
        while True:
            g, s = self.watcher.hold
            flags = [
                float(self.watcher.request > gen.number),
                float(g == gen.number and 0 < s <= step),
            ]
            t = torch.tensor(flags, device=gen.device)
            comm.world_all_reduce(t, topo=gen.topo, op=comm.ReduceOp.MAX)
            leave, held = (bool(x) for x in t.tolist())
            if leave or not held:
                return leave
            time.sleep(0.05)

    def _fill_gap(self, metrics: MetricsWriter, start: int, last: dict | None) -> None:
        """A step some worker completed whose record the old rank 0 did not write (it
        died, or it lost the statistics' all-reduce and rolled forward): its record from
        the statistics the decision carries."""
        if last is None or last["step"] + 1 != start:
            return
        steps = []
        if self.metrics_path.exists():
            steps = [json.loads(x)["step"] for x in self.metrics_path.read_text().splitlines() if x]
        if steps and steps[-1] >= start:
            return
        stats = StepStats.from_json(last)
        tokens = self.cfg.layout.global_batch_size * self.cfg.model.seq_len
        rec = record_of(stats, lr=optim.lr_at(stats.step, self.cfg.train), tokens=tokens)
        metrics.write({**rec, "completed_during_failure": True})


def write_fingerprints(trainer: Trainer, path: Path) -> None:
    """SHA-256 of every parameter and AdamW tensor this worker holds, by name: the
    coordinator compares the replicas' (``--verify-replicas``)."""
    import hashlib

    prints = {}
    for name, t in _state_tensors(trainer):
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        prints[name] = hashlib.sha256(data.tobytes()).hexdigest()
    from plait.train.run_folder import write_fresh

    write_fresh(path, json.dumps(prints))


def _state_tensors(trainer: Trainer):
    """(name, tensor) of what this worker holds: a ZeRO shard is named with its start, and
    with tensor parallelism every tensor with its tp rank, so that only workers holding
    the same shard are compared."""
    tp = f"#tp{trainer.topo.tp_rank}" if trainer.topo.tp > 1 else ""
    for key, held in sorted(trainer.engine.held_state().items()):
        yield (f"{key}@{held.lo}" if held.lo or held.flat.numel() < math.prod(held.shape)
               else key) + tp, held.flat  # fmt: skip


def _due(done: int, tcfg) -> bool:
    return done == tcfg.steps or bool(tcfg.save_every and done % tcfg.save_every == 0)


def _saved(cfg: RunConfig, step: int) -> bool:
    return (Path(cfg.out) / "checkpoints" / f"step-{step:08d}").is_dir()


def _recovery_line(d: dict, assignment: Assignment, times, t_resumed: float, start: int) -> str:
    t0 = d["t_failure"]
    formed, copied, received = times
    if d["start"] == "checkpoint":
        what = f"restarted from the checkpoint of step {start}"
    else:
        what = f"state copied +{copied - t0:.2f} s ({received / 2**20:.2f} MiB here)"
    return (
        f"plait: generation {d['gen']}: {d['why']}; detected +{d['t_detect'] - t0:.2f} s, "
        f"re-formed +{formed - t0:.2f} s, {what}, resumed +{t_resumed - t0:.2f} s at step "
        f"{start + 1} ({d['redone']} step(s) redone); {assignment.describe()}"
    )


def run(cfg: RunConfig, *, address: str, store, worker: int, device) -> str:
    """Entry point from ``plait.train.worker`` when ``--fault-tolerance`` is on."""
    from plait.train import liveness

    return Worker(cfg, store=store, watcher_store=liveness.connect(address), worker=worker,
                  device=device).run()  # fmt: skip
