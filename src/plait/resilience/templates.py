"""Pipeline templates (Oobleck, Jang et al. 2023): for every number of workers a pipeline
could have, its stages and their layers, planned once at start; and the choice of a
combination of templates for the workers alive.

Communication: none (pure planning; the coordinator runs it).

A template for ``s`` workers is an s-stage pipeline whose layers are balanced with the
simulator's per-layer costs (``sim.costs``: forward + backward of a transformer layer, the
embedding on the first stage, the final norm + head + loss on the last), and timed by the
simulator (``sim.simulate``, one pipeline of s stages taking the rows one pipeline takes
at the start). Templates exist from the smallest ``s`` whose stages fit in a device's
memory (``n_min``) to the largest that still leaves room for F + 1 pipelines.

Why any worker count down to (F + 1) x n_min is covered (Oobleck's argument): with
templates of every size from n_min to 2 n_min - 1, n >= n_min workers make q = n // n_min
pipelines of n_min workers, one of which also takes the r = n - q n_min < n_min left over
(n_min + r <= 2 n_min - 1 is a template too). With n >= (F + 1) n_min, q >= F + 1: every
layer keeps F + 1 copies. Larger templates may be faster and are planned too.

The combination for n workers maximises the summed throughput of its pipelines (rows a
second, from each template's simulated step), with at least ``min_pipelines`` of them
when that many fit; rows are then dealt out in proportion to throughput (``allocate``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.parallel.pipeline.partition import partition_layers


@dataclass(frozen=True, kw_only=True)
class Template:
    """An s-stage pipeline: ``stages[k]`` = (first layer, stop) of virtual stage k; ``iter_s``
    the simulated step time when it takes ``rows`` sequences a step. With ``vpp`` v > 1 the
    pipeline is interleaved: s x v chunks, stage i holding chunks i, i + s, ... (Megatron's
    order, ``schedules.virtual_stage``), run by the interleaved 1F1B schedule, which needs
    a multiple of s micro-batches; ``plain`` is the same s stages not interleaved, for a
    pipeline whose share of the batch is not such a multiple (``runnable``)."""

    stages: tuple[tuple[int, int], ...]
    iter_s: float
    rows: int
    fits: bool = True
    vpp: int = 1
    plain: Template | None = None

    @property
    def nodes(self) -> int:
        return len(self.stages) // self.vpp

    def runnable(self, micro_batches: int) -> Template:
        """This template for a pipeline of ``micro_batches`` micro-batches a step: itself,
        or its plain twin when the interleaved schedule cannot take that many."""
        if self.vpp > 1 and micro_batches % self.nodes:
            return self.plain
        return self

    @property
    def throughput(self) -> float:
        """Sequences a second."""
        return self.rows / self.iter_s


def layer_costs(model: ModelConfig, layout: Layout, hw) -> tuple[list[float], float, float]:
    """(seconds per layer, first-stage extra, last-stage extra) of one micro-batch's
    forward and backward, from the simulator's cost model."""
    from plait.sim import costs, get_runtime

    rt = get_runtime("plait")
    lc = costs.layer_cost(model, layout, hw, rt)
    re = lc.recompute * layout.recomputed_share(model.n_layers)  # --recompute-layers
    per_layer = lc.fwd + lc.bwd_input + lc.bwd_weight + re
    emb, head = costs.embedding_cost(model, layout, hw), costs.head_cost(model, layout, hw)
    first = emb.fwd + emb.bwd_input + emb.bwd_weight
    last = head.fwd + head.bwd_input + head.bwd_weight
    return [per_layer] * model.n_layers, first, last


def template_layout(layout: Layout, stages: int, rows: int, counts, *, vpp: int = 1) -> Layout:
    """The layout one pipeline of ``stages`` stages runs, taking ``rows`` sequences a step
    (dp 1: the other pipelines are not part of it; a stage is one node of ``layout.tp``
    devices); ``counts``: the layers of each virtual stage, ``vpp`` chunks a stage
    (interleaved 1F1B when more than one)."""
    schedule = layout.schedule if layout.schedule != "interleaved-1f1b" else "1f1b"
    if vpp > 1:
        schedule = "interleaved-1f1b"
    return layout.replace(
        dp=1,
        pp=stages,
        vpp=vpp,
        schedule=schedule,
        global_batch_size=rows,
        zero=0,
        zero_shard_group=None,
        offload_optimizer=False,
        pp_layout=tuple(counts) if stages > 1 else None,
    )


def build_templates(
    model: ModelConfig, layout: Layout, hw, *, max_nodes: int, rows: int
) -> dict[int, Template]:
    """Templates for 1 .. ``max_nodes`` stages (at least one layer per stage), keyed by
    their number of stages, ``rows`` sequences a step each; ``fits``: whether the
    simulator finds each stage within ``hw``'s memory. With ``--vpp`` v, a template of
    s >= 2 stages is interleaved (s x v chunks, each balanced by cost) when the model has
    the layers and ``rows`` make a multiple of s micro-batches; its ``plain`` twin is
    planned too."""
    per_layer, first, last = layer_costs(model, layout, hw)
    costs = dict(layer_costs=per_layer, first_extra=first, last_extra=last)
    out, v, mbs = {}, layout.vpp, layout.micro_batch_size
    for s in range(1, min(max_nodes, model.n_layers) + 1):
        plain = _template(model, layout, hw, stages=s, vpp=1, rows=rows, costs=costs)
        if v > 1 and s > 1 and s * v <= model.n_layers and (rows // mbs) % s == 0:
            chunked = _template(model, layout, hw, stages=s, vpp=v, rows=rows, costs=costs)
            out[s] = dataclasses.replace(chunked, plain=plain)
        else:
            out[s] = plain
    return out


def _template(model, layout, hw, *, stages: int, vpp: int, rows: int, costs) -> Template:
    from plait.sim import simulate

    parts = partition_layers(model.n_layers, stages * vpp, method="balanced", **costs)
    counts = [len(p) for p in parts]
    res = simulate(model, template_layout(layout, stages, rows, counts, vpp=vpp), hw,
                   exact=stages * rows <= 4096)  # fmt: skip
    return Template(stages=tuple((p.start, p.stop) for p in parts), iter_s=res.iter_time_s,
                    rows=rows, fits=res.fits, vpp=vpp)  # fmt: skip


def choose(
    n: int,
    templates: dict[int, Template],
    *,
    min_pipelines: int,
    max_pipelines: int,
) -> tuple[int, ...] | None:
    """The template sizes (largest first) for ``n`` workers with the greatest summed
    throughput, using at most n workers and at most ``max_pipelines`` pipelines (each
    needs a micro-batch); at least ``min_pipelines`` when that many fit, else as many as
    fit. None when not even one pipeline fits.

    Exact: dynamic programming over (workers used, pipelines) -- O(n x templates x
    pipelines), nothing for the sizes a run re-plans at."""
    sizes = sorted(templates)
    if not sizes or n < sizes[0]:
        return None
    kmax = min(max_pipelines, n // sizes[0])
    # best[k][u]: (throughput, sizes) of k pipelines using exactly u workers
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}]
    for k in range(1, kmax + 1):
        layer: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (thr, combo) in best[k - 1].items():
            for s in sizes:
                if combo and s > combo[-1]:
                    continue  # non-increasing sizes: each multiset once
                u = used + s
                if u > n:
                    break
                cand = (thr + templates[s].throughput, combo + (s,))
                if u not in layer or _better(cand, layer[u]):
                    layer[u] = cand
        if not layer:
            break
        best.append(layer)
    feasible = [k for k in range(1, len(best)) if best[k]]
    if not feasible:
        return None
    ks = [k for k in feasible if k >= min_pipelines] or [max(feasible)]
    options = [v for k in ks for v in best[k].values()]
    top = max(options, key=lambda v: (v[0], -len(v[1]), v[1]))
    return top[1]


def _better(a, b) -> bool:
    if not math.isclose(a[0], b[0], rel_tol=1e-12):
        return a[0] > b[0]
    return a[1] > b[1]  # a deterministic tie-break: larger templates first


def allocate(rows: int, micro_batch: int, throughputs: list[float]) -> list[int]:
    """Rows of the global batch for each pipeline: whole micro-batches, at least one each,
    as close to proportional to ``throughputs`` as whole micro-batches allow (largest
    remainder first, ties to the earlier pipeline). Sums to ``rows``."""
    units = rows // micro_batch
    p = len(throughputs)
    if units < p:
        raise ValueError(f"{p} pipelines need at least {p} micro-batches; the step has {units}")
    total = sum(throughputs)
    ideal = [units * t / total for t in throughputs]
    got = [max(1, math.floor(x)) for x in ideal]
    while sum(got) < units:
        got[max(range(p), key=lambda i: (ideal[i] - got[i], -i))] += 1
    while sum(got) > units:
        got[min((i for i in range(p) if got[i] > 1), key=lambda i: (ideal[i] - got[i], -i))] -= 1
    return [g * micro_batch for g in got]
