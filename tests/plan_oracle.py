"""The test oracle of ``plait plan``'s search: every candidate layout simulated in closed
form, with no pruning, bounds or ordering of the search's own, so that the search can be
held against it on small spaces (tests/test_plan.py)."""

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
