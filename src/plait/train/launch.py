"""``plait train``'s launcher: validates the run, prepares the data once, writes the
resolved ``config.yaml``, and starts dp x tp x pp workers through torchrun's engine
(``torch.distributed.run``: gloo on CPU, NCCL on CUDA). Multi-node runs pass
``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint`` through; each node then starts
world / nnodes workers.

The rendezvous store lives in this launcher's agent process, which outlives the workers.
So does the liveness store (``liveness.py``): this node's workers beat into it and leave
their last word there, and a watchdog thread here kills a worker whose heartbeat stopped
for the collective timeout, so a hung worker ends the run in about that time, named.

Who can reach them (``docs/security.md``): both stores listen on one address only. The
liveness store on 127.0.0.1; the rendezvous store, which torchrun would bind on every
interface, is hosted here first (``liveness.listen``, multi-tenant) on 127.0.0.1 for one
node or on ``--rdzv-endpoint``'s address on node 0, and torchrun's static rendezvous shares
it (its workers' ``env://`` store is the same server). One node's gloo sockets go to the
loopback interface too (``GLOO_SOCKET_IFNAME=lo`` unless set). Every liveness message is
signed with a secret made here for this run (``signed_store.py``), handed to the workers in
their environment; a worker that stops responding is killed as this launcher's own child
process of that rank, never by a process id read from the store.

Signals: torchrun's agent installs handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT once it
starts the workers; on one it forwards the signal to the workers, waits up to
``SHUTDOWN_GRACE_S`` for them and raises ``SignalException``. Before that (data preparation,
rendezvous) the CLI's own handlers raise ``KeyboardInterrupt`` or ``Terminated``. Either way
the run ends with one line and the shell's convention: 130 for SIGINT, 143 for SIGTERM.

Communication: none through process groups (the workers' collectives are theirs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path

from plait import signed_store
from plait.errors import LaunchError
from plait.train.config import RunConfig

SHUTDOWN_GRACE_S = 5  # torchrun's wait between SIGTERM and SIGKILL (its default is 30 s)


class Terminated(BaseException):
    """A termination signal that arrived while torchrun's handlers were not installed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_terminated(signum, frame):
    raise Terminated(signum)


def torchrun_args(
    *,
    world: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    config: Path,
    liveness: str | None = None,
    rdzv_port: int | None = None,
) -> list[str]:
    """torchrun's arguments: a static rendezvous at ``rdzv_endpoint`` (node 0's address),
    or, on one node without it, at 127.0.0.1:``rdzv_port`` (the store this launcher hosts
    there: ``launch``)."""
    if world % nnodes:
        raise ValueError(f"--nnodes {nnodes} does not divide the {world} workers of the layout")
    args = ["--nproc-per-node", str(world // nnodes), "--max-restarts", "0"]
    host, port = rendezvous_address(nnodes, rdzv_endpoint)
    port = port or rdzv_port
    if port is None:
        raise ValueError("one node without --rdzv-endpoint needs the port of its own store")
    args = [
        "--nnodes", str(nnodes), "--node-rank", str(node_rank),
        "--master-addr", host, "--master-port", str(port), *args,
    ]  # fmt: skip
    worker = ["-m", "plait.train.worker", "--config", str(config)]
    if liveness:
        worker += ["--liveness", liveness]
    return [*args, "--monitor-interval", "0.2", *worker]


def rendezvous_address(nnodes: int, rdzv_endpoint: str | None) -> tuple[str, int | None]:
    """(host, port) of the rendezvous: ``--rdzv-endpoint``'s, or 127.0.0.1 and a free port
    (None) for one node without it."""
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        return "127.0.0.1", None
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT")
    return host, int(port)


def host_rendezvous(nnodes: int, rdzv_endpoint: str | None):
    """Node 0: the rendezvous store, listening on its address only (module docstring)."""
    from plait.train import liveness

    host, port = rendezvous_address(nnodes, rdzv_endpoint)
    if nnodes > 1:
        liveness.check_shared(host)
    try:
        return liveness.listen(host, port or 0, multi_tenant=True)
    except OSError as e:
        raise ValueError(f"--rdzv-endpoint {rdzv_endpoint}: node 0 cannot listen there "
                         f"({e.strerror or e}); give an address of this machine and a free "
                         "port") from None  # fmt: skip


NODE_0_WAIT_S = 900.0  # torchrun's own rendezvous join timeout


def wait_for_node_0(rdzv_endpoint: str, *, timeout: float = NODE_0_WAIT_S) -> None:
    """A node other than 0: wait until node 0's rendezvous accepts connections, trying once
    a second from Python. torchrun's store client retries inside C++ and, interrupted by
    SIGTERM, only retries again: a node started before (or without) node 0 could not be
    stopped for its 900 s. Between tries here the launcher's signal handlers run (SIGTERM
    exits 143). A one-line LaunchError after ``timeout``."""
    import socket
    import time

    host, port = rendezvous_address(2, rdzv_endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint}: node 0 did not answer "
                                  f"in {timeout:.0f} s; start node 0 there", code=2) from None  # fmt: skip
            time.sleep(1.0)


class _NoFollowHandler(logging.FileHandler):
    """A log file opened without following a link (``run_folder.open_nofollow``)."""

    def _open(self):
        from plait.train.run_folder import open_nofollow

        return open_nofollow(self.baseFilename, "a")


@contextlib.contextmanager
def _torch_logs_to(path: Path):
    """torch.distributed's log lines and Python warnings raised in this process go to
    ``path`` (never to the terminal); dropped if that file cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = _NoFollowHandler(path, delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        handler.handleError = lambda record: None  # a full disk must not print a traceback
    except OSError:
        handler = logging.NullHandler()
    loggers = [
        logging.getLogger(n) for n in ("torch.distributed", "py.warnings", "plait.signed_store")
    ]
    saved = [(lg.handlers, lg.propagate) for lg in loggers]  # torch's own: stderr
    for lg in loggers:
        lg.handlers, lg.propagate = [handler], False
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for lg, (handlers, propagate) in zip(loggers, saved):
            lg.handlers, lg.propagate = handlers, propagate
        handler.close()


def children_by_rank(parent: int | None = None) -> dict[int, int]:
    """{RANK: pid} of the worker processes that ``parent`` (this process) started: its
    children, found in /proc, each with the RANK of its environment."""
    parent = os.getpid() if parent is None else parent
    out = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid != parent:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        for item in env:
            if item.startswith(b"RANK=") and item[5:].isdigit():
                out[int(item[5:])] = int(entry.name)
    return out


def _kill(silence) -> None:
    """SIGKILL the worker of ``silence.rank``: this launcher's own child of that rank."""
    pid = children_by_rank().get(silence.rank)
    if pid is None:
        return  # it has exited meanwhile
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(cfg: RunConfig, *, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint=None) -> None:
    """Run the workers of this node; raise LaunchError with one line if any failed."""
    # one node: its process groups listen on the loopback interface too
    with _environment({"GLOO_SOCKET_IFNAME": "lo"} if nnodes == 1 else {}):
        if not cfg.resilience.enabled:
            return _launch(cfg, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
        # the coordinator starts and replaces the workers itself
        from plait.resilience.coordinator import coordinate

        if nnodes > 1 and rdzv_endpoint is None:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if node_rank > 0:  # this node's workers are started by node 0's coordinator
            return _serve_node(cfg, node=node_rank, endpoint=rdzv_endpoint)
        return coordinate(cfg, nnodes=nnodes, endpoint=rdzv_endpoint)


@contextlib.contextmanager
def _environment(values: dict, *, force: dict | None = None):
    """``values`` set in this process's environment where unset (``force``: set anyway)
    while the workers run (they inherit it), restored afterwards."""
    force = force or {}
    saved = {k: os.environ.get(k) for k in (*values, *force)}
    for k, v in values.items():
        os.environ.setdefault(k, v)
    os.environ.update(force)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch(cfg: RunConfig, *, nnodes: int, node_rank: int, rdzv_endpoint) -> None:
    """The workers of a run without --fault-tolerance, through torchrun (module docstring)."""
    from torch.distributed.run import get_args_parser, run

    from plait.train import liveness

    out = Path(cfg.out)
    world = cfg.layout.world_size
    per_node = world // nnodes if world % nnodes == 0 else world
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    secret = signed_store.new_secret()  # this node's: its liveness store is its own
    store = liveness.host(secret=secret)
    rdzv = host_rendezvous(nnodes, rdzv_endpoint) if node_rank == 0 else None
    if node_rank > 0:
        wait_for_node_0(rdzv_endpoint)
    argv = torchrun_args(
        world=world,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        config=out / "config.yaml",
        liveness=f"127.0.0.1:{store.port}",
        rdzv_port=rdzv.port if rdzv is not None else None,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_S))
    stale_s = liveness.stale_after(cfg.train.collective_timeout)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    log = out / "logs" / ("launcher.log" if node_rank == 0 else f"launcher-node-{node_rank}.log")
    failure = None
    # torchrun hands its environment down: the workers get the secret there
    # and this process's id: torchrun starts them from here, and they die with it
    force = {signed_store.ENV: secret.hex(), **liveness.parent_env()}
    with _torch_logs_to(log), _environment({}, force=force):
        watchdog = liveness.Watchdog(store, ranks=ranks, stale_s=stale_s).start(_kill)
        try:
            run(get_args_parser().parse_args(argv))
        except BaseException as e:  # ChildFailedError, SignalException, KeyboardInterrupt
            failure = e
        finally:
            watchdog.stop()
            for s, h in handlers.items():  # torchrun's would raise SignalException from now on
                signal.signal(s, h)
        error = outcome(
            reports=liveness.reports(store, ranks),
            silent=watchdog.silent,
            failure=failure,
            out=out,
            ranks=ranks,
            stale_s=stale_s,
        )
    del rdzv  # torchrun's store shared this server: it goes last
    if error is not None:
        raise error


def _serve_node(cfg: RunConfig, *, node: int, endpoint: str) -> None:
    """A node other than 0 of a resilient run: its agent (``resilience/nodes.py``)."""
    from plait.resilience import nodes
    from plait.train import liveness

    try:
        raw = liveness.connect_raw(endpoint, timeout=120.0)
    except Exception as e:  # noqa: BLE001 - TCPStore raises several kinds
        raise LaunchError(f"--rdzv-endpoint {endpoint}: no coordinator answers there "
                          f"({str(e).splitlines()[0][:120]}); start node 0 first") from None  # fmt: skip
    store = _join_run(raw, Path(cfg.out), endpoint)
    try:
        nodes.serve(store=store, config=Path(cfg.out) / "config.yaml", address=endpoint,
                    node=node, world=cfg.layout.world_size)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the coordinator is gone
        raise LaunchError(f"node {node}: lost the coordinator at {endpoint} "
                          f"({str(e).splitlines()[0][:120]}); node 0 reports the run") from None  # fmt: skip


def _join_run(raw, out: Path, endpoint: str, *, timeout: float = 60.0):
    """The coordinator's store, signed with the secret node 0 wrote into the shared run
    folder: read again until it verifies on ``ft/run`` (a shared file system may show
    the new file late), or a one-line LaunchError."""
    import time

    from plait.resilience import protocol

    deadline, why = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            secret = signed_store.read_secret(out)
            store = signed_store.SignedStore(raw, secret, on_reject=lambda *a: None)
        except signed_store.SecretError as e:
            why = str(e)
        else:
            if store.check([protocol.RUN]):
                return signed_store.SignedStore(raw, secret)  # refusals logged from now on
            why = f"{out / signed_store.SECRET_FILE} is not the secret of the run at {endpoint}"
        time.sleep(0.5)
    raise LaunchError(f"{why}; every node must share node 0's --out folder")


def outcome(*, reports, silent, failure, out: Path, ranks, stale_s: float) -> LaunchError | None:
    """The run's result from the workers' last words, the silent ranks the watchdog killed
    and torchrun's exception: None when every rank finished, else the LaunchError to show.
    Root cause first: a signal to the launcher, bad input, a rank that stopped responding,
    a crash or a collective that timed out, a rank killed without a word, and last the
    collective failures its peers saw as a consequence."""
    signum = _signal_of(failure)
    if signum is not None:
        return LaunchError(stopped_line(signum, out), code=128 + signum)
    failed = {r: x for r, x in sorted(reports.items()) if x["code"] != 0}
    if not failed and all(r in reports for r in ranks):
        return None  # finished, whatever torchrun said about the exit (see worker.py)
    user = [x for x in failed.values() if x["code"] == 2]
    if user:
        return LaunchError(user[0]["message"], code=2)
    if silent:
        s = silent[0]
        return LaunchError(
            f"rank {s.rank} stopped responding: no heartbeat for {s.silent_s:.1f} s "
            f"(--collective-timeout {stale_s:g}); killed it (pid {s.pid})" + _logs(out)
        )
    primary = [x for x in failed.values() if not _secondary(x)]
    if primary:
        return _error(primary[0], out)
    killed = _describe(failure, reported=set(reports))
    if killed is not None:
        return LaunchError(killed + _logs(out))
    if failed:
        return _error(next(iter(failed.values())), out)
    return LaunchError("workers exited without finishing" + _logs(out))


def _secondary(report: dict) -> bool:
    m = report["message"]
    return "CollectiveError" in m and "Timed out" not in m


def _error(report: dict, out: Path) -> LaunchError:
    log = report.get("log")
    where = f" (details in {log})" if log and Path(log).is_file() else ""
    return LaunchError(report["message"] + where, code=report["code"], detail=report.get("detail"))


def _logs(out: Path) -> str:
    logs = out / "logs"
    return f"; logs in {logs}" if logs.is_dir() and any(logs.iterdir()) else ""


def _signal_of(failure) -> int | None:
    if isinstance(failure, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(failure, Terminated):
        return failure.signum
    sigval = getattr(failure, "sigval", None)  # torchrun's SignalException
    return int(sigval) if sigval is not None else None


def stopped_line(signum: int, out: Path) -> str:
    """One line for a run stopped by a signal: where it was and what is kept."""
    from plait.train.checkpoint import latest

    what = "interrupted" if signum == signal.SIGINT else "terminated"
    line = f"{what} ({signal.Signals(signum).name})"
    step = _last_step(out / "metrics.jsonl")
    line += f" after step {step}" if step else " before the first step"
    ckpt = latest(out / "checkpoints")
    if ckpt is not None:
        return line + f"; {ckpt} is the newest checkpoint: --resume continues from it"
    return line + "; no checkpoint was written"


def _last_step(metrics: Path) -> int | None:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _describe(failure, *, reported: set[int]) -> str | None:
    """One line for a worker that died without a last word (killed, crashed)."""
    failures = [
        (rank, f) for rank, f in getattr(failure, "failures", {}).items() if rank not in reported
    ]
    # The agent SIGTERMs the survivors of a failure: the root cause is the other one.
    failures.sort(key=lambda item: (getattr(item[1], "exitcode", 0) == -signal.SIGTERM, item[0]))
    for rank, f in failures:
        code = getattr(f, "exitcode", None)
        if code is not None and code < 0:
            try:
                return f"rank {rank} was killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"rank {rank} exited with code {code} before finishing"
    return None
