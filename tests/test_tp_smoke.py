"""Smoke test of the harness: tp=2 forward/backward equals the single-process model."""

import torch

from distributed import run_workers
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.parallel.tensor import shard_spec, tp_gather
from plait.topology import Topology


def _tp_loss_and_grads(rank, world, arch):
    topo = Topology.build(pp=1, dp=1, tp=world)
    cfg = preset("tiny", arch=arch, n_layers=2, vocab_size=256, seq_len=16)
    model = build_model(cfg, seed=3, topo=topo)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], ids[:, 1:]).mean()
    loss.backward()
    grads = {n: tp_gather(p.grad, shard_spec(p), topo=topo) for n, p in model.named_parameters()}
    return loss.item(), grads, topo.stats.count("tp", "all_reduce")


def test_tp2_matches_single_process():
    for arch in ("gpt2", "llama"):
        cfg = preset("tiny", arch=arch, n_layers=2, vocab_size=256, seq_len=16)
        ref = build_model(cfg, seed=3)
        ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        ref_loss = ref(ids[:, :-1], ids[:, 1:]).mean()
        ref_loss.backward()
        results = run_workers(2, _tp_loss_and_grads, arch)
        for loss, grads, n_allreduce in results:
            assert abs(loss - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7)
            assert n_allreduce > 0
