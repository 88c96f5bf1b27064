"""The gradient engines against their interface (``parallel/engine.py``'s protocols):
every protocol member exists on each engine class with a signature a caller of the
protocol can use. No processes; fails when an engine renames a method or its parameters."""

from __future__ import annotations

import functools
import inspect
from typing import Protocol

import pytest
from test_data_parallel import tiny

from plait.dp_algos.compressed_grads import Compression
from plait.model.transformer import build_model
from plait.parallel.data_parallel import DataParallel
from plait.parallel.engine import (
    DataParallelConfig,
    GradCompression,
    GradientEngine,
    ShardEngine,
    build_data_parallel,
)
from plait.parallel.expert_engine import ExpertDataParallel
from plait.parallel.zero import ZeroDataParallel
from plait.resilience.engines import ReplicaEngine, ShardedReplicaEngine
from plait.topology import Topology
from plait.train import optim
from plait.train.config import TrainConfig


def protocol_members(proto: type) -> dict[str, object]:
    """{name: function or annotation} declared by ``proto`` and the protocols it extends."""
    out = {}
    for cls in reversed(proto.__mro__):
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        out.update({n: t for n, t in getattr(cls, "__annotations__", {}).items()})
        out.update({n: f for n, f in vars(cls).items() if inspect.isfunction(f)})
    return {n: v for n, v in out.items() if not n.startswith("_")}


def signature_problem(name: str, spec, impl) -> str | None:
    """Why a call written against ``spec`` fails on ``impl`` (both unbound), or None."""
    want = list(inspect.signature(spec).parameters.values())[1:]  # without self
    have = list(inspect.signature(impl).parameters.values())[1:]
    by_name = {p.name: p for p in have}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in have)
    positional = [p for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(want):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if i >= len(positional) or positional[i].name != p.name:
                return f"{name}: positional parameter {p.name!r} missing or moved"
            got = positional[i]
        elif p.kind is p.KEYWORD_ONLY:
            got = by_name.get(p.name)
            if got is None or got.kind not in (got.POSITIONAL_OR_KEYWORD, got.KEYWORD_ONLY):
                if var_kw:
                    continue
                return f"{name}: keyword {p.name!r} not accepted"
        else:
            continue
        if p.default is not p.empty and got.default is got.empty:
            return f"{name}: {p.name!r} is optional in the protocol, required here"
    extra = [p.name for p in have if p.default is p.empty and p.name not in {q.name for q in want}
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip
    if extra:
        return f"{name}: requires {extra}, which the protocol does not pass"
    return None


def problems(cls: type, proto: type) -> list[str]:
    out = []
    for name, spec in protocol_members(proto).items():
        if not inspect.isfunction(spec):
            continue  # a data attribute: set per instance (checked below where cheap)
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            out.append(f"{name}: missing")
        elif not inspect.isfunction(impl):
            out.append(f"{name}: not a method")
        elif (why := signature_problem(name, spec, impl)) is not None:
            out.append(why)
    return out


ENGINES = [
    (DataParallel, ShardEngine),
    (ZeroDataParallel, ShardEngine),
    (ReplicaEngine, GradientEngine),
    (ShardedReplicaEngine, GradientEngine),
    (ExpertDataParallel, GradientEngine),
    (Compression, GradCompression),
]


@pytest.mark.parametrize("cls, proto", ENGINES, ids=[c.__name__ for c, _ in ENGINES])
def test_engine_implements_its_protocol(cls, proto):
    assert problems(cls, proto) == []


def test_the_checker_catches_a_rename_and_a_new_required_parameter():
    class Renamed(DataParallel):
        scale_grads_ = None

        def step(self, lr: float, extra) -> None: ...

        def grad(self, param): ...

        def held_state(self, *, shards: bool = False): ...

    found = problems(Renamed, ShardEngine)
    assert any(p.startswith("scale_grads_") for p in found)
    assert any(p.startswith("step: requires") for p in found)
    assert any(p.startswith("grad: positional parameter 'p'") for p in found)
    assert not any(p.startswith("held_state") for p in found)  # an optional extra is fine


def test_the_engine_protocols_nest():
    """Every member the trainer drives is also one of what ``dp_algos`` needs."""
    assert set(protocol_members(GradientEngine)) < set(protocol_members(ShardEngine))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_built_engines_hold_the_protocol_attributes(zero):
    """The data attributes too (set per instance): the factory's engines at dp = 1."""
    topo = Topology.build(pp=1, dp=1, tp=1)
    engine = build_data_parallel(
        build_model(tiny(), seed=0, topo=topo), topo=topo, cfg=DataParallelConfig(zero=zero),
        make_optimizer=functools.partial(optim.build_adamw, cfg=TrainConfig()),
    )  # fmt: skip
    assert isinstance(engine, ShardEngine) and isinstance(engine, GradientEngine)
    engine.close()
