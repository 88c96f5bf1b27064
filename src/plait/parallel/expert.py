"""Expert parallelism: the E experts of a MoE layer sharded over the n ranks of an ep group,
tokens moved to their experts and back by all-to-all (issue 28). The group is given as
(topo, axis), as ``context.py``'s ring is: any axis whose group is the ep group (until
``Topology`` has an ep axis, a dp sub-group). Rank j of the group holds experts
[j E/n, (j+1) E/n) (``MoE``'s ``ep=``; ``init_weights`` slices them from the full stack).

Communication (axis: the ep group of n ranks; per MoE layer and micro-batch; M the
assignments this rank routes -- N K dropless, fewer when capacity drops some -- h hidden,
e bytes per activation element):

- forward: one ``all_to_all`` of the per-expert counts (E int64, 8E bytes counted), one
  host read of them (the splits), then one ``all_to_all_v`` of the tokens (M h e bytes
  counted, the rows for other ranks sent) and one back of the experts' outputs (R h e,
  R the rows this rank's experts received).
- backward: the two token exchanges again, reversed (R h e, then M h e): the gradient of
  an all-to-all is the all-to-all with the splits swapped.
So 2 (M + R) h e bytes counted per layer and micro-batch; balanced, R = M and each rank
sends (n-1)/n of them. Nothing with n == 1.

Why it cannot deadlock under NCCL's rules: every rank of the group issues the same
collectives (counts, tokens, outputs; in the backward outputs' then tokens' gradients)
in the same order from the training (or autograd) thread, whatever it routes -- a rank
that sends or receives zero rows still takes part with empty pieces -- and the splits
every rank passes agree, because each rank's receive splits are the send splits its
peers told it in the counts exchange.

The trainer's groups and gradient engines under ``--ep``: ``expert_engine.py``.

Order of rows: the sender sorts its rows by global expert, so the rows for rank j are
one contiguous piece; the receiver gets them grouped by source rank, then by its local
expert within, and permutes them to local-expert order (source rank within) for the
experts, and back before returning them.
"""

from __future__ import annotations

import torch

from plait import comm


class _AllToAllV(torch.autograd.Function):
    """Rows exchanged over the ep group; backward: the gradient's rows the other way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, topo, axis):
        ctx.splits, ctx.topo, ctx.axis = (out_splits, in_splits), topo, axis
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        comm.all_to_all_v(out, x, out_splits=out_splits, in_splits=in_splits, topo=topo, axis=axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        comm.all_to_all_v(back, grad.contiguous(), out_splits=in_splits, in_splits=out_splits,
                          topo=ctx.topo, axis=ctx.axis)  # fmt: skip
        return back, None, None, None, None


def exchange_counts(counts: torch.Tensor, *, topo, axis) -> torch.Tensor:
    """counts (E,) rows this rank sends to each global expert -> (n, E/n): row i the rows
    rank i sends to each of this rank's experts."""
    n = topo.size(axis)
    received = torch.empty_like(counts)
    comm.all_to_all_into(received, counts, topo=topo, axis=axis)
    return received.view(n, -1)


def expert_parallel(x: torch.Tensor, counts: torch.Tensor, experts, *, topo, axis,
                    host_counts: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """Run ``experts`` (this rank's E/n, called as ``experts(rows, counts_per_expert)``) on
    the rows routed to them from every rank of the ep group. x (M, C): this rank's rows
    sorted by global expert, ``counts`` (E,) of them per expert, on the device. Returns
    (M, C): each row's expert output, in x's order. Differentiable (module docstring).
    ``host_counts``: ``counts`` already known on the host, the same on every rank of the
    group (``moe.modelled_routing``, the rehearsal's): the counts are exchanged as in a
    real step and the splits taken from these instead of read back."""
    n = topo.size(axis)
    E = counts.numel()
    if E % n:
        raise ValueError(f"{E} experts do not split over an ep group of {n}")
    local = E // n
    received = exchange_counts(counts, topo=topo, axis=axis)  # (n, E/n)
    if host_counts is None:
        both = comm.host_values(torch.cat([counts, received.reshape(-1)]))  # the splits
        sent, got = both[:E], both[E:]
    else:  # every rank sent these: rank i's row here is its counts for this rank's experts
        me = topo.coord(axis)
        sent = list(host_counts)
        mine = host_counts[me * local : (me + 1) * local]
        got = mine * n
    in_splits = [sum(sent[j * local : (j + 1) * local]) for j in range(n)]
    matrix = [got[i * local : (i + 1) * local] for i in range(n)]  # [source][local expert]
    out_splits = [sum(row) for row in matrix]
    rows = _AllToAllV.apply(x, out_splits, in_splits, topo, axis)  # by source, then expert
    order = _expert_order(matrix, device=x.device)  # to local expert, then source
    per_expert = [sum(matrix[i][e] for i in range(n)) for e in range(local)]
    y = experts(rows[order], per_expert)
    y = y[torch.argsort(order)]  # back to source order
    return _AllToAllV.apply(y, in_splits, out_splits, topo, axis)


def _expert_order(matrix: list[list[int]], *, device) -> torch.Tensor:
    """Row indices that take rows grouped [source][expert] to [expert][source]."""
    n, local = len(matrix), len(matrix[0])
    starts, at = [], 0
    for i in range(n):
        row = []
        for e in range(local):
            row.append(at)
            at += matrix[i][e]
        starts.append(row)
    pieces = [torch.arange(starts[i][e], starts[i][e] + matrix[i][e], device=device)
              for e in range(local) for i in range(n)]  # fmt: skip
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)
