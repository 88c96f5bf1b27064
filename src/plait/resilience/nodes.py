"""Worker processes on several nodes: the coordinator (node 0's launcher) starts, signals
and watches workers on its own node directly and on every other node through that node's
launcher, the node agent (``plait train --nnodes N --node-rank K`` with K > 0).

Communication: none through process groups; only the coordinator's store, which node 0's
launcher hosts on ``--rdzv-endpoint`` (that address only) and every agent and worker reaches
there. Every key is signed with the run's secret (``signed_store.py``: the agent reads it
from ``.run-secret`` in the shared run folder and checks it on ``ft/run``); a value that
does not verify or parse is ignored. The keys (``{n}`` a node, ``{w}`` a worker id)::

    ft/node/{n}/spawn     "w:l,..."   set by the coordinator, the whole list each time: start
                                      worker w here, local rank l
    ft/signal/{w}         "9,19,..."  set by the coordinator, the whole list each time:
                                      deliver these signals (only SIGKILL, SIGSTOP, SIGCONT,
                                      SIGTERM), to the process this agent started as w
    ft/exit/{w}           returncode  set by the agent when the worker's process ended
    ft/nodes/stop         "1"         set by the coordinator: the run is over
    ft/node/{n}/done      "1"         set by the agent as it leaves (the store may go then)
    ft/node/{n}/beat      a counter   set by the agent every loop: the node is alive

An agent acts on the keys ten times a second; it touches no process group, so it holds
nothing NCCL could wait on. A dead worker is replaced on its own node (by that node's
agent), or, when that node is gone, on the least loaded node alive. A node is gone when its
agent's beat stops for ``--heartbeat-timeout``; its workers' heartbeats stop too, so each
is declared dead without an exit report (silent, or "lost with node n") -- the same path as
any death: the survivors abort their generation on the coordinator's ``ft/abort``, and
nothing needs to reach the lost node. Not covered: the coordinator's node dying ends the run (``docs/resilience.md``).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from plait import signed_store
from plait.train import liveness

SPAWN, SIGNALS, EXIT, STOP = "ft/node/{}/spawn", "ft/signal/{}", "ft/exit/{}", "ft/nodes/stop"
DONE, BEAT = "ft/node/{}/done", "ft/node/{}/beat"
POLL_S = 0.1
SIGNALS_SENT = {int(s) for s in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT, signal.SIGTERM)}


def worker_command(*, config: Path, address: str, worker: int, local_rank: int,
                   world: int, secret: bytes) -> tuple[list[str], dict]:  # fmt: skip
    """The command line and environment of worker ``worker`` (``plait.train.worker``):
    its device is ``local_rank``, wrapped onto this node's GPUs when it has fewer; the
    run's ``secret`` goes in the environment (readable by this user only), and this
    process's id: the worker dies with it (``liveness.die_with_parent``)."""
    import torch

    local_rank %= max(torch.cuda.device_count() if torch.cuda.is_available() else 1, 1)
    env = {**os.environ, "RANK": str(worker), "LOCAL_RANK": str(local_rank),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           signed_store.ENV: secret.hex(), **liveness.parent_env(),
           # NCCL: a failed or timed-out collective aborts its communicators and raises in
           # the training thread (2, CleanUpOnly), instead of ending the process (torch's
           # default, 3): recovery in place needs the process (docs/resilience.md)
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")}  # fmt: skip
    cmd = [sys.executable, "-m", "plait.train.worker", "--config", str(config),
           "--liveness", address]  # fmt: skip
    return cmd, env


def _numbers(store, key: str, width: int) -> list[tuple[int, ...]]:
    """A signed list "a:b,c:d,..." of ``width`` integers per item; [] when absent, refused
    or malformed (the whole list: it is written whole)."""
    payload = store.get(key)
    if payload is None:
        return []
    items = [x.split(b":") for x in payload.split(b",") if x]
    if not all(len(x) == width and all(v.isdigit() for v in x) for x in items):
        return []
    return [tuple(map(int, x)) for x in items]


class Local:
    """A worker process of this node."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.popen.pid, signum)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> None:
        self.popen.wait(timeout)


class Remote:
    """A worker process of another node, through that node's agent (module docstring)."""

    def __init__(self, store, worker: int):
        self.store, self.worker, self.pid = store, worker, None
        self.sent: list[str] = []

    def poll(self) -> int | None:
        payload = self.store.get(EXIT.format(self.worker))
        if payload is None or not payload.lstrip(b"-").isdigit():
            return None
        return int(payload)

    def signal(self, signum: int) -> None:
        self.sent.append(str(int(signum)))
        self.store.set(SIGNALS.format(self.worker), ",".join(self.sent))

    def wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.worker}", timeout)
            time.sleep(POLL_S)


def serve(*, store, config: Path, address: str, node: int, world: int, log=print) -> None:
    """Node ``node``'s agent: start the workers the coordinator asks for, deliver its
    signals, report exits, until the coordinator says the run is over (then wait for the
    workers to end) or its store is gone (then stop the workers: the run is over).

    The loop runs in a side thread (it touches the store only) while this thread waits in
    a call a signal interrupts: a store call to a coordinator that is cut off blocks in C++
    for the store's timeout, and a SIGTERM (the CLI raises ``Terminated``) must end the
    agent within seconds even then. Either way the workers this agent started are stopped
    (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) before it returns or raises. The side
    thread starts them, so it is the parent whose end their parent-death signal follows
    (``liveness.die_with_parent``): it ends only when the run is over for this node."""
    agent = _Agent(store=store, config=config, address=address, node=node, world=world, log=log)
    thread = threading.Thread(target=agent.run, name="plait-agent", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    finally:
        agent.stop_workers()
        thread.join(1.0)  # it sees ``stopping`` at its next look, unless a store call holds it
        if thread.is_alive():  # cut off: interpreter teardown would abort under its C++ call
            _exit_at_teardown(sys.exc_info()[1])
    if agent.error is not None:
        raise agent.error


STOP_GRACE_S = 2.0


def _exit_at_teardown(e: BaseException | None) -> None:
    """End the process right after the CLI has printed its line, skipping the teardown a
    thread blocked in a store call would abort (the exit code of the signal in ``e``)."""
    signum = getattr(e, "signum", signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
    code = 128 + int(signum) if signum is not None else 1

    def leave():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave)


class _Agent:
    def __init__(self, *, store, config: Path, address: str, node: int, world: int, log):
        self.store, self.config, self.address, self.node, self.world, self.log = (
            store, config, address, node, world, log)  # fmt: skip
        self.procs: dict[int, subprocess.Popen] = {}
        self.error: Exception | None = None
        self.lock = threading.Lock()  # no new process once the agent is stopping
        self.stopping = False

    def run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - the coordinator's store is gone: the run is over
            if not self.stopping:
                self.error = e

    def _loop(self) -> None:
        store, node = self.store, self.node
        delivered: dict[int, int] = {}
        reported: set[int] = set()
        beats = 0
        while not self.stopping:
            beats += 1
            store.set(BEAT.format(node), str(beats))
            for w, local_rank in _numbers(store, SPAWN.format(node), 2):
                if w not in self.procs:
                    cmd, env = worker_command(config=self.config, address=self.address, worker=w,
                                              local_rank=local_rank, world=self.world,
                                              secret=store.secret)  # fmt: skip
                    with self.lock:
                        if self.stopping:
                            return
                        self.procs[w] = subprocess.Popen(cmd, env=env)
                    self.log(f"plait: node {node}: started worker {w} (pid {self.procs[w].pid})")
            for w, p in list(self.procs.items()):  # only to the processes this agent started
                sigs = [s for (s,) in _numbers(store, SIGNALS.format(w), 1)]
                for signum in sigs[delivered.get(w, 0) :]:
                    if signum not in SIGNALS_SENT:
                        continue
                    try:
                        os.kill(p.pid, signum)
                    except ProcessLookupError:
                        pass
                delivered[w] = max(delivered.get(w, 0), len(sigs))
                if w not in reported and p.poll() is not None:
                    store.set(EXIT.format(w), str(p.returncode))
                    reported.add(w)
            if store.check([STOP]) and len(reported) == len(self.procs):
                store.set(DONE.format(node), "1")
                return
            time.sleep(POLL_S)

    def stop_workers(self) -> None:
        """SIGTERM (and SIGCONT, for a stopped one) to the workers still running, SIGKILL
        to those left after ``STOP_GRACE_S``; reaps them all."""
        with self.lock:
            self.stopping = True
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_agents(store, nodes, *, timeout: float) -> None:
    """Until every agent of ``nodes`` said it is done (or ``timeout`` seconds passed)."""
    deadline = time.time() + timeout
    for n in nodes:
        while not store.check([DONE.format(n)]) and time.time() < deadline:
            time.sleep(POLL_S)


class NodeWatch:
    """Coordinator side: which agents still beat (node 0, the coordinator's own, always).
    ``poll()`` every loop; a node is gone once its beat has not moved for ``stale_s``."""

    def __init__(self, store, *, nnodes: int, stale_s: float):
        self.store, self.stale_s = store, stale_s
        now = time.time()
        self.seen = {n: (-1, now) for n in range(1, nnodes)}  # (beats, when they changed)

    def poll(self) -> None:
        now = time.time()
        for n, (last, _) in self.seen.items():
            payload = self.store.get(BEAT.format(n))
            beats = int(payload) if payload is not None and payload.isdigit() else last
            if beats != last:
                self.seen[n] = (beats, now)

    def alive(self, node: int) -> bool:
        return node == 0 or time.time() - self.seen[node][1] < self.stale_s

    def fresh(self, node: int, within: float = 10 * POLL_S) -> bool:
        """Whether ``node``'s agent beat in the last ``within`` seconds (ten of its beats):
        where a replacement may go. A node whose workers fell silent together is often
        still "alive" by its last beat a moment longer; it gets no replacement."""
        return node == 0 or time.time() - self.seen[node][1] < within
