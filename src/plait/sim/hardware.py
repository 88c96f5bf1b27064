"""Hardware specs for the performance model: devices, their memory and the links between them.

A :class:`Hardware` entry describes one kind of device and the machine it sits in:

- dense peak FLOP/s per dtype (tensor cores where the dtype uses them; no sparsity),
- device memory, its sustained (STREAM-like) bandwidth, and what the framework itself
  takes (CUDA context, communicator buffers, allocator slack),
- a compute-efficiency curve (:class:`Efficiency`): what fraction of peak a matrix multiply
  of a given size reaches, and what fused (flash) attention reaches,
- two link levels (:class:`Link`), each an alpha-beta pair: ``intra_node`` (NVLink /
  NVSwitch between the devices of a node) and ``inter_node`` (the network; bandwidth *per
  device*, i.e. one rail-local NIC, as on DGX machines where each GPU has its own NIC),
- ``devices_per_node``, ``pcie_bandwidth`` and ``host_memory_bandwidth`` (optimizer offload),
- optional fields for hosts where the framework, not the memory, sets the pace:
  ``elementwise_bandwidth``, the bytes/s that elementwise, normalisation, loss and
  optimizer kernels reach (default: ``memory_bandwidth``, as on GPUs, where those kernels
  stream near it; single CPU threads compute GELU or AdamW well below it), and
  ``compute_slots_per_node``, how many of a node's devices can compute at full speed at
  once (default: all of them; a CPU host running more single-thread worker processes
  than it has cores time-shares them, see ``simulate``), and ``op_overhead``, the host
  time each kernel costs on top of its own run time where nothing hides it (default 0:
  a GPU queues kernels ahead of time; a CPU worker pays the framework's dispatch and
  autograd bookkeeping for every operation, see ``costs``), and
  ``optimizer_tensor_overhead``, host seconds per parameter tensor per optimizer step
  (default 0: fused multi-tensor kernels; on a CPU, AdamW, the gradient norm and clipping
  loop over the tensors one by one, a fixed cost per tensor that a small model's step
  feels), and ``host_overlap``: whether those host costs overlap the device's work (a GPU,
  whose kernels the host queues ahead: the step takes the longer of host and device;
  ``plait calibrate --device cuda`` sets it) or add to it (default: a CPU worker runs each
  kernel itself).

Built-in entries: ``v100``, ``a100-40gb``, ``a100-80gb``, ``h100-sxm``, ``h200`` and ``cpu``.
Users describe their own clusters in YAML (``Hardware.to_yaml`` writes the schema; every
field is required except ``description`` and the optional ones)::

    name: my-cluster
    peak_flops: {fp32: 19.5e12, bf16: 312e12, fp16: 312e12}
    memory_bytes: 85899345920
    memory_bandwidth: 1.84e12
    framework_overhead_bytes: 2147483648
    devices_per_node: 8
    efficiency: {gemm_max: 0.7, gemm_half_flops: 1.0e9, attention: 0.5}
    intra_node: {bandwidth: 2.4e11, latency: 5.0e-6}
    inter_node: {bandwidth: 2.4e10, latency: 1.0e-5}
    pcie_bandwidth: 2.5e10
    host_memory_bandwidth: 1.5e11
    elementwise_bandwidth: null      # optional
    compute_slots_per_node: null     # optional
    op_overhead: 0.0                 # optional
    optimizer_tensor_overhead: 0.0   # optional
    host_overlap: false              # optional
    overlap_slowdown: 0.0            # optional

``plait calibrate`` writes the same file for the machine it runs on: measured matmul
efficiency (fit of ``gemm_max`` / ``gemm_half_flops``) and measured collective alpha/beta.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class PeakFlops:
    """Dense peak FLOP/s per dtype; ``None`` where the device has no fast path for it."""

    fp32: float
    bf16: float | None = None
    fp16: float | None = None

    def get(self, dtype: str) -> float | None:
        return getattr(self, dtype)


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fraction of peak FLOP/s that kernels reach.

    A matrix multiply (m x k) @ (k x n) of F = 2 m n k FLOPs runs at
    ``gemm_max * k / (k + gemm_half_k) * F / (F + gemm_half_flops)`` of peak, unless
    moving its operands through device memory takes longer (roofline). Large GEMMs reach
    ``gemm_max``; the two saturation terms are the two fixed costs a GEMM pays: each
    output tile's prologue and epilogue, amortised over a main loop as long as the
    reduction length k (a reduction of ``gemm_half_k`` runs at half speed), and each
    launch with its tail wave (a GEMM of ``gemm_half_flops`` FLOPs runs at half speed).
    ``attention`` is the fraction of peak that fused (flash) attention kernels of the
    FlashAttention-2 generation reach on the FLOPs they execute, and
    ``attention_native`` what kernels written for the device's newest instructions reach
    (FlashAttention-3 and cuDNN 9 on Hopper's TMA and warpgroup MMA; None: no such
    kernel, ``attention`` applies); a runtime says which it uses
    (``runtime.Runtime.attention_native``). All four are fitted by ``plait calibrate`` from a sweep of
    matmul and attention shapes, or from published runs (docs/performance-model.md).
    """

    gemm_max: float
    gemm_half_k: float
    gemm_half_flops: float
    attention: float
    attention_native: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.gemm_max <= 1 or not 0 < self.attention <= 1:
            raise ValueError("efficiency: gemm_max and attention must be in (0, 1]")
        if self.attention_native is not None and not 0 < self.attention_native <= 1:
            raise ValueError("efficiency: attention_native must be in (0, 1]")
        if self.gemm_half_flops < 0 or self.gemm_half_k < 0:
            raise ValueError("efficiency: gemm_half_k and gemm_half_flops must be >= 0")

    def attention_rate(self, native: bool) -> float:
        """Fraction of peak of the runtime's attention kernels (class docstring)."""
        return self.attention_native if native and self.attention_native else self.attention

    def gemm(self, m: float, n: float, k: float, batch: float = 1) -> float:
        """Fraction of peak reached by ``batch`` (m x k) @ (k x n) GEMMs in one kernel."""
        flops = 2.0 * m * n * k * batch
        return self.gemm_max * k / (k + self.gemm_half_k) * flops / (flops + self.gemm_half_flops)


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of the interconnect as an alpha-beta model: a message of n bytes takes
    ``latency + n / bandwidth`` seconds. ``bandwidth`` is per device and direction, as
    NCCL's *bus bandwidth* reports it (so ring factors apply on top of it).

    ``per_op`` optionally gives some operations (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``p2p``) their own pair, for backends whose algorithms differ
    from the ring the formulas in ``costs`` assume (gloo's all-gather is no cheaper than
    its all-reduce); ``plait calibrate`` fits one pair per operation."""

    bandwidth: float  # bytes/s
    latency: float  # s
    per_op: tuple[tuple[str, Link], ...] = ()

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError("link: bandwidth must be > 0 and latency >= 0")
        unknown = sorted({op for op, _ in self.per_op} - set(LINK_OPS))
        if unknown:
            raise ValueError(f"link: unknown per_op operation(s) {', '.join(unknown)}; "
                             f"choose among {', '.join(LINK_OPS)}")  # fmt: skip

    def op(self, name: str) -> Link:
        """The pair operation ``name`` runs at."""
        for op, link in self.per_op:
            if op == name:
                return link
        return self

    def to_dict(self) -> dict:
        d = {"bandwidth": self.bandwidth, "latency": self.latency}
        if self.per_op:
            d["per_op"] = {op: link.to_dict() for op, link in self.per_op}
        return d

    @classmethod
    def from_dict(cls, d) -> Link:
        if not isinstance(d, dict):
            raise TypeError(f"expected a mapping, got {d!r}")
        d = dict(d)
        per_op = d.pop("per_op", None) or {}
        if not isinstance(per_op, dict):
            raise TypeError(f"per_op: expected a mapping of operations, got {per_op!r}")
        ops = tuple((str(op), cls(**_floats(v))) for op, v in per_op.items())
        return cls(**_floats(d), per_op=ops)


LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    peak_flops: PeakFlops
    memory_bytes: float
    memory_bandwidth: float  # sustained bytes/s
    framework_overhead_bytes: float
    devices_per_node: int
    efficiency: Efficiency
    intra_node: Link
    inter_node: Link
    pcie_bandwidth: float
    host_memory_bandwidth: float
    elementwise_bandwidth: float | None = None  # None: memory_bandwidth
    compute_slots_per_node: int | None = None  # None: devices_per_node
    op_overhead: float = 0.0  # seconds of host work per kernel, where it is not hidden
    # host seconds per parameter tensor per optimizer step (per-tensor loops of AdamW,
    # the gradient norm and clipping, where no multi-tensor kernel fuses them)
    optimizer_tensor_overhead: float = 0.0
    # host seconds to launch one kernel outside the model's own stream of work (the
    # per-rank copies of a list all-gather); None: op_overhead (a CPU worker's dispatch)
    kernel_launch: float | None = None
    # the host queues kernels ahead of the device (a GPU): the host's time per kernel
    # (op_overhead) and per tensor (optimizer_tensor_overhead) overlaps the device's work,
    # and a step takes the longer of the two (``simulate``); False: the host runs each
    # kernel itself (a CPU worker), so the two add up
    host_overlap: bool = False
    # the fraction by which a device's compute slows while a collective runs beside it
    # (its kernels hold SMs and stream through the same HBM): overlapped communication
    # costs this much of the time it overlaps (``collectives.hidden_behind``)
    overlap_slowdown: float = 0.0
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"hardware {self.name}: devices_per_node must be at least 1")
        for name in ("memory_bytes", "memory_bandwidth", "pcie_bandwidth", "host_memory_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name}: {name} must be positive")
        if self.elementwise_bandwidth is not None and self.elementwise_bandwidth <= 0:
            raise ValueError(f"hardware {self.name}: elementwise_bandwidth must be positive")
        for name in ("op_overhead", "optimizer_tensor_overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware {self.name}: {name} must be >= 0")
        if not 0 <= self.overlap_slowdown < 1:
            raise ValueError(f"hardware {self.name}: overlap_slowdown must be in [0, 1)")
        if self.compute_slots_per_node is not None and self.compute_slots_per_node < 1:
            raise ValueError(f"hardware {self.name}: compute_slots_per_node must be at least 1")

    @property
    def elementwise_bw(self) -> float:
        """Bytes/s of elementwise, normalisation, loss and optimizer kernels."""
        return self.elementwise_bandwidth or self.memory_bandwidth

    @property
    def launch_s(self) -> float:
        """Host seconds per launched kernel (``kernel_launch``, else ``op_overhead``)."""
        return self.op_overhead if self.kernel_launch is None else self.kernel_launch

    @property
    def compute_slots(self) -> int:
        """Devices of one node that compute at full speed at the same time."""
        return min(self.compute_slots_per_node or self.devices_per_node, self.devices_per_node)

    def peak(self, dtype: str) -> float:
        value = self.peak_flops.get(dtype)
        if value is None:
            supported = [d for d in ("fp32", "bf16", "fp16") if self.peak_flops.get(d)]
            raise ValueError(
                f"--dtype {dtype} has no fast path on {self.name}; use one of {', '.join(supported)}"
            )
        return value

    def replace(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)

    def device_only(self) -> Hardware:
        """This entry with no host costs (``op_overhead``, ``optimizer_tensor_overhead``,
        ``kernel_launch``): the device's own time, which a step with ``host_overlap``
        takes at least (``simulate``, the planner's bounds)."""
        return self.replace(op_overhead=0.0, optimizer_tensor_overhead=0.0, kernel_launch=0.0,
                            host_overlap=False)  # fmt: skip

    # -- YAML ---------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["intra_node"], d["inter_node"] = self.intra_node.to_dict(), self.inter_node.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Hardware:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown hardware field(s): {', '.join(unknown)}")
        optional = {
            "description",
            "elementwise_bandwidth",
            "compute_slots_per_node",
            "op_overhead",
            "optimizer_tensor_overhead",
            "kernel_launch",
            "host_overlap",
            "overlap_slowdown",
        }
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.name not in d and f.name not in optional
        )
        if missing:
            raise ValueError(f"hardware spec lacks: {', '.join(missing)}")

        def field(name: str, convert):  # one line naming the field that is wrong
            try:
                d[name] = convert(d[name])
            except (TypeError, ValueError) as e:
                raise ValueError(f"hardware field {name}: {str(e).splitlines()[0]}") from None

        field("peak_flops", lambda v: PeakFlops(**_floats(v)))
        field("efficiency", lambda v: Efficiency(**_floats(v)))
        field("intra_node", Link.from_dict)
        field("inter_node", Link.from_dict)
        for name in ("memory_bytes", "memory_bandwidth", "framework_overhead_bytes",
                     "pcie_bandwidth", "host_memory_bandwidth"):  # fmt: skip
            field(name, float)
        field("devices_per_node", int)
        for name in ("elementwise_bandwidth", "kernel_launch", "compute_slots_per_node"):
            if d.get(name) is not None:
                field(name, int if name == "compute_slots_per_node" else float)
        for name in ("op_overhead", "optimizer_tensor_overhead"):
            d[name] = d.get(name) or 0.0
            field(name, float)
        d["host_overlap"] = d.get("host_overlap", False)
        field("host_overlap", _flag)
        if d.get("overlap_slowdown") is None:  # a GPU's file from before the field: its figure
            d["overlap_slowdown"] = OVERLAP_SLOWDOWN if d["host_overlap"] else 0.0
        field("overlap_slowdown", float)
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Hardware:
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ValueError(f"--hardware {path}: cannot read it ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"--hardware {path}: not valid YAML "
                             f"({str(e).strip().splitlines()[0]})") from None  # fmt: skip
        if not isinstance(data, dict):
            raise ValueError(f"--hardware {path}: expected a mapping of hardware fields")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"--hardware {path}: {e}") from None

    def to_yaml(self, path: str | Path | None = None) -> str:
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def _flag(v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"host_overlap: expected true or false, got {v!r}")
    return v


def _floats(d) -> dict:
    if not isinstance(d, dict):
        raise TypeError(f"expected a mapping, got {d!r}")
    out = {}
    for k, v in d.items():
        try:
            out[k] = None if v is None else float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{k}: expected a number, got {v!r}") from None
    return out


# -- built-in entries ---------------------------------------------------------------------
#
# Every figure is a physical quantity with its source, except ``gemm_max`` (below):
#
# - Peak FLOP/s, memory and bandwidth: NVIDIA data sheets (dense, no sparsity). Sustained
#   memory bandwidth is 90% of the data sheet (STREAM-like copies reach 88-93% on these
#   parts).
# - Link bandwidths are NCCL bus bandwidths for large messages: NVSwitch ~80% of the
#   per-direction NVLink figure (DGX A100 ~240 GB/s of 300; DGX H100 ~360 GB/s of 450);
#   the network is one rail per GPU at ~95% of its line rate (HDR 200 Gb/s = 25 GB/s, NDR
#   400 Gb/s = 50 GB/s; NCCL's tuning model likewise multiplies its per-channel network
#   speed by the channel count, one per NIC).
# - Latencies are per ring hop, NCCL's own tuning model (``src/graph/tuning.cc``,
#   ``hwLat``, ring with the Simple protocol): 3.4 us over NVLink, 9.6 us over the
#   network; a ring's latency is the sum over its hops (``collectives.py``).
# - ``kernel_launch``: ~5 us of host time per kernel launched through PyTorch (C++
#   dispatch plus the CUDA launch, "a few microseconds per kernel" in NVIDIA's CUDA
#   Graphs introduction, 2019); it prices only streams of tiny kernels that the host
#   cannot issue ahead of the device (``runtime.Runtime.gather_list_outputs``).
# - Efficiency: ``attention`` is FlashAttention-2's forward + backward throughput in the
#   causal, head-size-128 benchmarks of Dao (2023): ~170 TFLOP/s of 312 on A100
#   (0.55), ~300 of 989 on H100 (0.30; FlashAttention-2 does not use Hopper's TMA and
#   warpgroup instructions); long-sequence figures, which ``costs.attention_key_saturation``
#   scales down at shorter sequences. ``attention_native`` on H100 is FlashAttention-3's (Shah et
#   al. 2024: causal head-size-128 forward ~600 TFLOP/s, backward 1.5-1.75x FA2's ~300,
#   so ~500 TFLOP/s over forward + backward: 0.50), matched by cuDNN 9's fused attention
#   that Transformer Engine calls. ``gemm_half_flops`` comes from cuBLAS size sweeps (a 1024^3
#   GEMM runs at about two thirds of a large one on A100, a bit under half on H100);
#   ``gemm_half_k`` is a tile's pipeline fill and epilogue in reduction elements (two
#   64-deep stages plus the output write: ~200 on A100; H100's larger tiles ~256).
# - ``elementwise_bandwidth``: memory-bound kernels (elementwise, norms, casts, the
#   loss, fused AdamW) stream at ``ELEMENTWISE_OF_PEAK`` of the HBM's peak, measured in a
#   profiled plait step on an H200 (RESULTS.md, 2026-11-26): 265 GB counted through those
#   kernels in 87.9 ms (3.0 TB/s of 4.8) for a ~1B llama, and fused AdamW's multi-tensor
#   kernels at 3.1 TB/s; GPT-2's smaller tensors reached 2.3. The same fraction on the
#   other HBM parts is an extrapolation. GEMMs' memory bound keeps ``memory_bandwidth``
#   (0.9 of peak: the large, regular copies calibrate measured at 3.6 TB/s).
# - ``gemm_max``, the fraction of the dense peak large GEMMs sustain through a training
#   step (clocks under the power limit included), is fitted per GPU type on the
#   published runs (``sim/validate.py``: every source's rows predicted by a fit on the
#   others; docs/performance-model.md). V100 reuses the closest fitted part; the H200's
#   is measured (below). On one H100 an MPT-7B block's GEMMs ran at 0.68-0.78 of peak
#   (``benchmarks/fsdp_step.py``): the fitted 0.56 still carries a many-GPU cost of the
#   published runs that the model does not name yet (0.53 before the compute beside
#   overlapped collectives was slowed, ``overlap_slowdown``; docs/performance-model.md
#   section 6).

_A100_EFF = Efficiency(gemm_max=0.72, gemm_half_k=200, gemm_half_flops=1.0e9, attention=0.55)
_H100_EFF = Efficiency(gemm_max=0.56, gemm_half_k=256, gemm_half_flops=2.5e9, attention=0.30,
                       attention_native=0.50)  # fmt: skip
# H200: the H100's shape terms, at the level plait's own steps' GEMMs reached, profiled on
# an H200 (RESULTS.md, the sixth GPU session): the ~1B llama's 120.5 ms of GEMMs a step
# invert to 0.87, the 7B ZeRO-3 rank's 377.6 ms to 0.91; their mean prices each within 3%.
# Measured, where the H100's is fitted on published runs. calibrate's bf16 sweep topped out
# lower (759-784 of 989 TFLOP/s, 0.78 then): a sweep's GEMMs alone, not the step's.
_H200_EFF = dataclasses.replace(_H100_EFF, gemm_max=0.89)
_NVLINK_HOP, _NETWORK_HOP, _LAUNCH = 3.4e-6, 9.6e-6, 5e-6
# - ``overlap_slowdown``: a GPU's compute runs 18.9 % slower, on average, while a
#   collective runs beside it (its kernels hold SMs -- an all-gather's 24 blocks of an
#   H100's 132 -- and stream through the same HBM; a GEMM of one full wave then needs a
#   second): the average over GPT and LLaMA training workloads on A100, H100, MI250 and
#   MI210 of "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed
#   Deep Learning: Performance and Power Implications" (arXiv 2507.03114, 2025; at most
#   40 %). The same figure for every GPU entry; a CPU's workers time-share its cores
#   instead (``simulate``).
OVERLAP_SLOWDOWN = 0.189
ELEMENTWISE_OF_PEAK = 0.625  # 3.0 of the H200's 4.8 TB/s (above)

_DGX_A100 = dict(
    overlap_slowdown=OVERLAP_SLOWDOWN,
    devices_per_node=8,
    intra_node=Link(bandwidth=240e9, latency=_NVLINK_HOP),
    inter_node=Link(bandwidth=24e9, latency=_NETWORK_HOP),
    kernel_launch=_LAUNCH,
    pcie_bandwidth=25e9,  # PCIe 4.0 x16
    host_memory_bandwidth=150e9,
    framework_overhead_bytes=2 * GiB,
)
_DGX_H100 = dict(
    overlap_slowdown=OVERLAP_SLOWDOWN,
    devices_per_node=8,
    intra_node=Link(bandwidth=360e9, latency=_NVLINK_HOP),
    inter_node=Link(bandwidth=47e9, latency=_NETWORK_HOP),
    kernel_launch=_LAUNCH,
    pcie_bandwidth=50e9,  # PCIe 5.0 x16
    host_memory_bandwidth=250e9,
    framework_overhead_bytes=2 * GiB,
)


def gpu_peak_flops(device_name: str) -> PeakFlops:
    """The peaks of ``sim.devices``' table (the trainer's MFU uses the same), in FLOP/s:
    fp32 is an fp32 matmul as plait runs it (TF32 tensor cores from Ampere on)."""
    from plait.sim.devices import gpu_peak_tflops

    peaks = {d: gpu_peak_tflops(device_name, d) for d in ("fp32", "bf16", "fp16")}
    return PeakFlops(**{d: v * 1e12 if v is not None else None for d, v in peaks.items()})


BUILTIN: dict[str, Hardware] = {
    "v100": Hardware(
        name="v100",
        description="NVIDIA V100 SXM2 32GB, 8 per node (NVLink 2), 100 Gb/s EDR per GPU",
        peak_flops=gpu_peak_flops("Tesla V100-SXM2-32GB"),
        memory_bytes=32 * GiB,
        memory_bandwidth=0.9 * 900e9,
        elementwise_bandwidth=ELEMENTWISE_OF_PEAK * 900e9,
        devices_per_node=8,
        efficiency=Efficiency(
            gemm_max=0.64, gemm_half_k=128, gemm_half_flops=0.5e9, attention=0.30
        ),
        intra_node=Link(bandwidth=130e9, latency=_NVLINK_HOP),
        inter_node=Link(bandwidth=11.5e9, latency=_NETWORK_HOP),
        kernel_launch=_LAUNCH,
        overlap_slowdown=OVERLAP_SLOWDOWN,
        pcie_bandwidth=12e9,
        host_memory_bandwidth=100e9,
        framework_overhead_bytes=1.5 * GiB,
    ),
    "a100-40gb": Hardware(
        name="a100-40gb",
        description="NVIDIA A100 SXM4 40GB, DGX A100 (8 per node, NVSwitch, 8x HDR 200 Gb/s)",
        peak_flops=gpu_peak_flops("NVIDIA A100-SXM4-40GB"),
        memory_bytes=40 * GiB,
        memory_bandwidth=0.9 * 1555e9,
        elementwise_bandwidth=ELEMENTWISE_OF_PEAK * 1555e9,
        efficiency=_A100_EFF,
        **_DGX_A100,
    ),
    "a100-80gb": Hardware(
        name="a100-80gb",
        description="NVIDIA A100 SXM4 80GB, DGX A100 (8 per node, NVSwitch, 8x HDR 200 Gb/s)",
        peak_flops=gpu_peak_flops("NVIDIA A100-SXM4-80GB"),
        memory_bytes=80 * GiB,
        memory_bandwidth=0.9 * 2039e9,
        elementwise_bandwidth=ELEMENTWISE_OF_PEAK * 2039e9,
        efficiency=_A100_EFF,
        **_DGX_A100,
    ),
    "h100-sxm": Hardware(
        name="h100-sxm",
        description="NVIDIA H100 SXM5 80GB, DGX H100 (8 per node, NVSwitch, 8x NDR 400 Gb/s)",
        peak_flops=gpu_peak_flops("NVIDIA H100 80GB HBM3"),
        memory_bytes=80 * GiB,
        memory_bandwidth=0.9 * 3350e9,
        elementwise_bandwidth=ELEMENTWISE_OF_PEAK * 3350e9,
        efficiency=_H100_EFF,
        **_DGX_H100,
    ),
    "h200": Hardware(
        name="h200",
        description="NVIDIA H200 SXM 141GB, HGX H200 (8 per node, NVSwitch, 8x NDR 400 Gb/s)",
        peak_flops=gpu_peak_flops("NVIDIA H200"),
        memory_bytes=141e9,
        memory_bandwidth=0.9 * 4800e9,
        elementwise_bandwidth=ELEMENTWISE_OF_PEAK * 4800e9,
        efficiency=_H200_EFF,
        **_DGX_H100,
    ),
    # One worker process per "device" on a shared-memory host, gloo over loopback.
    # Placeholder figures of the right order; `plait calibrate` measures the real ones.
    "cpu": Hardware(
        name="cpu",
        description="CPU worker processes (one thread each) on one host, gloo over loopback",
        peak_flops=PeakFlops(fp32=50e9, bf16=50e9, fp16=50e9),
        memory_bytes=8 * GiB,
        memory_bandwidth=10e9,
        devices_per_node=64,
        efficiency=Efficiency(gemm_max=0.6, gemm_half_k=16, gemm_half_flops=2e6, attention=0.3),
        intra_node=Link(bandwidth=2e9, latency=50e-6),
        inter_node=Link(bandwidth=1.1e9, latency=100e-6),
        pcie_bandwidth=10e9,
        host_memory_bandwidth=10e9,
        framework_overhead_bytes=0.4 * GiB,
    ),
}

DEFAULT_GPU = "a100-80gb"


def host_mem_available(path: str = "/proc/meminfo") -> float | None:
    """This host's MemAvailable in bytes (what the kernel can give without swapping), or
    None where it is not reported."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def get_hardware(name: str) -> Hardware:
    """A built-in entry by name (``--gpu``)."""
    key = name.lower()
    if key not in BUILTIN:
        raise ValueError(f"--gpu {name!r} is unknown; choose one of {', '.join(BUILTIN)}")
    return BUILTIN[key]


def load_hardware(gpu: str | None = None, path: str | Path | None = None) -> Hardware:
    """``--hardware FILE`` wins over ``--gpu NAME``; neither gives ``DEFAULT_GPU``."""
    if path is not None:
        return Hardware.from_yaml(path)
    return get_hardware(gpu or DEFAULT_GPU)
