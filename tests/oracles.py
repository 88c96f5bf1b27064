"""The tests' oracles: exhaustive answers to what the planner and the partitioner optimise,
with no pruning, bounds or ordering of their own, so that they can be held against them on
small spaces (tests/test_plan.py, test_partition.py, test_resilience_assignment.py)."""

import itertools

from plait.parallel.pipeline.partition import stage_costs
from plait.sim import simulate
from plait.sim.search import Candidate, PlanRequest, candidates, make_layout


def brute_force(req: PlanRequest) -> list[tuple[float, Candidate]]:
    """Every layout that fits (and runs ``req.dp_algo``, if any), fastest first."""
    out = []
    for c in candidates(req):
        lay = make_layout(c, req)
        if req.dp_algo is not None:
            try:
                req.dp_algo.check_layout(lay)
            except ValueError:
                continue  # the algorithm does not run on this layout
        r = simulate(req.model, lay, req.hardware, runtime=req.runtime, exact=False,
                     dp_algo=req.dp_algo)  # fmt: skip
        if r.fits:
            out.append((r.iter_time_s, c))
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
