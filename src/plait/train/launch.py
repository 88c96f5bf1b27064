"""``plait train``'s launcher: validates the run, prepares the data once, writes the
resolved ``config.yaml``, and starts dp x tp x pp workers through torchrun's engine
(``torch.distributed.run``: gloo on CPU, NCCL on CUDA). Multi-node runs pass
``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint`` through; each node then starts
world / nnodes workers.

The rendezvous store lives in this launcher's agent process, which outlives the workers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

from plait.train.config import RunConfig


class LaunchError(RuntimeError):
    """The workers failed; the message is the one line to show, ``code`` the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def torchrun_args(
    *, world: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None, config: Path
) -> list[str]:
    if world % nnodes:
        raise ValueError(f"--nnodes {nnodes} does not divide the {world} workers of the layout")
    args = ["--nproc-per-node", str(world // nnodes), "--max-restarts", "0"]
    if nnodes == 1 and rdzv_endpoint is None:
        args = ["--standalone", "--nnodes", "1", *args]
    else:
        if rdzv_endpoint is None:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT")
        args = [
            "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--master-addr", host, "--master-port", port, *args,
        ]  # fmt: skip
    return [*args, "--monitor-interval", "0.2", "-m", "plait.train.worker", "--config", str(config)]


def _quiet_torchrun() -> None:
    for name in ("torch.distributed", "torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(cfg: RunConfig, *, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint=None) -> None:
    """Run the workers of this node; raise LaunchError with one line if any failed."""
    from torch.distributed.run import get_args_parser, run

    out = Path(cfg.out)
    config_path = out / "config.yaml"
    status = out / "status"
    status.mkdir(parents=True, exist_ok=True)
    world = cfg.layout.world_size
    per_node = world // nnodes if world % nnodes == 0 else world
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    for r in ranks:  # only this node's: on a shared folder the other nodes write theirs
        for suffix in ("done", "error"):
            (status / f"rank-{r}.{suffix}").unlink(missing_ok=True)
    argv = torchrun_args(
        world=world,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        config=config_path,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_torchrun()
    failure = None
    try:
        run(get_args_parser().parse_args(argv))
    except BaseException as e:  # ChildFailedError, SignalException, KeyboardInterrupt
        failure = e
    errors = sorted(status.glob("rank-*.error"), key=lambda p: int(p.stem.split("-")[1]))
    reports = [json.loads(p.read_text()) for p in errors]
    finished = all((status / f"rank-{r}.done").exists() for r in ranks)
    if not reports and finished:
        return  # finished, whatever torchrun said about the exit (see worker.py)

    # Root cause first: bad input, then a crash or a collective that timed out (a hung
    # peer, which the agent then kills), then a rank that died without a word (killed),
    # and last the collective failures its peers saw as a consequence.
    def secondary(r):
        return "CollectiveError" in r["message"] and "Timed out" not in r["message"]

    reports.sort(key=lambda r: (r["code"] != 2, secondary(r)))
    if reports and (reports[0]["code"] == 2 or not secondary(reports[0])):
        first = reports[0]
        where = f" (logs in {out / 'logs'})" if first["code"] != 2 else ""
        raise LaunchError(first["message"] + where, code=first["code"])
    if isinstance(failure, KeyboardInterrupt):
        raise LaunchError("interrupted")
    silent = _describe(failure, reported={int(p.stem.split("-")[1]) for p in errors})
    if silent is None and reports:
        raise LaunchError(reports[0]["message"] + f" (logs in {out / 'logs'})")
    raise LaunchError((silent or "workers exited without finishing") + f"; see {out / 'logs'}")


def _describe(failure, *, reported: set[int]) -> str | None:
    """One line for a worker that died without writing its status (killed, crashed)."""
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
