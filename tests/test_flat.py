"""Flat buffers (``parallel/flat.py``): the layout of a tensor list in one buffer, and that
the stage-0 engine's gradients live in its buckets' buffers (views, no copies). No
processes: the rank-major rows are tested in ``test_zero.py``, the collectives on these
buffers in the multi-process tests of each engine."""

from __future__ import annotations

import functools

import torch
from test_data_parallel import tiny

from plait.model.transformer import build_model
from plait.parallel.engine import DataParallelConfig, build_data_parallel
from plait.parallel.flat import FlatLayout
from plait.topology import Topology
from plait.train import optim
from plait.train.config import TrainConfig


def test_offsets_follow_the_docstring_example():
    layout = FlatLayout([6, 2, 3])
    assert layout.offsets == [0, 6, 8] and layout.numel == layout.row_numel == 11
    rows = FlatLayout([10, 3], n=4, rank=3)
    assert rows.sizes == [3, 1] and rows.row_numel == 4 and rows.numel == 16
    assert rows.ranges == [(9, 10), (3, 3)]  # element 9 of the first, nothing of the second


def test_pack_views_unpack_round_trip():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 1)]
    layout = FlatLayout.of(tensors)
    flat = layout.pack(tensors)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))  # bit for bit
    for view, t in zip(layout.views(flat), tensors):
        assert torch.equal(view.view_as(t), t)
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    out = [torch.empty_like(t) for t in tensors]
    layout.unpack(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))


def test_pack_fills_missing_tensors_with_zeros_and_promotes_like_cat():
    a, b = torch.randn(4), torch.randn(3, dtype=torch.float64)
    layout = FlatLayout([4, 2, 3])
    flat = layout.pack([a, None, b])
    assert flat.dtype == torch.float64
    assert torch.equal(flat, torch.cat([a, torch.zeros(2), b]))
    like = torch.empty(0, dtype=torch.float32)
    assert layout.pack([a, None, b], like=like).dtype == torch.float32


def test_one_row_is_the_flat_layout():
    """n == 1 of the rank-major layout is the plain one: ZeRO with one rank per shard group
    lays gradients out as stage 0 does."""
    tensors = [torch.randn(5), torch.randn(2, 2)]
    one_row = FlatLayout.of(tensors, n=1, rank=0)
    flat = one_row.pack(tensors)
    assert torch.equal(one_row.pack_row([t.reshape(-1) for t in tensors], like=flat), flat)


def test_stage0_gradients_are_views_into_the_bucket_buffers():
    """After ``finish()`` every ``p.grad`` lives in its bucket's flat buffer -- what the
    all-reduce reduced, scaled in place by ``scale_grads_`` -- and the buffers hold exactly
    the gradients (no second copy)."""
    topo = Topology.build(pp=1, dp=1, tp=1)
    model = build_model(tiny(), seed=0, topo=topo)
    tcfg = TrainConfig(lr=1e-2, warmup=0)
    engine = build_data_parallel(
        model, topo=topo, cfg=DataParallelConfig(zero=0, bucket_mb=0.05),
        make_optimizer=functools.partial(optim.build_adamw, cfg=tcfg),
    )  # fmt: skip
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:]).mean().backward()
    engine.finish()
    buckets = engine.grads.buckets
    assert len(buckets) > 1
    for bucket in buckets:
        assert bucket.flat.numel() == sum(p.numel() for p in bucket.params)
        for p in bucket.params:
            assert p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    before = {p: p.grad.clone() for b in buckets for p in b.params}
    engine.scale_grads_(0.5)
    assert all(torch.equal(p.grad, g * 0.5) for p, g in before.items())
    engine.close()
