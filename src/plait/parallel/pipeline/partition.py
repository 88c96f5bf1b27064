"""Layers -> pipeline stages: which contiguous blocks each virtual stage holds.

Communication: none. The partition fixes where the pipeline's point-to-point messages
happen (between consecutive stages, see ``schedules.py``) but not their size.

Stages are virtual stages (``--pp x --vpp`` of them, in ``schedules.virtual_stage``
order); stage 0 also holds the token embedding, the last stage the final norm, the output
head and the loss. Three ways to cut L layers into S stages, each stage getting at least
one layer:

- ``uniform``: as even as possible. When S does not divide L, the extra layers go to
  the stages nearest the middle, earlier first on a tie, so the two ends — the first
  stage holds the most in-flight activations under 1F1B, the last the vocabulary-sized
  head — are the lighter ones. 22 layers on 4 stages: 5, 6, 6, 5; 21: 5, 6, 5, 5;
  23: 6, 6, 6, 5.
- ``balanced``: minimise the most expensive stage, given a cost per layer plus
  ``first_extra`` on stage 0 and ``last_extra`` on the last stage (exact, by dynamic
  programming over contiguous splits). Among the optimal splits it takes the one with the
  most even stage costs (least sum of squares), then the one closest to ``uniform``: with
  equal layer costs and no extras it *is* ``uniform``.
- ``explicit``: the user's ``--pp-layout 5,6,6,5`` (layers per stage), checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.model.config import ModelConfig

METHODS = ("uniform", "balanced", "explicit")


def partition_layers(
    n_layers: int,
    num_stages: int,
    *,
    method: str = "uniform",
    layer_costs: Sequence[float] | None = None,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    explicit: Sequence[int] | None = None,
) -> list[range]:
    """Split layers 0..n_layers-1 into ``num_stages`` contiguous ranges, stage order.

    ``layer_costs`` (default: 1 per layer), ``first_extra`` and ``last_extra`` are read by
    ``balanced`` only, in any one unit (``stage_costs_from_model`` gives FLOPs);
    ``explicit`` (layers per stage) by ``explicit`` only. Raises ValueError with one line.
    """
    if method not in METHODS:
        raise ValueError(f"partition method {method!r} is unknown; choose one of {METHODS}")
    if n_layers < 1:
        raise ValueError(f"--layers must be at least 1, got {n_layers}")
    if num_stages < 1:
        raise ValueError(f"--pp x --vpp must be at least 1 stage, got {num_stages}")
    if method == "explicit":
        if explicit is None:
            raise ValueError("method='explicit' needs explicit= (the --pp-layout counts)")
        return _ranges(_check_explicit(n_layers, num_stages, explicit))
    if explicit is not None:
        raise ValueError(f"explicit= is only read with method='explicit', not {method!r}")
    if num_stages > n_layers:
        raise ValueError(
            f"--pp x --vpp = {num_stages} stages but the model has only {n_layers} layers; "
            f"use at most {n_layers} stages"
        )
    if method == "uniform":
        return _ranges(_uniform_counts(n_layers, num_stages))
    costs = [1.0] * n_layers if layer_costs is None else [float(c) for c in layer_costs]
    if len(costs) != n_layers:
        raise ValueError(f"layer_costs has {len(costs)} entries for {n_layers} layers")
    if min(costs) < 0 or first_extra < 0 or last_extra < 0:
        raise ValueError("layer costs and the first / last stage extras must be non-negative")
    return _ranges(_balanced_counts(costs, num_stages, first_extra, last_extra))


def stage_costs(
    parts: Sequence[range],
    layer_costs: Sequence[float],
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[float]:
    """Cost of each stage of a partition, counting the extras on the first and last."""
    out = [sum(layer_costs[i] for i in part) for part in parts]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def stage_costs_from_model(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(per-layer cost, embedding cost, head + loss cost) in training FLOPs per sequence.

    Read off ``plait.model.sizes.model_flops_per_token`` so that the parts add up to it
    exactly: a block is 6 FLOPs per matmul weight per token plus its attention, the head
    6 * vocab * hidden per token. The embedding is a lookup and does no matmul FLOPs, so
    its cost is 0 under that convention (the loss's softmax is likewise not counted);
    pass your own ``first_extra`` to ``partition_layers`` to weigh it otherwise.
    """
    # Imported here: ``plait.model``'s package init pulls in the torch model, and
    # ``partition_layers`` must stay importable without torch (the simulator uses it).
    from plait.model import sizes

    one, two = cfg.replace(n_layers=1), cfg.replace(n_layers=2)
    per_layer = sizes.model_flops_per_token(two, seq_len) - sizes.model_flops_per_token(
        one, seq_len
    )
    head = sizes.model_flops_per_token(one, seq_len) - per_layer
    return [per_layer * seq_len] * cfg.n_layers, 0.0, head * seq_len


# ---------------------------------------------------------------------------- helpers


def _ranges(counts: Sequence[int]) -> list[range]:
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def _check_explicit(n_layers: int, num_stages: int, explicit: Sequence[int]) -> list[int]:
    counts = [int(n) for n in explicit]
    shown = ",".join(map(str, counts))
    if len(counts) != num_stages:
        raise ValueError(
            f"--pp-layout {shown} has {len(counts)} entries; it needs one per stage "
            f"(--pp x --vpp = {num_stages})"
        )
    if min(counts) < 1:
        raise ValueError(f"--pp-layout {shown}: every stage needs at least 1 layer")
    if sum(counts) != n_layers:
        raise ValueError(
            f"--pp-layout {shown} sums to {sum(counts)}; it must sum to --layers {n_layers}"
        )
    return counts


def _uniform_counts(n_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(n_layers, num_stages)
    middle = (num_stages - 1) / 2
    favoured = sorted(range(num_stages), key=lambda s: (abs(s - middle), s))[:extra]
    return [base + (s in favoured) for s in range(num_stages)]


def _balanced_counts(
    costs: list[float], num_stages: int, first_extra: float, last_extra: float
) -> list[int]:
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, k: int) -> float:  # layers i..j-1 as stage k
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    # Pass 1: the optimal bottleneck. best[k][j]: least max cost of layers 0..j-1 on
    # stages 0..k; stage k must leave one layer for each later stage.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n - num_stages + 2):
        best[0][j] = cost(0, j, 0)
    for k in range(1, num_stages):
        for j in range(k + 1, n - num_stages + k + 2):
            best[k][j] = min(max(best[k - 1][i], cost(i, j, k)) for i in range(k, j))
    bottleneck = best[-1][n]
    limit = bottleneck + 1e-9 * max(abs(bottleneck), 1.0)

    # Pass 2: among splits within the bottleneck, least sum of squared stage costs, then
    # least distance of the stage boundaries from uniform's. Both add up stage by stage,
    # so the lexicographic minimum is exact by the same recursion.
    uniform_ends = [r.stop for r in _ranges(_uniform_counts(n, num_stages))]
    scale = max(bottleneck, 1e-300) ** 2
    score: list[dict[int, tuple[float, int]]] = [{} for _ in range(num_stages)]
    choice: list[dict[int, int]] = [{} for _ in range(num_stages)]
    for j in range(1, n - num_stages + 2):
        if cost(0, j, 0) <= limit:
            score[0][j] = (cost(0, j, 0) ** 2 / scale, abs(j - uniform_ends[0]))
    for k in range(1, num_stages):
        for j in range(k + 1, n - num_stages + k + 2):
            for i, (sq, dist) in score[k - 1].items():
                c = cost(i, j, k)
                if i >= j or c > limit:
                    continue
                cand = (sq + c * c / scale, dist + abs(j - uniform_ends[k]))
                if j not in score[k] or _better(cand, score[k][j]):
                    score[k][j], choice[k][j] = cand, i
    ends, j = [n], n
    for k in range(num_stages - 1, 0, -1):
        j = choice[k][j]
        ends.append(j)
    ends.reverse()
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


def _better(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """Lexicographic, with the float sums of squares equal within rounding."""
    if abs(a[0] - b[0]) > 1e-9 * max(a[0], b[0], 1e-300):
        return a[0] < b[0]
    return a[1] < b[1]
