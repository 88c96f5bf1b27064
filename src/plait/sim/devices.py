"""Dense peak FLOP/s of the GPUs plait knows by name, and the dtype a device trains in
by default.

The trainer's MFU divides by these peaks (``train.metrics.peak_tflops``): the dense
(not 2:4-sparse) tensor-core figures of NVIDIA's data sheets, per device. "fp32" is the
rate of an fp32 matmul as plait runs it on that GPU: on Ampere and later TF32 tensor
cores (plait enables TF32 on CUDA), on a V100 plain FP32. A GPU missing from the table
gets no guess: the trainer asks for ``--peak-tflops`` in one line.

Sources: NVIDIA data sheets -- V100 (SXM2), A10, A100 (SXM4 and PCIe, 40/80 GB share
peaks), L4, L40S, H100 (SXM5, PCIe, NVL), H200 (SXM, as H100 SXM), HGX B200 (per GPU:
the 8-GPU board's figures divided by 8).
"""

from __future__ import annotations

import re

# (name pattern as torch.cuda.get_device_name reports it, {dtype: dense TFLOP/s}).
# Order matters: the first match wins ("A100" before "A10", "H100 PCIe" before "H100").
GPU_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"\bB200\b", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1125.0}),
    (r"\bH200\b", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835.0, "fp16": 835.0, "fp32": 417.5}),
    (r"\bH100\b", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),  # SXM5 ("H100 80GB HBM3")
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    (r"\bL40S\b", {"bf16": 362.05, "fp16": 362.05, "fp32": 183.0}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5}),
    (r"\bV100\b", {"fp16": 125.0, "fp32": 15.7}),  # no bf16 tensor cores
]

KNOWN_GPUS = "V100, A10, L4, L40S, A100 40/80 GB, H100 SXM/PCIe/NVL, H200, B200"


def gpu_peak_tflops(name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of the GPU called ``name`` for ``dtype``; None if unknown.
    ``gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0``."""
    for pattern, peaks in GPU_PEAK_TFLOPS:
        if re.search(pattern, name.replace("-", " ")):
            return peaks.get(dtype)
    return None


def default_dtype(peaks: dict[str, float | None]) -> str:
    """The dtype a device trains in unless told otherwise: the one with the highest peak,
    fp32 on a tie (a CPU, whose half precision is no faster). A100: bf16; V100: fp16."""
    best = "fp32"
    for dtype in ("bf16", "fp16"):
        if (peaks.get(dtype) or 0.0) > (peaks.get(best) or 0.0):
            best = dtype
    return best
