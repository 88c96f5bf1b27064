"""Metrics: ``metrics.jsonl`` (DESIGN.md section 4), the peak FLOP/s behind MFU, memory, and
the progress display on the terminal."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "plait"


def measure_cpu_peak_tflops(dtype: str = "fp32", size: int = 1024, seconds: float = 0.5) -> float:
    """Best observed matmul throughput of this process (its thread count) on this CPU."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(size, size).to(torch_dtype)
    b = torch.randn(size, size).to(torch_dtype)
    a @ b  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    return best / 1e12


def peak_tflops(device: torch.device, dtype: str, override: float | None = None) -> float:
    """Peak TFLOP/s per device: ``--peak-tflops``, a GPU of ``sim.devices``' table by its
    name, or measured once on this CPU (matmul, at the worker's thread count) and cached in
    ~/.cache/plait. A GPU missing from the table is a ValueError asking for
    ``--peak-tflops`` (one line): measuring a CPU matmul there would be meaningless."""
    if override:
        return float(override)
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype)
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"
    path = _cache_dir() / "peak_tflops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_cpu_peak_tflops(dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return cache[key]


def gpu_peak(name: str, dtype: str) -> float:
    """Dense peak TFLOP/s of the GPU called ``name`` for ``dtype``, or a one-line error."""
    from plait.sim.devices import KNOWN_GPUS, gpu_peak_tflops

    peak = gpu_peak_tflops(name, dtype)
    if peak is None:
        raise ValueError(
            f"--peak-tflops: plait has no {dtype} peak for the GPU {name!r} (it knows "
            f"{KNOWN_GPUS}); give its dense {dtype} TFLOP/s per device with --peak-tflops"
        )
    return peak


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory allocated (CUDA) or the process's peak resident set (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, path: Path, *, enabled: bool, truncate_after: int | None = None):
        self.enabled = enabled
        self.path = Path(path)
        if enabled and truncate_after is not None and self.path.exists():
            # On resume, drop records past the checkpoint so the file has one line per step.
            keep = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= truncate_after
            ]
            self.path.write_text("".join(line + "\n" for line in keep))
        elif enabled:
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


class Progress:
    """A rich progress bar on a terminal; plain log lines every ``log_every`` steps otherwise."""

    def __init__(self, total: int, start: int, *, enabled: bool, log_every: int):
        self.enabled, self.log_every, self.total = enabled, log_every, total
        self.bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s  MFU {rec['mfu']:.1%}"
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], info=info)
        elif rec["step"] % self.log_every == 0 or rec["step"] in (1, self.total):
            print(f"step {rec['step']:>6}/{self.total}  {info}", flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
