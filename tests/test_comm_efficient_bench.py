"""``benchmarks/comm_efficient.py --reuse``: saved runs join a table only if they were
trained as the new ones will be (steps, batch, optimizer, lr); otherwise one line that
names the flag. Single process, no training."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "comm_efficient.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("comm_efficient_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(path, **kw):
    return argparse.Namespace(
        **{
            "reuse": str(path),
            "steps": 2,
            "batch": 16,
            "optimizer": "adamw",
            "lr": 3e-3,
            "seed": 0,
            **kw,
        }
    )


def test_reuse_refuses_runs_trained_otherwise(bench, tmp_path):
    runs = {"all-reduce": [{"loss": 1.0}, {"loss": 0.9}]}
    saved = tmp_path / "sgd.json"
    saved.write_text(json.dumps({"batch": 16, "optimizer": "sgd", "lr": 0.3, "runs": runs}))
    assert bench._reused(_args(saved, optimizer="sgd", lr=0.3)) == runs
    for kw, flag in ((dict(), "--optimizer"), (dict(optimizer="sgd", lr=0.1), "--lr"),
                     (dict(optimizer="sgd", lr=0.3, batch=32), "--batch"),
                     (dict(optimizer="sgd", lr=0.3, steps=4), "--steps"),
                     (dict(optimizer="sgd", lr=0.3, seed=1), "--seed")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            bench._reused(_args(saved, **kw))
        assert flag in str(e.value) and "\n" not in str(e.value), (kw, e.value)
    # a file of the runs alone (saved before the keys existed): batch 16, AdamW at 3e-3
    old = tmp_path / "old.json"
    old.write_text(json.dumps(runs))
    assert bench._reused(_args(old)) == runs
    with pytest.raises(SystemExit) as e:
        bench._reused(_args(old, optimizer="sgd", lr=0.3))
    assert "--optimizer" in str(e.value)


def test_noise_scale_recovers_signal_and_noise_from_two_batches(bench):
    """E|g_b|^2 = |G|^2 + tr(Sigma) / b: norms built from known |G|^2 and tr(Sigma) at
    batches 4 and 16 give them back, window by window, and B_simple = their ratio; a
    window whose |G|^2 estimate comes out negative (noise swamps it) has none."""
    g2 = [1.0] * 8 + [0.1] * 8 + [-0.01] * 8
    trace = [4.0] * 8 + [8.0] * 8 + [8.0] * 8

    def norms(b):
        return [{"grad_norm": (g + t / b) ** 0.5} for g, t in zip(g2, trace)]

    rows = bench.noise_scale(norms(16), norms(4), b_big=16, b_small=4, windows=3)
    assert [r["steps"] for r in rows] == [(1, 8), (9, 16), (17, 24)]
    for r, g, t in zip(rows, (1.0, 0.1, -0.01), (4.0, 8.0, 8.0)):
        assert r["g2"] == pytest.approx(g, abs=1e-12) and r["trace"] == pytest.approx(t)
    assert rows[0]["b_simple"] == pytest.approx(4.0) and rows[1]["b_simple"] == pytest.approx(80)
    assert rows[2]["b_simple"] is None
    table = bench.noise_table(rows, b_big=16, b_small=4)
    assert "| 9-16 | 0.1000 | 8.000 | 80 |" in table and "noise swamps" in table


@pytest.mark.parametrize(
    "only, words",
    [("bf16", "add all-reduce"), ("all-reduce,local-sgd H=3", "unknown run 'local-sgd H=3'")],
)
def test_bytes_part_refuses_a_table_it_cannot_make_in_one_line(only, words):
    """Without the all-reduce (its reference) or with a run it does not know, the bytes
    part stops before training anything, in one line."""
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "comm_efficient.py"
    r = subprocess.run([sys.executable, str(script), "--part", "bytes", "--only", only],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and words in r.stderr and r.stderr.strip().count("\n") == 0
