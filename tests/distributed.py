"""Run a function on N gloo worker processes and collect what each returns.

Starting processes is the expensive part of a multi-process test (importing torch), so a
test should start one group and check several things inside it.

    results = run_workers(4, _check_tp, layout)   # fn(rank, world, *args) -> picklable

Workers are forked from a fork server (multiprocessing's "forkserver") started once per
session, which has imported torch and the other heavy third-party modules (``_PRELOAD``)
and nothing else: each worker starts with them imported instead of importing them anew
(2-3 s of CPU a process, of every group, on a 2-core machine). As with "spawn", a worker
is a fresh process of its own -- no state of the test process, no thread, no CUDA context
-- that imports plait and the test module itself; it takes the test process's environment
at start (``_entry``), and writes to the test process's own stdout / stderr (the current
test's capture), as a spawned one does.
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


# third-party only (never plait: a module that failed to import there would take the fork
# server down with it; the workers import plait and report such a failure as usual)
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
            "torch.multiprocessing", "numpy", "yaml", "tokenizers"]  # fmt: skip


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: its first use
    return ctx


class _Std:
    """The test process's stdout and stderr as a worker receives them: the very file
    descriptions (shared offsets, as a spawned worker inherits them), passed to it through
    the fork server -- pytest's capture of the current test, not of the test that happened
    to start the server."""

    def __reduce__(self):
        from multiprocessing import reduction

        return tuple, ([reduction.DupFd(1), reduction.DupFd(2)],)  # while the worker starts


def _inherit(std, env: dict) -> None:
    """What a spawned worker would have had: the test process's environment now (the fork
    server's is that of its start) and its stdout / stderr (``_Std``)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, dup in zip((1, 2), std):
        got = dup.detach()
        os.dup2(got, fd)
        os.close(got)


def _entry(rank, world, port, fn, args, result_dir, std, env):
    _inherit(std, env)
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
        ctx = _context()
        port = _free_port()
        here = (_Std(), dict(os.environ))
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, fn, args, d, *here))
            for r in range(world)
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
