"""Which kernels the layers take when a rehearsal sizes a GPU run on the CPU.

``plait rehearse`` runs a rank's real program on fake tensors that live on the CPU. Where
a layer's CUDA path differs from its CPU path in what it holds (PyTorch's fused RMSNorm,
whose backward has a CUDA kernel and a meta one only; context parallelism's fused
attention, which the CPU kernel runs on fp32 copies of q, k and v), the rehearsal takes
the CUDA path, as the GPU run being sized does: ``rehearsing_gpu_kernels`` around it, and
the layers ask ``rehearsing_gpu``. No communication here. A module of its own so that
the model and the parallel layers it calls can both read it without importing each
other."""

from __future__ import annotations

import contextlib

_ON_FAKE = False


def rehearsing_gpu() -> bool:
    """Inside ``rehearsing_gpu_kernels``: fake tensors on the CPU stand for a GPU's."""
    return _ON_FAKE


@contextlib.contextmanager
def rehearsing_gpu_kernels():
    """``plait rehearse``: its fake tensors take the CUDA paths -- a norm's backward holds
    three fp32 copies of its input with PyTorch's kernels, six with the operations of the
    CPU's path; a ring block's attention keeps q, k and v in their own dtype."""
    global _ON_FAKE
    before, _ON_FAKE = _ON_FAKE, True
    try:
        yield
    finally:
        _ON_FAKE = before
