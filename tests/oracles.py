"""The tests' oracles: exhaustive answers to what the planner and the partitioner optimise,
with no pruning, bounds or ordering of their own, so that they can be held against them on
small spaces (tests/test_plan.py, test_partition.py, test_resilience_assignment.py)."""

import itertools

from plait.parallel.pipeline.partition import stage_costs
from plait.sim import simulate
from plait.sim.search import FEWEST_BLOCKS, Candidate, PlanRequest, candidates, make_layout
from plait.sim.simulate import layers_per_stage


def brute_force(req: PlanRequest) -> list[tuple[float, Candidate]]:
    """Every layout that fits (and runs ``req.dp_algo``, if any), fastest first. A layout
    that recomputes the fewest blocks that fit (``FEWEST_BLOCKS``) is every count from 1 to
    one short of the largest chunk's blocks, tried each; its fastest that fits stands for
    it, unless the layout fits recomputing nothing (then it is none)."""
    out = []
    for c in candidates(req):
        lay = make_layout(c, req)
        if req.dp_algo is not None:
            try:
                req.dp_algo.check_layout(lay)
            except ValueError:
                continue  # the algorithm does not run on this layout
        family = [c]
        if c.recompute_layers == FEWEST_BLOCKS:
            most = max(layers_per_stage(req.model, lay))
            family = [c._replace(recompute_layers=n) for n in range(1, most)]
            nothing = c._replace(recompute="none", recompute_layers=0)
            if simulate(req.model, make_layout(nothing, req), req.hardware, runtime=req.runtime,
                        exact=False, dp_algo=req.dp_algo).fits:  # fmt: skip
                continue
        fits = []
        for member in family:
            r = simulate(req.model, make_layout(member, req), req.hardware,
                         runtime=req.runtime, exact=False, dp_algo=req.dp_algo)  # fmt: skip
            if r.fits:
                fits.append((r.iter_time_s, member))
        if fits:
            out.append(min(fits))
    return sorted(out)


def brute_force_bottleneck(costs, s, first, last):
    """The least, over every cut of ``costs`` into ``s`` contiguous stages, of the costliest
    stage (``first`` / ``last``: the embedding's and the head's extra cost)."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = [0, *cuts, n]
        parts = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        worst = max(stage_costs(parts, costs, first_extra=first, last_extra=last))
        best = min(best, worst)
    return best
