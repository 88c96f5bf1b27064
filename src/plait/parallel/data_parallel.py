"""Gradient synchronisation over the dp axis.

Communication (axis dp, d = dp size, N parameters on this rank, 4-byte gradients): once per
optimizer step, after the last micro-batch's backward, the gradients are all-reduced in
flat buckets of at most ``bucket_bytes``: ceil(4N / bucket_bytes) all-reduces moving 4N
bytes in all. The loss is already divided by the *global* token count, so a sum over dp
gives the exact global mean gradient whatever d is. With d == 1 nothing is issued.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait import comm
from plait.topology import Axis, Topology


class GradSync:
    """Plain synchronous bucketed all-reduce of every gradient over dp."""

    sharded = False  # gradients are whole on every dp rank afterwards

    def __init__(self, params, *, topo: Topology, bucket_bytes: int = 25 * 2**20):
        self.topo = topo
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[list[torch.nn.Parameter]] = []
        size, bucket = 0, []
        for p in reversed(self.params):  # backward produces gradients roughly in reverse
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(bucket)
                size, bucket = 0, []
        if bucket:
            self.buckets.append(bucket)

    def finish(self) -> None:
        """Call after the last micro-batch's backward: all-reduce the gradients over dp."""
        if self.topo.dp == 1:
            return
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = _flatten_dense_tensors(grads)
            comm.all_reduce(flat, topo=self.topo, axis=Axis.DP)
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, grads)):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)
