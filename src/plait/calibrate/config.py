"""What ``plait calibrate`` measures: the configuration of a calibration run."""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 2**30
DTYPES = ("fp32", "bf16", "fp16")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    """What to measure. ``procs``: worker processes measured at once (module docstring)."""

    quick: bool = False
    procs: int = 2
    threads: int = 1
    dtypes: tuple[str, ...] = ("fp32",)
    device: str = "cpu"
    name: str = "calibrated"

    @property
    def rounds(self) -> int:
        """Passes over the compute measurements (``measure_compute``)."""
        return 2 if self.quick else 3

    @property
    def compute_slots(self) -> int:
        """Processes that can compute at full speed at once: the GPUs, or the CPU cores
        this process may use divided by the threads per worker."""
        if self.device == "cuda":
            return self.procs
        return max(1, len(os.sched_getaffinity(0)) // self.threads)

    @property
    def compute_procs(self) -> int:
        """Workers that measure compute together: never more than the slots, so the file
        describes a device at full speed and ``simulate`` shares the slots itself."""
        return min(self.procs, self.compute_slots)

    def __post_init__(self) -> None:
        if self.procs < 1:
            raise ValueError(f"--procs must be at least 1, got {self.procs}")
        if self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad or "fp32" not in self.dtypes:
            raise ValueError(f"--dtypes must include fp32 and be among {', '.join(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose cpu or cuda")
