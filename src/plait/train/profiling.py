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

``StreamBytes`` is the byte side of the same reading: a dispatch mode that sums the tensor
bytes every operator reads and writes (views free, matrix products and attention apart),
run on fake tensors so any size counts on a CPU. ``benchmarks/stream_bytes.py`` and the
performance model's tests count plait's blocks with it (``sim.costs.stream_bytes``).

Communication: none. The profiler records what the step issues; it adds host work per
operator, so profiled steps are slower than the others (compare their step times in
``metrics.jsonl``) and the summary's busy fraction is a lower bound.
"""

from __future__ import annotations

import collections
import json
import re
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


def summarise(trace: dict, steps: int, wall_s: float, top: int = 0) -> dict:
    """Per-step device time by kind from a Chrome trace's events (durations in us);
    with ``top``, also the ``top`` kernels by device time (``top_kernels``: name cut to
    120 characters, kind, launches a step, seconds a step)."""
    by_name: dict[tuple[str, str], list] = {}  # (name, kind) -> [launches, seconds]
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat", "")
        if ev.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name = ev.get("name", "")
        entry = by_name.setdefault((name[:120], kind_of(name, cat)), [0, 0.0])
        entry[0] += 1
        entry[1] += ev.get("dur", 0.0) * 1e-6
    by_kind: dict[str, float] = {}
    for (_, kind), (_, seconds) in by_name.items():
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    busy = sum(by_kind.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "top_kernels": [[n, k, c / steps, s / steps] for (n, k), (c, s) in ranked],
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


GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul"})
FREE_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "detach", "expand", "slice", "select", "split",
    "split_with_sizes", "unsqueeze", "squeeze", "permute", "alias", "as_strided", "narrow",
    "_reshape_alias", "reshape", "unbind", "lift_fresh", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "view_as_real", "view_as_complex",
    "_conj",
})  # fmt: skip


class StreamBytes(TorchDispatchMode):
    """Inside it, every dispatched operator adds the bytes of its tensor arguments and
    results to ``bytes[kind]`` and one to ``calls[kind]``: kind "gemm" for matrix products,
    "attention" for attention kernels, else the operator's name. Views, metadata and
    allocations are free (``FREE_OPS``); ``copy_`` reads its source and writes its
    destination. An upper bound for a kernel that reads part of an
    input (an indexing loss reads one logit a row and is charged the row)."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def memory_bound(self) -> float:
        """Bytes of every kind but matrix products and attention."""
        return float(sum(v for k, v in self.bytes.items() if k not in ("gemm", "attention")))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.namespace == "prim" or name in FREE_OPS:
            return out
        kind = "gemm" if name in GEMM_OPS else "attention" if "attention" in name else name
        # a copy writes its destination without reading it: the destination once, as the
        # result, not again as an argument
        # an ``out=`` result is its argument: counted once
        moved = (
            (args[1:], kwargs, out) if name == "copy_"
            else (args, kwargs) if (kwargs or {}).get("out") is not None
            else (args, kwargs, out)
        )  # fmt: skip
        self.bytes[kind] += sum(
            t.numel() * t.element_size() for t in tree_leaves(moved) if isinstance(t, torch.Tensor)
        )
        self.calls[kind] += 1
        return out
