"""Run a function on n gloo ranks of one thread each and collect what each returns: the
process launch the multi-process benchmarks share (``context_parallel.py``, ``moe.py``,
``checkpoint_memory.py``, ``data_parallel.py``).

    out = run_ranks("moe", worker, n, (kind, n, ep, steps))  # [worker(*args) of rank 0..n-1]

Each rank is a spawned process with ``MASTER_ADDR`` on loopback, a process group (of
n = 1 too), ``torch.set_num_threads(1)`` and large tensors in mappings of their own
(``MALLOC_MMAP_THRESHOLD_``: freed memory goes back to the OS, so resident-set peaks
measure what is held). A rank's result travels through ``torch.save`` into a private
temporary folder this process made (any picklable value); a rank that fails or dies ends
the benchmark with one line naming it (and the failure's traceback).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, port, worker, args, result_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        res = {"ok": worker(*args)}
    except BaseException:  # noqa: BLE001 - reported by the parent
        res = {"error": traceback.format_exc()}
    torch.save(res, Path(result_dir, f"{rank}.pt"))
    os._exit(0)


def run_ranks(name: str, worker, n: int, args: tuple) -> list:
    """``worker(*args)`` on each of ``n`` ranks (module docstring), in rank order."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, n, port, worker, args, d)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        out = []
        for r in range(n):
            path = Path(d, f"{r}.pt")
            if not path.exists():
                sys.exit(f"{name}: worker {r} died (exit code {procs[r].exitcode})")
            res = torch.load(path, weights_only=False)  # written by our own child, above
            if "error" in res:
                sys.exit(f"{name}: worker {r} failed:\n{res['error']}")
            out.append(res["ok"])
    return out


def bench_run(model, layout, steps: int, prefix: str):
    """A benchmark's ``RunConfig``: ``steps`` + 1 steps (the first a warm-up) of ``model``
    under ``layout`` on the embedded corpus with the bytes tokenizer, no evaluation or
    checkpoints, into a temporary folder named ``prefix``..."""
    from plait.data import DataConfig
    from plait.train.config import RunConfig, TrainConfig

    train = TrainConfig(steps=steps + 1, eval_every=0, eval_batches=1, progress=False,
                        save_every=10**9)  # fmt: skip
    return RunConfig(model=model, layout=layout, data=DataConfig(tokenizer="bytes"),
                     train=train, out=tempfile.mkdtemp(prefix=prefix))  # fmt: skip
