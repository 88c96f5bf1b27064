"""``plait train --profile A:B``: PyTorch's profiler over steps A to B on every rank.

Each rank writes, under ``OUT/profile/``:

- ``rank-K.json``: the Chrome / Perfetto trace of those steps (host operators, and on a
  GPU every kernel and copy with its stream and duration);
- ``rank-K.txt``: the operators by self device time (host time on a CPU), PyTorch's table;
- ``rank-K-summary.json``: per step, the wall time, the device's busy time (the kernels'
  and copies' durations summed) and that time by kind of kernel, so a step that leaves
  the GPU idle -- waiting for the host's Python, a synchronisation or a peer -- shows as
  busy < wall without opening the trace.

The kinds are read from kernel names (``KINDS``, first match wins): matrix products
(cuBLAS / CUTLASS / nvjet names), fused attention (flash / efficient / cuDNN attention),
NCCL, multi-tensor kernels (the fused optimizer, ``_foreach_*`` norms and scalings),
copies and fills, and everything else (elementwise, reductions, norms, the loss, casts).
It is a reading aid, not a measurement the code depends on: a new library's kernel name
lands in "other" until a pattern names it.

Communication: none. The profiler records what the step issues; it adds host work per
operator, so profiled steps are slower than the others (compare their step times in
``metrics.jsonl``) and the summary's busy fraction is a lower bound.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

KINDS = (
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|s\d+gemm|matmul", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("multi_tensor", re.compile(r"multi_tensor|fused_adam|foreach", re.I)),
)


def kind_of(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def summarise(trace: dict, steps: int, wall_s: float) -> dict:
    """Per-step device time by kind from a Chrome trace's events (durations in us)."""
    by_kind: dict[str, float] = {}
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat", "")
        if ev.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        kind = kind_of(ev.get("name", ""), cat)
        by_kind[kind] = by_kind.get(kind, 0.0) + ev.get("dur", 0.0) * 1e-6
    busy = sum(by_kind.values())
    return {
        "steps": steps,
        "wall_s_per_step": wall_s / steps,
        "device_busy_s_per_step": busy / steps if by_kind else None,
        "busy_fraction": busy / wall_s if by_kind and wall_s > 0 else None,
        "by_kind_s_per_step": {k: v / steps for k, v in sorted(by_kind.items())},
    }


class StepProfiler:
    """Starts before step ``first`` and stops after step ``last`` (1-based), then writes
    this rank's files. ``before`` / ``after`` take the number of the step about to run /
    just done."""

    def __init__(self, steps: tuple[int, int], *, out: Path, rank: int, device: torch.device):
        self.first, self.last = steps
        self.folder, self.rank, self.device = Path(out) / "profile", rank, device
        self.prof = None
        self.t0 = 0.0

    def before(self, step: int) -> None:
        if step != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)  # the previous step's kernels stay out
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels are in
        wall = time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank-{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        cuda = self.device.type == "cuda"
        table = prof.key_averages().table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40
        )
        n = self.last - self.first + 1
        (self.folder / f"rank-{self.rank}.txt").write_text(
            f"steps {self.first}-{self.last} on {self.device}, {wall / n:.4f} s a step "
            "(profiled: slower than the others)\n" + table + "\n"
        )
        summary = summarise(json.loads(trace.read_text()), n, wall)
        (self.folder / f"rank-{self.rank}-summary.json").write_text(json.dumps(summary, indent=1))

    def close(self) -> None:
        """A run that ends (or fails) inside the window: the profiler stops, nothing written."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)
