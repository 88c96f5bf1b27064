"""How much a ZeRO-3 rank holds while its trainer builds (issue 25): the growth of each
process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) over
``Trainer(cfg, topo)`` -- model, engine and optimizer -- beside the model state it keeps.

    python benchmarks/zero3_build_memory.py                       # gpt3-350m, --dp 8
    python benchmarks/zero3_build_memory.py --model gpt3-125m --dp 4

Real gloo processes (one thread each), the embedded corpus, ``--zero 3``. A build that
holds the whole fp32 model before sharding it peaks near the model's bytes plus a shard;
one that fills each shard from the parameters' initial values one at a time
(``transformer.hollow`` + ``zero_units.initial_value``) peaks near the state it keeps.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GiB = 2**30


def _peak_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])
    return 0


def _worker(rank: int, world: int, port: int, model: str, out: str, q) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from plait.cli_args import layout_config, model_config
    from plait.data import DataConfig
    from plait.topology import Topology
    from plait.train.config import RunConfig, TrainConfig
    from plait.train.loop import Trainer

    cfg = RunConfig(
        model=model_config({"model": model, "seq_len": 64}),
        layout=layout_config({"dp": world, "zero": 3, "global_batch_size": world}),
        data=DataConfig(), train=TrainConfig(steps=1, progress=False), out=f"{out}/{rank}",
    )  # fmt: skip
    topo = Topology.build(pp=1, dp=world, tp=1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from what is held now
    before = _peak_kib()
    trainer = Trainer(cfg, topo=topo)
    grew = (_peak_kib() - before) * 1024
    whole = sum(p.numel() for p in trainer.model.parameters()) * 4
    q.put((rank, grew, trainer.engine.model_state_bytes()["total"], whole))
    trainer.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-350m")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--out", default="/tmp/plait-zero3-build")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.dp, port, args.model, args.out, q))
             for r in range(args.dp)]  # fmt: skip
    for p in procs:
        p.start()
    rows = sorted(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    whole = rows[0][3]
    print(f"{args.model} --dp {args.dp} --zero 3: the whole fp32 model is {whole / GiB:.2f} GiB")
    for rank, grew, state, _ in rows:
        print(f"rank {rank}: build peak growth {grew / GiB:.2f} GiB, model state kept "
              f"{state / GiB:.2f} GiB, ratio {grew / state:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
