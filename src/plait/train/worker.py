"""Entry point of one worker process, started by the launcher through torchrun:
``python -m plait.train.worker --config OUT/config.yaml``.

Whatever happens, the worker leaves one status file in ``OUT/status/``: ``rank-K.done``
when its work completed, or ``rank-K.error`` holding the exit code (2: the user's input,
1: anything else) and one line for the user (the full traceback goes to
``OUT/logs/rank-K.log``). The launcher reads these instead of torchrun's
exit summary, so a gloo abort at interpreter exit after the work was done cannot turn a
finished run into a failed one, and N interleaved tracebacks never reach the terminal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import traceback
from pathlib import Path


def _parse(argv):
    # allow_abbrev=False: torchrun matches prefixes of its own options; ours must not.
    p = argparse.ArgumentParser(prog="plait-worker", allow_abbrev=False)
    p.add_argument("--config", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(args.config).parent
    status = out / "status"
    status.mkdir(parents=True, exist_ok=True)
    code = 0
    try:
        import torch

        from plait.train.config import RunConfig

        cfg = RunConfig.load(Path(args.config))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))
        logging.basicConfig(level=logging.WARNING)
        import torch.distributed as dist

        from plait.topology import Topology

        device = "cuda" if torch.cuda.is_available() else "cpu"
        timeout = datetime.timedelta(seconds=cfg.train.collective_timeout)
        if world > 1:
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="nccl" if device == "cuda" else "gloo", timeout=timeout)
        lay = cfg.layout
        topo = Topology.build(pp=lay.pp, dp=lay.dp, tp=lay.tp, device=device, timeout=timeout)
        from plait.train.loop import train

        train(cfg, topo=topo)
        (status / f"rank-{rank}.done").write_text("ok\n")
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line for the user
        from plait.train.checkpoint import CheckpointError

        user_error = isinstance(e, ValueError | CheckpointError)
        code = 2 if user_error else 1
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        (logs / f"rank-{rank}.log").write_text(traceback.format_exc())
        msg = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, KeyboardInterrupt):
            msg = f"rank {rank}: interrupted"
        elif not user_error:
            msg = f"rank {rank}: {type(e).__name__}: {msg}"
        (status / f"rank-{rank}.error").write_text(json.dumps({"code": code, "message": msg}))
    finally:
        try:
            import torch.distributed as dist

            if code == 0 and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - shutting down; the status file already says it all
            pass
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip interpreter teardown: gloo has been seen to abort there after the work is done.
    os._exit(code)


if __name__ == "__main__":
    main()
