"""What a rank holds while ``Trainer`` builds a ZeRO-3 run: its shards and one whole
tensor at a time, never the model. Rank 0 of a dp-8 layout under PyTorch's fake process
group, with real tensors on the CPU (the build's collectives write nothing), measured by
``MemTracker`` (every storage an operator makes, live or freed) -- the build ``plait
train`` runs, from ``--init-hf`` weights, with LoRA adapters and with QAT: the builds that
held the whole model until they were deferred like a seeded one (``hf.defer_into``,
``lora._init_adapters``). Communication: none between processes (one process, the fake
group completes every collective at once)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from plait import rehearse
from plait.commands.train import build_run_config
from plait.model import hf
from plait.model.config import ModelConfig
from plait.model.transformer import build_model
from plait.topology import Topology

CFG = ModelConfig(arch="llama", n_layers=8, hidden=64, n_heads=4, n_kv_heads=2,
                  ffn_hidden=176, vocab_size=512, seq_len=32)  # fmt: skip
DP = 8


@contextlib.contextmanager
def fake_world(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_config(values: dict):
    """A tiny llama at dp 8 under ZeRO-3 (fp32), with ``values`` on top."""
    return build_run_config({"model": "tiny", "arch": CFG.arch, "layers": CFG.n_layers,
                             "hidden": CFG.hidden, "heads": CFG.n_heads,
                             "kv_heads": CFG.n_kv_heads, "ffn_hidden": CFG.ffn_hidden,
                             "vocab_size": CFG.vocab_size, "seq_len": CFG.seq_len, "dp": DP,
                             "zero": 3, "global_batch_size": DP, "dtype": "fp32",
                             **values})  # fmt: skip


def build_peak(values: dict) -> int:
    """Bytes held at the peak of building rank 0's ``Trainer`` for ``values`` (dp 8,
    ZeRO-3, fp32): parameters, buffers and the build's temporaries."""
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = run_config(values)
    with fake_world(DP):
        topo = Topology.build(pp=1, dp=DP, tp=1)
        tracker = MemTracker()
        with tracker:
            trainer = rehearse._trainer_class(None)(cfg, topo=topo)
            # (meta's storages are sizes without bytes: a model built there, as ZeRO-3's is)
            peak = sum(snap["Total"] for dev, snap in tracker.get_tracker_snapshot("peak").items()
                       if dev.type != "meta")  # fmt: skip
        trainer.engine.close()
    return peak


def bound() -> tuple[int, int]:
    """(what rank 0 may hold at the build: its share of the model state -- fp32 weights and
    AdamW's two moments, 12 bytes a parameter over the dp ranks -- and four copies of the
    largest parameter in fp32 (read, cast, cut, packed); the whole model's fp32 bytes)."""
    sizes = [p.numel() * 4 for p in build_model(CFG, device="meta").parameters()]
    return 3 * sum(sizes) / DP + 4 * max(sizes), sum(sizes)


def test_zero3_build_from_hugging_face_weights_holds_one_tensor_beyond_its_shards(tmp_path):
    """``--init-hf`` at dp 8 under ZeRO-3: rank 0's build peaks at its share of the model
    state plus a few copies of one tensor (read, cast, cut), and its shards hold the file's
    values. Catches reading every weight first (``hf.load``: the whole model in fp32 on
    every rank, 280 GB at 70B -- what the build did), the model built whole because the
    weights come from a file, and a deferred read given another parameter's name."""
    most, whole = bound()
    assert most < whole  # the bound excludes the whole model
    model = build_model(CFG, seed=7)
    hf.save(tmp_path / "hf", dict(model.named_parameters()), CFG)
    peak = build_peak({"init_hf": str(tmp_path / "hf")})
    assert peak <= most, (peak, most, whole)

    # the values: rank 0 holds the first eighth of each parameter (flattened, as
    # ``flat.zero_shard`` cuts it), equal to the file's
    with fake_world(DP):
        trainer = rehearse._trainer_class(None)(run_config({"init_hf": str(tmp_path / "hf")}),
                                                topo=Topology.build(pp=1, dp=DP, tp=1))  # fmt: skip
        held = trainer.engine.held_state()
        for name, p in model.named_parameters():
            mine = held[f"model/{name}"].flat.reshape(-1)
            k = min(mine.numel(), p.numel())
            assert k == math.ceil(p.numel() / DP), name
            assert torch.equal(mine[:k], p.detach().reshape(-1)[:k]), name
        trainer.engine.close()


def test_zero3_build_of_a_lora_run_holds_one_tensor_beyond_its_shards():
    """LoRA at dp 8 under ZeRO-3: the base and the adapters are built on meta and filled
    shard by shard, so the build peaks at rank 0's share plus one tensor. Catches the
    whole base built on the CPU because adapters were attached to whole parameters (7B:
    25 GiB a rank at the build, 14 GiB in the step)."""
    most, whole = bound()
    peak = build_peak({"lora_rank": 4})
    assert peak <= most, (peak, most, whole)


def test_zero3_build_of_a_qat_run_holds_one_tensor_beyond_its_shards():
    """QAT (int8) at dp 8 under ZeRO-3 builds on meta too (its fake quantisation holds no
    weight): the build peaks at rank 0's share plus one tensor. Catches the whole model
    built on the CPU for QAT."""
    most, whole = bound()
    peak = build_peak({"qat": "int8"})
    assert peak <= most, (peak, most, whole)


def test_qat_under_zero3_starts_from_the_same_loss_as_without_zero():
    """One rank (gloo, world 1): QAT's first loss under ZeRO-3 (built on meta, filled shard
    by shard) equals ZeRO-0's (built whole), and differs from the same run without QAT.
    Catches QAT's fake quantisation lost on the meta-built layers, and the deferred
    initial values differing from the eager ones."""

    def first_loss(values: dict) -> float:
        cfg = run_config({"dp": 1, "global_batch_size": 2, **values})
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            trainer = rehearse._trainer_class(None)(cfg, topo=Topology.build(pp=1, dp=1, tp=1))
            loss = trainer.step(0)["loss"]
            trainer.engine.close()
        finally:
            dist.destroy_process_group()
        return loss

    zero3 = first_loss({"qat": "int8", "zero": 3})
    assert zero3 == first_loss({"qat": "int8", "zero": 0})
    assert zero3 != first_loss({"zero": 3})
