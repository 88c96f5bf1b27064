"""Liveness of worker processes: heartbeats, a watchdog that names the rank that stopped,
and each worker's last word, all through a store its supervisor hosts.

Communication: none through process groups. Each worker's heartbeat thread sets one key of
a ``TCPStore`` hosted by the supervising process (the launcher; the resilience coordinator
later) every ``interval`` seconds, and the supervisor reads the keys. The store listens on
one address only (``listen``: loopback for a single node) and every key is signed with the
run's secret (``signed_store.py``): a message that does not verify is ignored. No
collective is issued from the side thread, and the training thread's collectives are not
touched, so nothing here can deadlock or reorder collectives under NCCL (DESIGN.md
section 8). The store lives in the supervisor, which outlives the workers (section 7).

Keys (``K`` a global rank)::

    liveness/pid/K     the worker's process id, set once at start: from then on it is watched
                       (shown to the user; a signal goes to the launcher's own child, never
                       to a pid read from the store)
    liveness/beat/K    a counter, +1 per heartbeat (a signed value: a stranger can neither
                       fake a beat nor replay an old one)
    liveness/status/K  the worker's last word (JSON): {"code": 0} when its work completed,
                       else the exit code, one line for the user, and where the detail is

Why staleness names the right rank: a rank blocked in a collective, waiting for a hung
peer, keeps beating (the wait releases the GIL); a frozen process (SIGSTOP, a machine
swapping itself to death, a driver call that never returns while holding the GIL) does not.
The watchdog times the counters with its own monotonic clock, so no two machines' clocks
are ever compared, and a status ends the watch (a finished worker stops beating).

**Workers never outlive their launcher.** A worker asks the kernel for SIGKILL when the
thread that started it dies (``die_with_parent``: Linux ``PR_SET_PDEATHSIG``), then checks
that its parent is still the process named in ``PLAIT_PARENT_PID`` (its launcher, or a
node's agent, sets it): a parent that died before the request leaves the worker adopted by
another process, and it exits at once. So a launcher killed with SIGKILL (the OOM killer,
an operator's ``kill -9``) takes its workers with it within milliseconds, instead of
leaving them holding GPUs and waiting in collectives. The signal follows the parent
*thread*: workers are started from the launcher's main thread.

Because the status travels through the store, a worker can report failures that leave no
room on disk for a file (a full or read-only file system), and a report belongs to the run
that hosts the store, never to another run on the same folder.
"""

from __future__ import annotations

import ctypes
import datetime
import ipaddress
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from plait.signed_store import SignedStore, secret_from_env

PID, BEAT, STATUS = "liveness/pid/{}", "liveness/beat/{}", "liveness/status/{}"
PARENT_ENV = "PLAIT_PARENT_PID"  # the process a worker must not outlive
PR_SET_PDEATHSIG = 1  # linux/prctl.h
MIN_STALE_S = 3.0  # below this, a busy machine's scheduling jitter would look like a hang


def parent_env() -> dict[str, str]:
    """The environment entry naming this process as its workers' parent (``die_with_parent``)."""
    return {PARENT_ENV: str(os.getpid())}


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent dies (module docstring); exit
    at once (code 1) if the parent named in ``PLAIT_PARENT_PID`` is already gone. False
    where it cannot be asked (not Linux, or no parent named): nothing is promised then."""
    expected = os.environ.get(PARENT_ENV, "")
    if not expected.isdigit():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl: not Linux
        return False
    if os.getppid() != int(expected):  # the parent died before the request: adopted
        os._exit(1)
    return True


def stale_after(collective_timeout: float) -> float:
    """Seconds without a heartbeat after which a rank is declared hung: the collective
    timeout (a rank silent that long fails its peers' collectives anyway), at least
    ``MIN_STALE_S``."""
    return max(float(collective_timeout), MIN_STALE_S)


def interval_for(stale_s: float) -> float:
    """Heartbeat period: five beats within the staleness limit, at most one a second."""
    return min(1.0, stale_s / 5)


def listen(host: str, port: int = 0, *, multi_tenant: bool = False):
    """A ``TCPStore`` server listening on ``host``'s address only (a ``TCPStore`` binds
    every interface by itself, whatever its host name): the socket is bound here and handed
    over. ``multi_tenant``: a later ``TCPStore(..., port, multi_tenant=True)`` in this
    process (torchrun's rendezvous) shares this server instead of binding its own."""
    from torch.distributed import TCPStore

    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return TCPStore(host.strip("[]"), port, is_master=True, wait_for_workers=False,
                    multi_tenant=multi_tenant, master_listen_fd=sock.detach(),
                    timeout=datetime.timedelta(seconds=30))  # fmt: skip


def check_shared(host: str) -> None:
    """ValueError (one line) when ``--rdzv-endpoint``'s host, given as a name, resolves on
    this machine to a loopback address (Debian maps its own hostname to 127.0.1.1): node 0
    would listen where no other node reaches it. An address given as such is taken as is."""
    name = host.strip("[]")
    try:
        ipaddress.ip_address(name)
        return
    except ValueError:
        pass
    try:
        resolved = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ValueError(f"--rdzv-endpoint {name}: cannot resolve it ({e.strerror or e})") from None
    if ipaddress.ip_address(resolved).is_loopback:
        raise ValueError(f"--rdzv-endpoint {name} is {resolved} on this machine, a loopback "
                         "address no other node reaches; give node 0's address on the "
                         "nodes' network")  # fmt: skip


def host(port: int = 0, *, bind: str = "127.0.0.1", secret: bytes, on_reject=None) -> SignedStore:
    """A store for the run's workers on ``bind``:``port`` (0: a free one), listening on
    that address only: loopback for one node, the ``--rdzv-endpoint`` interface for
    several; signed with the run's ``secret``."""
    return SignedStore(listen(bind, port), secret, on_reject=on_reject)


def connect(address: str, *, timeout: float = 30.0, secret: bytes | None = None) -> SignedStore:
    """A client of the supervisor's store at ``HOST:PORT``, signing with ``secret`` (by
    default this process's, from its launcher: ``signed_store.ENV``)."""
    secret = secret_from_env() if secret is None else secret
    return SignedStore(connect_raw(address, timeout=timeout), secret)


def connect_raw(address: str, *, timeout: float = 30.0):
    """A plain ``TCPStore`` client of ``HOST:PORT`` (a node agent's, before it has the
    run's secret)."""
    from torch.distributed import TCPStore

    host_name, _, port = address.rpartition(":")
    return TCPStore(host_name.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout))  # fmt: skip


class Heartbeat:
    """Worker side: a daemon thread that sets ``liveness/beat/K`` to 1, 2, 3 ... every
    ``interval`` seconds. Give it its own store client (a store client is one connection)."""

    def __init__(self, store, *, rank: int, interval: float, pid: int):
        self.store, self.rank, self.interval = store, rank, interval
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plait-heartbeat", daemon=True)
        store.set(PID.format(rank), str(pid))

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beats += 1
                self.store.set(BEAT.format(self.rank), str(self.beats))
            except Exception:  # noqa: BLE001 - the supervisor is gone: nobody to tell
                return
            self._stop.wait(self.interval)


@dataclass(frozen=True, kw_only=True)
class Silence:
    rank: int
    pid: int
    silent_s: float  # since its counter last moved, on the watchdog's clock


class Watchdog:
    """Supervisor side: finds the ranks whose heartbeat stopped for ``stale_s`` seconds.

    ``poll()`` is one look (used by tests with a fake clock); ``start(on_silent)`` polls
    from a thread and calls ``on_silent(Silence)`` once per silent rank."""

    def __init__(self, store, *, ranks, stale_s: float, clock=time.monotonic):
        self.store, self.ranks, self.stale_s, self.clock = store, list(ranks), stale_s, clock
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._pids: dict[int, int] = {}  # the ranks that started, and their word on their pid
        self.silent: list[Silence] = []
        self._stop = threading.Event()
        self._thread = None

    def poll(self) -> list[Silence]:
        now, found = self.clock(), []
        done = {s.rank for s in self.silent}
        for rank in self.ranks:
            if rank in done:
                continue  # already reported
            pid = self._pids.get(rank) or _int(self.store.get(PID.format(rank)))
            if pid is None:
                continue  # not started yet
            self._pids[rank] = pid  # watched from now on, whatever the key says later
            if self.store.check([STATUS.format(rank)]):
                continue  # it has said its last word
            last = self._seen.get(rank)
            beats = _int(self.store.get(BEAT.format(rank)))
            if beats is None:  # no beat yet (or a message that did not verify)
                beats = last[0] if last is not None else 0
            if last is None or beats != last[0]:
                self._seen[rank] = (beats, now)
            elif now - last[1] >= self.stale_s:
                found.append(Silence(rank=rank, pid=pid, silent_s=now - last[1]))
        self.silent += found
        return found

    def start(self, on_silent, *, every: float | None = None) -> Watchdog:
        every = every or interval_for(self.stale_s) / 2

        def run():
            while not self._stop.wait(every):
                try:
                    silences = self.poll()
                except Exception:  # noqa: BLE001 - store closing at shutdown
                    return
                for s in silences:
                    on_silent(s)

        self._thread = threading.Thread(target=run, name="plait-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _int(payload: bytes | None) -> int | None:
    return int(payload) if payload is not None and payload.isdigit() else None


def report(store, rank: int, *, code: int, message: str = "", log=None, detail=None) -> None:
    """A worker's last word: code 0 when its work completed; else the exit code, one line
    for the user, the log file holding the traceback (None when it could not be written)
    and, in that case, the traceback itself. Returns once the store holds it: a store's
    ``set`` is not answered, so a reader on another connection (the supervisor) could look
    before it lands; the read that follows on this connection is answered after it."""
    status = {"code": code, "message": message, "log": log and str(log), "detail": detail}
    store.set(STATUS.format(rank), json.dumps(status))
    store.get(STATUS.format(rank))


def reports(store, ranks) -> dict[int, dict]:
    """The last words of the ``ranks`` that said one (signed, and of the form ``report``
    writes: anything else is ignored)."""
    out = {}
    for r in ranks:
        word = _status(store.get(STATUS.format(r)))
        if word is not None:
            out[r] = word
    return out


def _status(payload: bytes | None) -> dict | None:
    try:
        word = json.loads(payload) if payload is not None else None
    except ValueError:
        return None
    ok = (
        isinstance(word, dict)
        and type(word.get("code")) is int
        and isinstance(word.get("message", ""), str)
        and all(isinstance(word.get(k), str | type(None)) for k in ("log", "detail"))
    )
    return word if ok else None
