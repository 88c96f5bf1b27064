"""Layers -> stages: uniform, balanced (optimal), explicit, and the errors users see."""

from __future__ import annotations

import random

import pytest
from oracles import brute_force_bottleneck

from plait.model import sizes
from plait.model.config import preset
from plait.parallel.pipeline.partition import (
    partition_layers,
    stage_costs,
    stage_costs_from_model,
)


def _counts(parts):
    return [len(r) for r in parts]


def _contiguous(parts, n_layers):
    return [i for r in parts for i in r] == list(range(n_layers)) and all(len(r) for r in parts)


@pytest.mark.parametrize(
    "n,s,expected",
    [
        (4, 2, [2, 2]),
        (3, 2, [2, 1]),
        (22, 4, [5, 6, 6, 5]),
        (21, 4, [5, 6, 5, 5]),
        (23, 4, [6, 6, 6, 5]),
        (7, 3, [2, 3, 2]),
        (8, 8, [1] * 8),
        (5, 1, [5]),
    ],
)
def test_uniform_puts_extra_layers_in_the_middle(n, s, expected):
    parts = partition_layers(n, s)
    assert _counts(parts) == expected
    assert _contiguous(parts, n)


def test_uniform_is_even_and_last_stage_never_heavier():
    for n in range(1, 30):
        for s in range(1, n + 1):
            counts = _counts(partition_layers(n, s))
            assert max(counts) - min(counts) <= 1 and sum(counts) == n, (n, s)
            assert counts[-1] == min(counts), (n, s)


def test_balanced_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        s = rng.randint(1, n)
        costs = [rng.choice([0.5, 1.0, 1.0, 2.0, 3.7]) for _ in range(n)]
        first, last = rng.choice([0.0, 0.3, 2.5]), rng.choice([0.0, 1.5, 4.0])
        parts = partition_layers(
            n, s, method="balanced", layer_costs=costs, first_extra=first, last_extra=last
        )
        assert len(parts) == s and _contiguous(parts, n)
        got = max(stage_costs(parts, costs, first_extra=first, last_extra=last))
        assert got == pytest.approx(brute_force_bottleneck(costs, s, first, last), rel=1e-12)


def test_balanced_with_equal_costs_is_uniform():
    for n in range(1, 25):
        for s in range(1, n + 1):
            assert partition_layers(n, s, method="balanced") == partition_layers(n, s)


def test_balanced_moves_layers_off_the_head_stage():
    # 8 equal layers on 4 stages; the head costs 1.5 layers: the last stage drops a layer
    # (1 + 1.5 = 2.5 < 2 + 1.5), the rest split as evenly as they can (two 2s and a 3),
    # with the boundaries closest to uniform's 2, 4, 6.
    parts = partition_layers(8, 4, method="balanced", last_extra=1.5)
    assert _counts(parts) == [2, 2, 3, 1]
    parts = partition_layers(8, 4, method="balanced", first_extra=1.5, last_extra=1.5)
    assert _counts(parts) == [1, 3, 3, 1]


def test_balanced_prefers_the_most_even_among_optimal_splits():
    # Bottleneck 6 can be met by 6,6,6,4 or 5,6,6,5; the second is more even.
    assert _counts(partition_layers(22, 4, method="balanced")) == [5, 6, 6, 5]


def test_explicit_layout():
    parts = partition_layers(22, 4, method="explicit", explicit=[5, 6, 6, 5])
    assert parts == [range(0, 5), range(5, 11), range(11, 17), range(17, 22)]


@pytest.mark.parametrize(
    "explicit,match",
    [
        ([5, 6, 6], "--pp-layout 5,6,6 has 3 entries; it needs one per stage"),
        ([5, 6, 6, 6], "--pp-layout 5,6,6,6 sums to 23; it must sum to --layers 22"),
        ([0, 6, 6, 10], "--pp-layout 0,6,6,10: every stage needs at least 1 layer"),
        ([-1, 7, 6, 10], "at least 1 layer"),
    ],
)
def test_explicit_layout_errors(explicit, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(22, 4, method="explicit", explicit=explicit)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((4, 8), {}, "--pp x --vpp = 8 stages but the model has only 4 layers"),
        ((4, 8), dict(method="balanced"), "8 stages but the model has only 4 layers"),
        ((4, 2), dict(method="greedy"), "choose one of"),
        ((4, 2), dict(method="explicit"), "needs explicit="),
        ((4, 2), dict(explicit=[2, 2]), "only read with method='explicit'"),
        ((4, 2), dict(method="balanced", layer_costs=[1, 1]), "2 entries for 4 layers"),
        ((4, 2), dict(method="balanced", layer_costs=[1, -1, 1, 1]), "non-negative"),
        ((0, 1), {}, "--layers must be at least 1"),
        ((4, 0), {}, "at least 1 stage"),
    ],
)
def test_errors_are_one_line(args, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        partition_layers(*args, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["tiny", "gpt3-1.3b", "llama2-70b"])
def test_stage_costs_from_model_add_up_to_the_size_formula(name):
    cfg = preset(name)
    layers, embedding, head = stage_costs_from_model(cfg, 512)
    assert len(layers) == cfg.n_layers and embedding == 0.0
    total = sum(layers) + embedding + head
    assert total == pytest.approx(512 * sizes.model_flops_per_token(cfg, 512), rel=1e-12)
    assert head == pytest.approx(512 * 6 * cfg.vocab_size * cfg.hidden, rel=1e-12)


def test_balanced_on_a_real_model_lightens_the_last_stage():
    cfg = preset("gpt3-1.3b")  # 24 layers; the 50k-vocabulary head weighs ~1.75 layers
    layers, embedding, head = stage_costs_from_model(cfg, 2048)
    parts = partition_layers(
        24, 8, method="balanced", layer_costs=layers, first_extra=embedding, last_extra=head
    )
    counts = _counts(parts)
    assert sum(counts) == 24 and counts[-1] < 3
    worst = max(stage_costs(parts, layers, first_extra=embedding, last_extra=head))
    uniform = max(stage_costs(partition_layers(24, 8), layers, last_extra=head))
    assert worst < uniform
