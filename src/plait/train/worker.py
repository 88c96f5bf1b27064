"""Entry point of one worker process, started by the launcher through torchrun:
``python -m plait.train.worker --config OUT/config.yaml --liveness HOST:PORT``; under
``--fault-tolerance`` started by the resilience coordinator instead (RANK is then the
worker's id) and run by ``plait.resilience.elastic``.

The worker's stderr goes to ``OUT/logs/rank-K.log`` (appended): torch's warnings, C++ log
lines and tracebacks stay there, the terminal gets only the launcher's one line (and rank
0's progress on stdout). Through the launcher's store (``--liveness``, ``liveness.py``) the
worker beats from a side thread while it runs and leaves its last word: code 0 when its
work completed, or the exit code (2: the user's input; 130: interrupted; 1: anything else)
with one line for the user and the log file holding the traceback, or the traceback itself
when the log could not be written (a full disk). The launcher reads these instead of
torchrun's exit summary, so a gloo abort at interpreter exit after the work was done cannot
turn a finished run into a failed one, and N interleaved tracebacks never reach the
terminal.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import sys
import traceback
from pathlib import Path


def _parse(argv):
    # allow_abbrev=False: torchrun matches prefixes of its own options; ours must not.
    p = argparse.ArgumentParser(prog="plait-worker", allow_abbrev=False)
    p.add_argument("--config", required=True)
    p.add_argument("--liveness", help="HOST:PORT of the launcher's store (liveness.py)")
    return p.parse_args(argv)


def _log_to(path: Path) -> Path | None:
    """Send this process's stderr (file descriptor 2: Python and C++ alike) to ``path``,
    appending; None when it cannot be opened (stderr stays where it was)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError:
        return None
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    return path


def _append(log: Path | None, text: str) -> bool:
    """Whether ``text`` reached the log (a full disk may refuse it)."""
    if log is None:
        return False
    from plait.train.run_folder import open_nofollow

    try:
        with open_nofollow(log, "a") as f:
            f.write(text)
        return True
    except (OSError, ValueError):
        return False


def device_and_backend(local_rank: int, *, cuda: bool):
    """This worker's device, its process-group backend, and the extra arguments of
    ``init_process_group``: on a GPU machine the GPU of the worker's local rank, NCCL,
    and ``device_id`` (which binds the group to that GPU, so NCCL sets its communicators
    up on it rather than guessing); else the CPU and gloo."""
    import torch

    if cuda:
        device = torch.device("cuda", local_rank)
        return device, "nccl", {"device_id": device}
    return torch.device("cpu"), "gloo", {}


def _failure(e: BaseException, rank: int) -> tuple[int, str]:
    """(exit code, one line) for a worker's failure."""
    from plait.train.checkpoint import CheckpointError, CheckpointWriteError

    msg = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, KeyboardInterrupt):
        return 130, f"rank {rank}: interrupted"
    if isinstance(e, ValueError | CheckpointError):
        return 2, msg
    if isinstance(e, CheckpointWriteError):
        return 1, msg
    return 1, f"rank {rank}: {type(e).__name__}: {msg}"


def main(argv=None) -> int:
    from plait.train import liveness

    liveness.die_with_parent()  # first: a launcher killed now must not leave this process
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    log = _log_to(Path(args.config).parent / "logs" / f"rank-{rank}.log")
    code, msg, store = 0, "", None
    try:
        import torch

        from plait.train import liveness
        from plait.train.config import RunConfig

        if args.liveness:  # the launcher's store: for the last word, and heartbeats below
            store = liveness.connect(args.liveness)
        cfg = RunConfig.load(Path(args.config))
        if store is not None:  # from a side thread, into the store only
            stale = (cfg.resilience.heartbeat_timeout if cfg.resilience.enabled
                     else liveness.stale_after(cfg.train.collective_timeout))  # fmt: skip
            beat = liveness.interval_for(stale)
            liveness.Heartbeat(
                liveness.connect(args.liveness), rank=rank, interval=beat, pid=os.getpid()
            ).start()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))
        logging.basicConfig(level=logging.WARNING)
        import torch.distributed as dist

        from plait.topology import Topology

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device, backend, bind = device_and_backend(local_rank, cuda=torch.cuda.is_available())
        timeout = datetime.timedelta(seconds=cfg.train.collective_timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if cfg.resilience.enabled:  # generations of groups from the coordinator's store
            from plait.resilience import elastic

            elastic.run(cfg, address=args.liveness, store=store, worker=rank, device=device)
        else:
            if world > 1:
                dist.init_process_group(backend=backend, timeout=timeout, **bind)
            lay = cfg.layout
            topo = Topology.build(pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp, device=device,
                                  timeout=timeout)  # fmt: skip
            from plait.train.loop import train

            train(cfg, topo=topo)
        if store is not None:  # now, before a teardown that gloo has been seen to abort in
            liveness.report(store, rank, code=0)
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line for the user
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
        code, msg = _failure(e, rank)
        detail = traceback.format_exc()
        if not _append(log, detail):
            log = None
    finally:
        try:
            import torch.distributed as dist

            if code == 0 and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - shutting down; the report says it all
            pass
        try:
            if store is not None and code != 0:
                from plait.train import liveness

                liveness.report(store, rank, code=code, message=msg, log=log,
                                detail=None if log else detail)  # fmt: skip
        except Exception:  # noqa: BLE001 - the launcher is gone: the exit code is all there is
            pass
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip interpreter teardown: gloo has been seen to abort there after the work is done.
    os._exit(code)


if __name__ == "__main__":
    main()
