"""Peak memory of a checkpoint's save and load beside the training step's, per rank, in real
multi-process runs (issue 25: a save must not gather the model or optimizer whole).

    python benchmarks/checkpoint_memory.py          # ~2 minutes on 2 CPU cores

Two layouts of 4 gloo processes, the trainer ``plait train`` runs: ``--dp 4 --zero 3`` and
``--tp 2 --dp 2 --zero 1``; a GPT of 4 layers x 768 hidden and a vocabulary of 16,384 (40.8M
parameters: 653 MB of fp32 weights, gradients and AdamW state in all), 4 sequences of 64
tokens a step. Per rank, as the growth of the process's peak resident set over what it held
before (``VmHWM`` reset through ``/proc/self/clear_refs``; ``MALLOC_MMAP_THRESHOLD_`` set so
that freed tensors go back to the OS):

- train: building the trainer and two steps;
- save: ``Trainer.save`` (the DCP write and its manifest), over what the trained rank holds;
- load: building a fresh trainer and ``Trainer.restore`` (resuming the saved checkpoint).

and the ratios save / train and load / train. Before checkpoints were sharded, a save
gathered every parameter and AdamW moment whole on every rank (ZeRO-3: ~4x the rank's model
state at dp 4). Not a tensor tracker: ``torch.distributed._tools.mem_tracker`` does not see
the storages ZeRO-3 grows with ``untyped_storage().resize_()``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from data_parallel import PeakRSS  # the peak resident set of a block (benchmarks/)
from ranks import run_ranks  # n gloo ranks of one thread each (benchmarks/)

LAYOUTS = {"dp4-zero3": dict(dp=4, zero=3), "tp2-dp2-zero1": dict(tp=2, dp=2, zero=1)}


def run_config(layout: dict, out: Path, *, resume: bool):
    from plait.data import DataConfig
    from plait.layout import Layout
    from plait.model.config import preset
    from plait.train.config import RunConfig, TrainConfig

    model = preset("tiny", n_layers=4, hidden=768, n_heads=12, seq_len=64, vocab_size=16384)
    lay = Layout(global_batch_size=4 * layout["dp"], micro_batch_size=4, **layout)
    train = TrainConfig(steps=2, eval_every=0, eval_batches=1, progress=False, resume=resume,
                        keep_checkpoints=1, save_every=10**9)  # fmt: skip
    return RunConfig(model=model, layout=lay, data=DataConfig(tokenizer="bytes"), train=train,
                     out=str(out))  # fmt: skip


def worker(name: str, out: str) -> dict:
    from plait.data import prepare
    from plait.topology import Topology
    from plait.train.loop import Trainer

    layout = LAYOUTS[name]
    cfg = run_config(layout, Path(out), resume=False)
    prepare(cfg.data)  # the token cache, before anything is measured
    topo = Topology.build(pp=1, dp=layout["dp"], tp=layout.get("tp", 1))
    with PeakRSS() as train:
        trainer = Trainer(cfg, topo=topo)
        for step in range(2):
            trainer.step(step)
    with PeakRSS() as save:
        trainer.save(2)
    save_peak = save.base + save.peak - train.base  # the trained state and the save
    trainer.engine.close()
    del trainer
    with PeakRSS() as load:
        fresh = Trainer(run_config(layout, Path(out), resume=True), topo=topo)
        assert fresh.restore() == 2
    return {"train": train.peak, "save": save_peak, "load": load.peak}


def run(name: str) -> list[dict]:
    """Each of 4 ranks' figures for layout ``name`` (``worker``)."""
    with tempfile.TemporaryDirectory() as d:
        return run_ranks("checkpoint_memory", worker, 4, (name, str(Path(d) / "run")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated")
    args = ap.parse_args(argv)
    names = args.layouts.split(",")
    if unknown := [n for n in names if n not in LAYOUTS]:
        print(f"checkpoint_memory: --layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
        return 2
    t0 = time.time()
    mib = 2**20
    print(f"{'layout':<15} {'rank':>4} {'train MiB':>10} {'save MiB':>9} {'load MiB':>9} "
          f"{'save/train':>10} {'load/train':>10}")  # fmt: skip
    for name in names:
        for rank, r in enumerate(run(name)):
            print(f"{name:<15} {rank:>4} {r['train'] / mib:>10.1f} {r['save'] / mib:>9.1f} "
                  f"{r['load'] / mib:>9.1f} {r['save'] / r['train']:>10.2f} "
                  f"{r['load'] / r['train']:>10.2f}")  # fmt: skip
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
