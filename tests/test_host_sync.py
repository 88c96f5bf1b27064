"""No device-wide synchronisation in the steady-state step: the pipeline executor reads
its CUDA timing events once they have completed (one step late), and the offloaded
optimizer waits for its device-to-host copies with one event, not ``torch.cuda.synchronize``.

There is no GPU here, so the CUDA branches run on CPU tensors with ``torch.cuda.Event``
replaced by a host-clock stand-in and ``torch.cuda.synchronize`` by a call that fails the
test: the code path that decides what to wait for is the real one.
"""

from __future__ import annotations

import contextlib
import functools
import time

import pytest
import torch

from plait.layout import Layout
from plait.model.config import preset
from plait.parallel.pipeline.executor import PipelineRunner, bubble_of
from plait.parallel.pipeline.stage import build_stage
from plait.parallel.zero import ShardedOptimizer
from plait.topology import Topology
from plait.train import optim
from plait.train.config import TrainConfig


class FakeEvent:
    """``torch.cuda.Event`` on the host clock; counts what would block the host."""

    waits = 0  # synchronize() calls: host waits for the device

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, end) -> float:
        assert self.t is not None and end.t is not None, "read before it completed"
        return (end.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize in the steady-state step")

    FakeEvent.waits = 0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    return FakeEvent


def test_bubble_of():
    assert bubble_of(0.75, 1.0) == 0.25
    assert bubble_of(1.2, 1.0) == 0.0  # clock skew never makes it negative
    assert bubble_of(0.0, 0.0) == 0.0


def test_pipeline_step_reads_its_cuda_events_without_waiting(fake_cuda):
    """The executor's CUDA timing, run with a stand-in event: no ``torch.cuda.synchronize``
    and no event wait in a step, and each step reports the bubble of the step before
    (whose events the loop's statistics sync has completed). Catches the per-step
    ``torch.cuda.synchronize`` before the events are read."""
    cfg = preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, vocab_size=256,
                 seq_len=32)  # fmt: skip
    layout = Layout(pp=1, global_batch_size=4, micro_batch_size=2)
    topo = Topology.single()
    stage = build_stage(cfg, layout, topo=topo, seed=0)
    runner = PipelineRunner(stage, topo=topo, layout=layout, seq_len=cfg.seq_len,
                            autocast=contextlib.nullcontext)  # fmt: skip
    runner.cuda_timing = True  # the branch a CUDA device takes
    ids = torch.randint(0, 256, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    step = functools.partial(runner.train_step, list(ids.split(2)), loss_scale=1.0,
                             tokens_global=4 * cfg.seq_len)  # fmt: skip
    step()
    assert runner.bubble_fraction == 0.0  # nothing completed before step 1 to report
    assert len(runner._unread) == 1
    step()
    first = runner.bubble_fraction  # step 1's, read while step 2's stay unread
    assert 0.0 < first < 1.0 and len(runner._unread) == 1
    assert fake_cuda.waits == 0


def test_offloaded_optimizer_waits_for_its_copies_with_one_event(fake_cuda):
    """ZeRO-Offload's step on a CUDA device (stand-in): one event wait before the host
    reads the gradients it copied down, none after the updated shards go back up, and no
    ``torch.cuda.synchronize``; the update is AdamW's. Catches a device-wide sync."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    shard = p.detach().clone()
    opt = ShardedOptimizer(
        [("w", p)], {p: shard}, offload=True, device=torch.device("cpu"),
        make_optimizer=functools.partial(optim.build_adamw, cfg=TrainConfig(lr=1e-2, warmup=0)),
    )  # fmt: skip
    opt.device = torch.device("cuda")  # the branch a CUDA device takes
    ref = torch.nn.Parameter(p.detach().clone())
    ref_opt = optim.build_adamw([("w", ref, ref)], TrainConfig(lr=1e-2, warmup=0))
    for _ in range(3):
        grad = torch.randn(8)
        opt.step(1e-2, {p: grad})
        ref.grad = grad
        for group in ref_opt.param_groups:
            group["lr"] = 1e-2
        ref_opt.step()
    assert fake_cuda.waits == 3  # one per step
    assert torch.equal(shard, ref.detach())
