"""Rank arithmetic and layout validation (no processes); waits that an abort ends."""

import dataclasses
import threading
import time

import pytest

from plait.layout import Layout
from plait.model.config import preset
from plait.topology import Axis, Topology, axis_groups, coords, rank_of


def test_docstring_example_8_ranks():
    assert axis_groups(Axis.TP, pp=2, dp=2, tp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(Axis.DP, pp=2, dp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(Axis.PP, pp=2, dp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (2, 3, 4), (4, 1, 2), (3, 2, 1)])
def test_coords_round_trip_and_groups_partition(pp, dp, tp):
    world = pp * dp * tp
    for r in range(world):
        c = coords(r, pp=pp, dp=dp, tp=tp)
        assert (
            rank_of(pp_rank=c[Axis.PP], dp_rank=c[Axis.DP], tp_rank=c[Axis.TP], dp=dp, tp=tp) == r
        )
    for axis, size in ((Axis.PP, pp), (Axis.DP, dp), (Axis.TP, tp)):
        groups = axis_groups(axis, pp=pp, dp=dp, tp=tp)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only along this axis
            others = {
                tuple(v for a, v in coords(r, pp=pp, dp=dp, tp=tp).items() if a != axis) for r in g
            }
            assert len(others) == 1


def test_layout_errors():
    with pytest.raises(
        ValueError, match="--global-batch-size 10 is not divisible by --micro-batch-size 2 x --dp 2"
    ):
        Layout(global_batch_size=10, micro_batch_size=2, dp=2)
    with pytest.raises(ValueError, match="needs --schedule interleaved-1f1b"):
        Layout(vpp=2, pp=2)
    with pytest.raises(ValueError, match="multiple of --pp 4"):
        Layout(pp=4, vpp=2, schedule="interleaved-1f1b", global_batch_size=6)
    with pytest.raises(ValueError, match="--sequence-parallel needs --tp > 1"):
        Layout(sequence_parallel=True)
    model = preset("tiny")  # 4 layers, 4 heads, ffn 512
    with pytest.raises(ValueError, match="--tp 3 does not divide --heads 4"):
        Layout(tp=3).check_model(model)
    with pytest.raises(ValueError, match="only 4 layers"):
        Layout(pp=8).check_model(model)
    with pytest.raises(ValueError, match="--pp-layout"):
        Layout(pp=2, pp_layout=(1, 2)).check_model(model)
    llama = preset("tiny", arch="llama", n_heads=8, hidden=128, n_kv_heads=2)
    Layout(tp=4).check_model(llama)  # kv heads split 2 ways, each replicated twice: fine
    with pytest.raises(ValueError, match="--kv-heads"):
        Layout(tp=4).check_model(preset("tiny", arch="llama", n_heads=12, hidden=96, n_kv_heads=3))


def _shard_groups(rank, world):
    import datetime

    import torch

    from plait import comm
    from plait.topology import Topology

    topo = Topology.build(pp=1, dp=4, tp=1, timeout=datetime.timedelta(seconds=45))
    assert topo.shard_groups(4) == (topo, None)
    try:
        topo.shard_groups(3)
        raise AssertionError("shard_groups(3) of dp 4 should fail")
    except ValueError as e:
        assert "--zero-shard-group 3 must divide --dp 4" in str(e)
    shard, across = topo.shard_groups(2)
    sums = []
    for sub in (shard, across):
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, topo=sub, axis=Axis.DP)
        sums.append(t.item())
    return {
        "shard": shard.group_ranks[Axis.DP],
        "across": across.group_ranks[Axis.DP],
        "sizes": (shard.dp, across.dp),
        "sums": sums,
        "timeout": (shard.timeout.total_seconds(), across.timeout.total_seconds()),
        "counted": topo.stats is shard.stats is across.stats,
        "dp_ranks": (shard.dp_rank, across.dp_rank),
    }


@pytest.mark.slow
def test_shard_groups_builds_the_hybrid_sharding_groups():
    """HSDP's shard and across groups come from the topology, with its timeout, and
    each knows this rank's place in it (dp_rank; rank % size was wrong for across)."""
    from distributed import run_workers

    out = run_workers(4, _shard_groups)
    assert [r["shard"] for r in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["across"] for r in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["sizes"] == (2, 2) and r["counted"] for r in out)
    assert [r["sums"] for r in out] == [[1, 2], [1, 4], [5, 2], [5, 4]]
    assert all(r["timeout"] == (45.0, 45.0) for r in out)
    # each sub-group's dp_rank is the rank's place in it (--ep's edp engine reads it)
    assert [r["dp_ranks"] for r in out] == [(0, 0), (1, 0), (0, 1), (1, 1)]


class _Stuck:
    """A handle whose wait never returns until released: gloo's send whose receive never
    comes, after the connection under it was shut down (comm.py, "Waits that an abort
    ends")."""

    def __init__(self):
        self.release = threading.Event()

    def wait(self):
        self.release.wait()
        raise RuntimeError("Application timeout caused pair closure")


class _Done:
    def __init__(self, error=None):
        self.error, self.waited = error, False

    def wait(self):
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)


def test_an_aborted_generation_ends_a_wait_that_the_backend_never_would():
    """On a resilient generation's topology (gloo), ``comm.wait`` returns completed
    handles, re-raises a failed one as ``CollectiveError``, and, on a handle that never
    completes, raises within a poll of the abort; a blocking collective (``_issue``) waits
    the same way. Breaks if a wait runs on the training thread again (the abort cannot end
    it: the test's wait would last until the handle is released, 5 s), or if a handle's
    error is lost."""
    from plait import comm

    abortable = comm.Abortable()
    topo = dataclasses.replace(Topology.single(), abort=abortable)
    done = _Done()
    comm.wait([done], topo=topo, what="send", axis="pp")
    assert done.waited
    with pytest.raises(comm.CollectiveError, match="pp axis failed: Connection closed"):
        comm.wait([_Done("Connection closed by peer")], topo=topo, what="send", axis="pp")
    for blocking in (False, True):
        stuck = _Stuck()
        threading.Timer(5, stuck.release.set).start()
        aborted = comm.Abortable()
        topo = dataclasses.replace(Topology.single(), abort=aborted)
        threading.Timer(0.2, aborted.abort).start()
        t0 = time.perf_counter()
        with pytest.raises(comm.CollectiveError, match="aborted"):
            if blocking:
                comm._issue(topo, "all_reduce", "world", lambda async_op, s=stuck: s)
            else:
                comm.wait([stuck], topo=topo, what="send", axis="pp")
        assert 0.2 <= time.perf_counter() - t0 < 1.0
        with pytest.raises(comm.CollectiveError, match="aborted"):  # and later ones at once
            comm.wait([_Done()], topo=topo, what="send", axis="pp")
        stuck.release.set()
