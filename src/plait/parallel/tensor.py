"""Megatron-style tensor parallelism: the layers the transformer is built from.

Communication (axis tp, t = tp size, per transformer layer and micro-batch of b sequences
of s tokens, hidden h, activations of e bytes each):

- forward: one all-reduce after attention's output projection (g) and one after the
  MLP's second GEMM (g): 2 all-reduces of b*s*h*e bytes.
- backward: one all-reduce of the input gradient before attention's q/k/v projections (f)
  and one before the MLP's first GEMM (f): 2 all-reduces of b*s*h*e bytes.
- embedding: one all-reduce forward (b*s*h*e); the vocabulary-parallel cross-entropy:
  three all-reduces forward of b*s*4 bytes each (max, sum of exponentials, target logit).
- with t == 1 nothing is issued.

Every weight has a ``ShardSpec``: which dimension is split over tp and how. ``tp_shard``
cuts a full weight into the shard a tp rank holds; the initialiser, the checkpoint code and
the Hugging Face converter all use it, so a tp=2 run starts from exactly the tp=1 weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.topology import Axis, Topology


@dataclass(frozen=True)
class ShardSpec:
    """``dim`` is split into ``tp // replicas`` parts; tp rank r holds part ``r // replicas``.

    ``dim=None``: replicated on every tp rank. ``replicas > 1`` serves key/value heads when
    there are fewer of them than tp ranks: each head is then held by ``replicas`` ranks.
    """

    dim: int | None = None
    replicas: int = 1


REPLICATED = ShardSpec()


def set_shard(p: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    p.shard_spec = spec
    return p


def shard_spec(p: torch.Tensor) -> ShardSpec:
    return getattr(p, "shard_spec", REPLICATED)


def tp_shard(full: torch.Tensor, spec: ShardSpec, *, tp_rank: int, tp: int) -> torch.Tensor:
    """The one sharding function: the slice of ``full`` that ``tp_rank`` of ``tp`` holds."""
    if spec.dim is None or tp == 1:
        return full
    parts = tp // spec.replicas
    if full.shape[spec.dim] % parts:
        raise ValueError(
            f"dimension {spec.dim} of size {full.shape[spec.dim]} not divisible by {parts}"
        )
    return full.chunk(parts, dim=spec.dim)[tp_rank // spec.replicas]


def full_shape(local_shape: torch.Size, spec: ShardSpec, tp: int) -> tuple[int, ...]:
    shape = list(local_shape)
    if spec.dim is not None:
        shape[spec.dim] *= tp // spec.replicas
    return tuple(shape)


# --- the conjugate pair f / g ---------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, topo=ctx.topo, axis=Axis.TP)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, topo):
        x = x.contiguous()
        comm.all_reduce(x, topo=topo, axis=Axis.TP)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    return x if topo.tp == 1 else _CopyToTP.apply(x, topo)


def reduce_from_tp(x: torch.Tensor, topo: Topology) -> torch.Tensor:
    return x if topo.tp == 1 else _ReduceFromTP.apply(x, topo)


# --- layers ---------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output features: each tp rank computes its slice of y."""

    def __init__(self, in_features, out_features, *, topo: Topology, bias: bool, spec=None):
        super().__init__()
        self.topo = topo
        spec = spec or ShardSpec(dim=0)
        parts = topo.tp // spec.replicas
        if out_features % parts:
            raise ValueError(f"{out_features} output features do not split over tp={topo.tp}")
        local_out = out_features // parts
        self.weight = set_shard(nn.Parameter(torch.empty(local_out, in_features)), spec)
        self.bias = set_shard(nn.Parameter(torch.empty(local_out)), spec) if bias else None

    def forward(self, x):  # (..., in) -> (..., out / tp)
        return F.linear(copy_to_tp(x, self.topo), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input features; x arrives already split, the partial
    products are summed across tp (g), then the replicated bias is added."""

    def __init__(self, in_features, out_features, *, topo: Topology, bias: bool):
        super().__init__()
        self.topo = topo
        if in_features % topo.tp:
            raise ValueError(f"{in_features} input features do not split over tp={topo.tp}")
        w = nn.Parameter(torch.empty(out_features, in_features // topo.tp))
        self.weight = set_shard(w, ShardSpec(dim=1))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):  # (..., in / tp) -> (..., out)
        y = reduce_from_tp(F.linear(x, self.weight), self.topo)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each tp rank owns a contiguous slice of the vocabulary; ids outside it look up zeros,
    and the partial embeddings are summed across tp."""

    def __init__(self, vocab_size: int, hidden: int, *, topo: Topology):
        super().__init__()
        self.topo = topo
        if vocab_size % topo.tp:
            raise ValueError(f"vocabulary {vocab_size} does not split over tp={topo.tp}")
        self.local_vocab = vocab_size // topo.tp
        self.vocab_start = topo.tp_rank * self.local_vocab
        self.weight = set_shard(nn.Parameter(torch.empty(self.local_vocab, hidden)), ShardSpec(0))

    def forward(self, ids):  # (B, T) -> (B, T, C)
        if self.topo.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.topo)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary; the full logits are never gathered."""

    @staticmethod
    def forward(ctx, logits, targets, topo, vocab_start, valid_vocab):
        # logits (N, V/t) float32, targets (N,)
        local_v = logits.shape[-1]
        logits = logits.float()
        if valid_vocab is not None and vocab_start + local_v > valid_vocab:
            # padded vocabulary entries never win and take no probability
            pad_from = max(valid_vocab - vocab_start, 0)
            logits = logits.clone()
            logits[:, pad_from:] = -math.inf
        logits_max = logits.max(dim=-1).values
        comm.all_reduce(logits_max, topo=topo, axis=Axis.TP, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local = targets - vocab_start
        outside = (local < 0) | (local >= local_v)
        picked = shifted.gather(-1, local.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        stacked = torch.stack([picked, sum_exp])
        comm.all_reduce(stacked, topo=topo, axis=Axis.TP)
        picked, sum_exp = stacked[0], stacked[1]
        loss = sum_exp.log() - picked
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local.clamp(0, local_v - 1), outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, topo: Topology, valid_vocab: int | None = None
) -> torch.Tensor:
    """Per-token loss (N,) from vocabulary-split logits (N, V/tp).

    ``valid_vocab``: the real vocabulary size when the model's is padded for tp; padded
    entries are excluded.
    """
    local_v = logits.shape[-1]
    if topo.tp == 1 and (valid_vocab is None or valid_vocab >= local_v):
        return F.cross_entropy(logits.float(), targets, reduction="none")
    return _VocabParallelCrossEntropy.apply(
        logits, targets, topo, topo.tp_rank * local_v, valid_vocab
    )


def tp_gather(local: torch.Tensor, spec: ShardSpec, *, topo: Topology) -> torch.Tensor:
    """Inverse of ``tp_shard``: the full tensor, from every tp rank's shard (collective)."""
    if spec.dim is None or topo.tp == 1:
        return local
    parts = comm.all_gather(local.contiguous(), topo=topo, axis=Axis.TP, dim=spec.dim)
    if spec.replicas == 1:
        return parts
    chunks = parts.chunk(topo.tp, dim=spec.dim)[:: spec.replicas]
    return torch.cat(chunks, dim=spec.dim)
