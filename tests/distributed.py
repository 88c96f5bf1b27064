"""Run a function on N gloo worker processes and collect what each returns.

Starting processes is the expensive part of a multi-process test (importing torch), so a
test should start one group and check several things inside it.

    results = run_workers(4, _check_tp, layout)   # fn(rank, world, *args) -> picklable
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, result_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        out = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - shipped back to the test process
        out = ("error", traceback.format_exc())
    torch.save(out, os.path.join(result_dir, f"{rank}.pt"))
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)  # skip interpreter teardown (gloo can abort there)


def run_workers(world: int, fn, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return the per-rank results.
    ``fn`` must be importable (module level). Raises with the worker's traceback on error."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, fn, args, d)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(d, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"worker {r} produced no result (exit code {procs[r].exitcode})")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise RuntimeError(f"worker {r} failed:\n{value}")
            results.append(value)
        return results


def place_resume_checkpoint(rank: int, cfg) -> None:
    """Copy ``cfg.resume_from``'s checkpoint into the run's own folder (rank 0), then wait
    for it on every rank: the multi-run workers resume runs from earlier runs' saves."""
    import shutil
    from pathlib import Path

    src = getattr(cfg, "resume_from", None)
    if src is None:
        return
    if rank == 0:
        dst = Path(cfg.out) / "checkpoints" / Path(src).name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    if dist.is_initialized():
        dist.barrier()
