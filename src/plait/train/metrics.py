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

from plait.train.run_folder import open_nofollow, refuse_links, write_fresh


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


def alloc_retries(device: torch.device) -> int:
    """How often the CUDA caching allocator has failed a ``cudaMalloc``, freed its cached
    blocks and tried again (0 off CUDA). Each such flush waits for the device to drain:
    on one H100, an FSDP step at 62 of 79 GiB allocated flushed 17 times and left the GPU
    idle for 14% of it (``benchmarks/fsdp_step.py``; ``expandable_segments:True`` flushed
    16 times and ran 8-14% slower still). A host-side counter: reading it does not wait
    for the GPU."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def source_tokens(sampler, step: int) -> dict:
    """``{"source_tokens": {source: tokens}}``: the tokens each source of a mixture gave
    steps 0..``step`` (the same on every rank and after a resume: ``data/mixture.py``);
    nothing for one source, whose count is the step's ``tokens`` times the steps."""
    seen = getattr(sampler, "tokens_seen", None)
    return {} if seen is None else {"source_tokens": seen(step)}


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (rank 0 only); with
    ``tensorboard``, also every numeric key as a TensorBoard scalar (tag = the key, x = the
    step) in an event file beside it, which ``tensorboard --logdir`` reads. On resume the
    event file of the new process purges the steps past the checkpoint, as the JSON file
    is cut back."""

    def __init__(
        self,
        path: Path,
        *,
        enabled: bool,
        truncate_after: int | None = None,
        tensorboard: bool = False,
    ):
        self.enabled = enabled
        self.path = Path(path)
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # the tensorboard package is missing
                raise ValueError(f"--tensorboard needs the tensorboard package ({e})") from None
            purge = None if truncate_after is None else truncate_after + 1
            self.tb = SummaryWriter(log_dir=str(self.path.parent), purge_step=purge)
        if enabled:
            refuse_links(self.path.parent, [self.path.name])  # before it is even read
        if enabled and truncate_after is not None and self.path.exists():
            # On resume, drop records past the checkpoint so the file has one line per step.
            keep = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= truncate_after
            ]
            with open_nofollow(self.path, "w") as f:
                f.write("".join(line + "\n" for line in keep))
        elif enabled:
            open_nofollow(self.path, "w").close()

    def write(self, record: dict) -> None:
        if self.enabled:
            with open_nofollow(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in _scalars(record):
                if key != "step":
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()  # readable while the run goes on

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _scalars(record: dict, prefix: str = ""):
    """(tag, number) of every numeric value, a nested dict's as ``key/inner``."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield prefix + key, value


def write_rank_summary(out: Path, *, topo, model_state: dict, steps: int) -> Path:
    """``OUT/ranks/rank-K.json``, written by every rank at the end of its run: its place in
    the grid, peak memory, model-state bytes and the collectives it issued per axis
    (calls and bytes as ``comm.py`` counts them, over this process's ``steps`` steps,
    evaluation and checkpoints included). ``plait report`` reads them."""
    folder = Path(out) / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    comm = {
        f"{axis}.{op}": {"calls": n, "bytes": topo.stats.bytes[(axis, op)]}
        for (axis, op), n in sorted(topo.stats.calls.items())
    }
    record = {
        "rank": topo.rank,
        "pp": topo.pp_rank, "dp": topo.dp_rank, "tp": topo.tp_rank,
        "peak_mem_bytes": peak_memory_bytes(topo.device),
        "model_state_bytes": model_state,
        "steps": steps,
        "comm": comm,
    }  # fmt: skip
    path = folder / f"rank-{topo.rank}.json"
    write_fresh(path, json.dumps(record, indent=1))
    return path


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
