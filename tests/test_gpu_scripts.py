"""The GPU benchmarks' scripts still run: ``--smoke`` takes each through its code on the
CPU with a tiny model, so a renamed function or a changed signature fails here and not
on a lent GPU, whose minutes are few (``benchmarks/gpu_checks.sh`` runs them there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(script: str, tmp_path, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MASTER_PORT": "29573",
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *extra],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("script", ["fsdp_step.py", "gpu_profile.py"])
def test_gpu_benchmarks_run_their_smoke_case(script, tmp_path):
    """Each prints its closing JSON with the model's side filled in: ``fsdp_step.py`` a
    case measured and priced by both runtimes, ``gpu_profile.py`` its workload's model
    split. Catches a script broken by a change elsewhere (the model's kinds, the
    profiler's summary, the trainer's entry points)."""
    lines = [x for x in _smoke(script, tmp_path).splitlines() if x.startswith("{")]
    result = json.loads(lines[-1])
    if script == "fsdp_step.py":
        case = result["cases"]["7b-plain-none"]
        assert case["measured"]["step_s"] > 0
        assert {"fsdp", "plait"} <= set(case["model"])
        assert case["model"]["fsdp"]["kinds_s"]["gemm"] > 0
    else:
        (work,) = result.values()
        assert work["model"]["gemm"] > 0 and work["step_s"]


def test_fake_world_collectives_keep_their_local_memory_traffic(tmp_path):
    """``fsdp_step.py --fake-world``: under the fake process group FSDP1's all-gather
    writes the shard into every slot of the unsharded buffer and its reduce-scatter sums
    the world's slices into the shard, under either name a PyTorch version calls. Catches
    a patched name missed (the buffer left as it was: garbage weights on a GPU) and the
    slices summed along the wrong axis."""
    code = f"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import fsdp_step
fsdp_step.local_collectives(4)
for name in ("all_gather_into_tensor", "all_gather_single"):
    if not hasattr(dist, name):
        continue
    out = torch.full((12,), -1.0)
    getattr(dist, name)(out, torch.arange(3.0))
    assert out.tolist() == [0.0, 1.0, 2.0] * 4, (name, out)
for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, name):
        out = torch.zeros(3)
        getattr(dist, name)(out, torch.arange(12.0))
        assert out.tolist() == [18.0, 22.0, 26.0], (name, out)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_rank_on_gpu_gives_plaits_collectives_their_local_writes(tmp_path):
    """``rank_on_gpu.py``: under the fake process group the all-gather and reduce-scatter
    that ``comm.py`` calls write the shard into every slot and sum the slices into the
    shard, a batch's receive is zeroed, and all is undone on leaving. Catches the patch
    applied to ``torch.distributed`` where ``comm.py`` bound its own names at import (the
    GPU rank would run on whatever the allocator left in the buffers), and its smoke case
    broken by a change to the trainer or the rehearsal."""
    code = f"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
from torch.testing._internal.distributed.fake_pg import FakeStore
import rank_on_gpu
from plait import comm
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
before = (comm._all_gather_single, comm._reduce_scatter_single, dist.batch_isend_irecv)
with rank_on_gpu.local_traffic():
    out = torch.full((12,), -1.0)
    comm._all_gather_single(out, torch.arange(3.0))
    assert out.tolist() == [0.0, 1.0, 2.0] * 4, out
    out = torch.zeros(3)
    comm._reduce_scatter_single(out, torch.arange(12.0))
    assert out.tolist() == [18.0, 22.0, 26.0], out
    got = torch.full((2,), -1.0)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 1)])
    assert got.tolist() == [0.0, 0.0], got
after = (comm._all_gather_single, comm._reduce_scatter_single, dist.batch_isend_irecv)
assert after == before
dist.destroy_process_group()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    out = _smoke("rank_on_gpu.py", tmp_path, "--profile")
    assert "device ms by kind" in out and "no local writes" in out, out[-2000:]
    lines = [x for x in out.splitlines() if x.startswith("{")]
    for case, r in json.loads(lines[-1]).items():
        assert len(r["losses"]) == 3 and r["rehearsed_peaks"]["step 2"] > 0, case
        assert r["simulated_peak"] > 0, case


def test_a_plait_step_makes_the_plain_loops_gemms(tmp_path):
    """``single_gpu.py --count-ops``: one steady bf16 step of plait's trainer dispatches as
    many GEMMs as the plain loop (GPT-2's 12 blocks: 147), and the printed line says so.
    On a GPU every operator is host time, and plait's step was host-bound there with 219
    (q, k and v as three GEMMs each way). Catches the fused q / k / v falling apart at the
    step level: the runner no longer inside ``weight_casts``, or a new condition that turns
    the fusion off. With ``--zero 3`` too (219 before its units laid q, k and v side by
    side and the fused GEMM read them there)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "single_gpu.py"),
                           "--count-ops"], capture_output=True, text=True, timeout=240,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    head, zero3 = done.stdout.splitlines()[:2]
    gemms = head.split("GEMMs plait ")[1]
    plait, plain = (int(x) for x in gemms.replace("plain ", "").split(", "))
    assert plait == plain, head
    assert zero3.startswith("  plait --zero 3:") and int(zero3.split("GEMMs ")[1]) == plain, zero3
