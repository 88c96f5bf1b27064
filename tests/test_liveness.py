"""Heartbeats, the watchdog and the launcher's choice of the one line, without workers:
a real store in this process, a fake clock for the watchdog."""

import signal
import time
from pathlib import Path

import pytest

from plait.train import liveness
from plait.train.launch import LaunchError, Terminated, outcome, stopped_line


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


SECRET = bytes(range(32))


@pytest.fixture
def store():
    return liveness.host(secret=SECRET)


class Beats:
    """A worker's heartbeat counter, set as ``Heartbeat`` sets it (signed values)."""

    def __init__(self, store):
        self.store, self.n = store, {}

    def beat(self, rank: int) -> None:
        self.n[rank] = self.n.get(rank, 0) + 1
        self.store.set(liveness.BEAT.format(rank), str(self.n[rank]))
        self.store.raw.check([liveness.BEAT.format(rank)])  # a set is not acknowledged: read


def test_watchdog_names_the_rank_whose_heartbeat_stopped(store):
    clock = Clock()
    dog = liveness.Watchdog(store, ranks=[0, 1, 2], stale_s=5.0, clock=clock)
    worker = liveness.connect(f"127.0.0.1:{store.port}", secret=SECRET)
    beats = Beats(worker)
    for rank in (0, 1):  # rank 2 never starts: not watched
        store.set(liveness.PID.format(rank), str(1000 + rank))
    for _ in range(4):  # both beat for 6 s, then rank 1 freezes
        beats.beat(0)
        beats.beat(1)
        assert dog.poll() == []
        clock.t += 2.0
    for _ in range(2):  # 4 s of silence: still under the limit
        beats.beat(0)
        assert dog.poll() == []
        clock.t += 2.0
    beats.beat(0)
    found = dog.poll()
    assert [(s.rank, s.pid) for s in found] == [(1, 1001)] and found[0].silent_s >= 5.0
    clock.t += 10.0  # reported once; rank 0 said its last word, so it is no longer watched
    liveness.report(worker, 0, code=0)
    assert dog.poll() == [] and [s.rank for s in dog.silent] == [1]


def test_heartbeat_thread_beats_and_watchdog_thread_calls_back(store):
    hb = liveness.Heartbeat(liveness.connect(f"127.0.0.1:{store.port}", secret=SECRET),
                            rank=3, interval=0.05, pid=4242).start()  # fmt: skip
    time.sleep(0.3)
    assert int(store.get(liveness.BEAT.format(3))) >= 3
    silences = []
    dog = liveness.Watchdog(store, ranks=[3], stale_s=0.3).start(silences.append, every=0.05)
    time.sleep(0.5)
    assert silences == []  # alive
    hb.stop()
    deadline = time.time() + 5
    while not silences and time.time() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert [(s.rank, s.pid) for s in silences] == [(3, 4242)]


def test_report_round_trip(store):
    liveness.report(store, 1, code=2, message="--data x: no such file", log=None, detail="tb")
    assert liveness.reports(store, [0, 1]) == {
        1: {"code": 2, "message": "--data x: no such file", "log": None, "detail": "tb"}
    }


def _ok():
    return {"code": 0, "message": "", "log": None, "detail": None}


def _failed(message, code=1, log=None, detail=None):
    return {"code": code, "message": message, "log": log, "detail": detail}


def test_outcome_root_cause_first(tmp_path):
    kw = dict(out=tmp_path, ranks=[0, 1], stale_s=5.0)
    assert outcome(reports={0: _ok(), 1: _ok()}, silent=[], failure=RuntimeError(), **kw) is None
    timeout = _failed("rank 0: CollectiveError: rank 0: all_reduce on the dp axis failed: "
                      "Timed out waiting 5000ms")  # fmt: skip
    hung = liveness.Silence(rank=1, pid=77, silent_s=5.4)
    e = outcome(reports={0: timeout}, silent=[hung], failure=None, **kw)
    assert e.code == 1 and str(e).startswith("rank 1 stopped responding: no heartbeat for 5.4 s")
    assert "killed it (pid 77)" in str(e) and "logs in" not in str(e)  # no logs folder: no pointer
    bad = _failed("--data x: no such file", code=2)
    assert outcome(reports={0: timeout, 1: bad}, silent=[hung], failure=None, **kw).code == 2
    reset = _failed("rank 0: CollectiveError: rank 0: all_reduce failed: Connection reset")
    crash = _failed("rank 1: RuntimeError: boom", log=str(tmp_path / "rank-1.log"), detail="tb")
    e = outcome(reports={0: reset, 1: crash}, silent=[], failure=None, **kw)
    assert str(e) == "rank 1: RuntimeError: boom" and e.detail == "tb"  # log file does not exist
    (tmp_path / "rank-1.log").write_text("tb")
    e = outcome(reports={0: reset, 1: crash}, silent=[], failure=None, **kw)
    assert str(e).endswith(f"(details in {tmp_path / 'rank-1.log'})")


def test_outcome_for_signals(tmp_path):
    kw = dict(reports={}, silent=[], out=tmp_path, ranks=[0], stale_s=5.0)
    e = outcome(failure=KeyboardInterrupt(), **kw)
    assert (
        e.code == 130
        and str(e) == "interrupted (SIGINT) before the first step; no checkpoint was written"
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    e = outcome(failure=Terminated(signal.SIGTERM), **kw)
    assert e.code == 143
    assert str(e) == (f"terminated (SIGTERM) after step 2; {tmp_path}/checkpoints/step-00000002 "
                      "is the newest checkpoint: --resume continues from it")  # fmt: skip

    class SignalException(Exception):  # torchrun's, raised by its handler
        sigval = signal.SIGTERM

    assert outcome(failure=SignalException(), **kw).code == 143
    assert stopped_line(signal.SIGINT, Path("/nonexistent")).endswith("no checkpoint was written")
    assert isinstance(outcome(failure=None, **kw), LaunchError)  # no word from anyone
