"""Autograd operations the dense and the MoE blocks share (``transformer.py``,
``moe.py``). Communication: none."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only ``gate`` and ``up`` for the backward (Megatron's fused
    SwiGLU does the same): autograd's ``silu`` then ``mul`` would keep silu(gate) as well,
    one more F-wide tensor a token and block. The backward recomputes silu(gate) and runs
    the very operators autograd would (``mul`` and ``silu_backward``), so the gradients
    are the same, bit for bit."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)
