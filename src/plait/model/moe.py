"""Mixture of experts: the routed MLP that replaces a block's dense one (issue 28).

Communication (t = tp size; per MoE layer and micro-batch of b sequences of s tokens,
hidden h, e bytes per activation element, E experts, L MoE layers on this rank):

- tensor parallelism: exactly the dense MLP's -- the tokens enter the tp region once (f,
  or the sequence-parallel all-gather) and the experts' partial outputs leave it once (g,
  or the reduce-scatter), b*s*h*e counted bytes each way (``parallel/tensor.py``); with
  sequence parallelism the router and the shared experts save the shard, and the
  backward all-gathers it again (``tensor.keeping_shard``, as the dense groups). The
  router runs inside the region on the whole micro-batch (replicated over tp: E*h
  multiply-adds a token, nothing beside the experts'), so every tp rank makes the same
  routing decisions and routing needs no collective.
- ``token_groups(topo)``: the axes over which one micro-batch's routed tokens are split:
  cp (each cp rank holds 1/cp of every sequence), not tp (its ranks route the gathered
  micro-batch). Over each, per layer and micro-batch, one all-reduce of [load counts
  (E), probability sums (E), z sum, tokens] in fp32, 4 (2E + 2) bytes, so that the
  auxiliary losses and the counts are those of the whole micro-batch (a recomputed
  forward issues it again, on every cp rank alike). Nothing without cp.
- expert parallelism (``ep=(topo, axis)``): ``parallel/expert.py``'s dispatch.
- per optimizer step with ``moe_bias_rate`` > 0 (``update_expert_bias``): one all-reduce
  over dp of the step's load counts of every MoE layer this rank holds, 4 L E bytes
  (``balance_axes``; not over cp: the counts are already whole micro-batches').
All are issued from the training thread in program order, with sizes fixed by the config
(E, L), so every rank of a group issues the same calls in the same order: no deadlock
under NCCL's rules.

Routing: scores in fp32 -- softmax, or sigmoid (DeepSeek-V3) -- over E experts; each token
picks the K best by score plus ``expert_bias`` (aux-loss-free balancing: the bias steers
the choice, never the weights); its weights are the chosen scores, divided by their sum
(``moe_norm_topk``, always with sigmoid). Dropless by default: every token reaches its K
experts. With ``moe_capacity_factor`` C an expert takes at most ceil(C N K / E) of the N
tokens' assignments of its micro-batch, the highest-scoring (ties: the earlier token),
so the same tokens are dropped in every layout. A dropped assignment adds nothing (its
token keeps the residual stream and the other experts).

Auxiliary losses (Switch's load balance E sum_e f_e P_e, f_e the fraction of assignments
and P_e the mean probability of expert e; ST-MoE's z-loss, the mean squared log-sum-exp
of the router logits) reach the gradient without travelling through the pipeline:
``_AttachAux`` adds their gradient when the layer's output gradient passes, scaled by
``aux_loss_scale`` (the runner sets loss scale / micro-batches per step), so the step
optimises coef * their mean over the step's micro-batches whatever the layout.

Experts are stacked weights (E_local, ...) run as a loop over the tokens sorted by
expert (a grouped GEMM would read the same layout); their FFN is split over tp like the
dense MLP (first GEMM(s) by output columns, last by input rows); gpt2's last bias is
added on tp rank 0 only, so the tp sum adds it once.

Shape letters: N tokens of the micro-batch (B*T), C hidden, E experts, K top-k, M routed
assignments, F expert FFN width (on this tp rank).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.model.ops import SwiGLU
from plait.parallel.tensor import (
    ShardSpec,
    enter_tp,
    keeping_shard,
    leave_tp,
    mark_tp_partial,
    set_shard,
    step_cast,
)
from plait.topology import Axis, Topology

_AUX_SCALE = 1.0  # the gradient of the aux losses in the backward (aux_loss_scale)


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """Backward passes in the body scale the aux losses' gradient by ``scale``: the runner
    passes loss scale x micro-batch size / global batch size, so that a step optimises
    coef x (mean over its micro-batches) -- the same at any dp / tp / pp layout. Outside,
    1: one forward and ``loss.backward()`` optimise the loss plus coef x aux."""
    global _AUX_SCALE
    outer, _AUX_SCALE = _AUX_SCALE, scale
    try:
        yield
    finally:
        _AUX_SCALE = outer


def token_groups(topo: Topology) -> tuple[Axis, ...]:
    """The axes over which one micro-batch's routed tokens are split, whose load counts
    (and router statistics) each layer sums per micro-batch: cp, whose ranks each hold
    1/cp of every sequence. Not tp (its ranks route the whole micro-batch -- under
    sequence parallelism, after its all-gather) nor dp (its ranks hold whole
    micro-batches)."""
    return (Axis.CP,) if topo.cp > 1 else ()


def balance_axes(topo: Topology) -> tuple[Axis, ...]:
    """The axes over which ranks hold other micro-batches of a step: dp (the expert bias
    is updated from the whole step's load). Not the token groups: each layer's counts
    are already its whole micro-batch's (``MoE.route``), the same on every rank of one."""
    return (Axis.DP,)


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; in the backward, the aux loss gets gradient ``_AUX_SCALE / t``
    (every tp rank computes the same aux loss and the router's gradients are summed over
    tp: f's all-reduce, ``mark_tp_partial``)."""

    @staticmethod
    def forward(ctx, y, aux, tp):
        ctx.tp = tp
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), _AUX_SCALE / ctx.tp, device=grad.device), None


_MODELLED: float | None = None  # ``modelled_routing``'s imbalance: the rehearsal's routing


@contextlib.contextmanager
def modelled_routing(imbalance: float = 1.0):
    """Every MoE layer routes a micro-batch's N K assignments as the performance model
    prices them (``sim/expert.py``), whatever the scores say: at imbalance g the hottest
    expert takes round(g N K / E) and the others share the rest evenly; at 1 each takes
    N K / E (the first N K mod E one more). The hottest is the first expert of this rank's
    ep group coordinate, so the rank rehearsed is the busiest one the model prices. A
    capacity factor then keeps each expert's first ceil(C N K / E) (which ones is data a
    fake tensor does not have; how many is not). For ``plait rehearse``: the counts are
    known on the host without reading a tensor, and the step runs the very code a real
    one does -- scores, weights and aux losses computed and differentiated, the counts'
    all-to-all issued -- with the host's counts where a real step reads them."""
    global _MODELLED
    outer, _MODELLED = _MODELLED, imbalance
    try:
        yield
    finally:
        _MODELLED = outer


def modelled_counts(assignments: int, experts: int, imbalance: float = 1.0,
                    hot: int = 0) -> list[int]:  # fmt: skip
    """Assignments per expert under ``modelled_routing``: expert ``hot`` the most loaded."""
    if imbalance == 1.0 or experts == 1:
        base, extra = divmod(assignments, experts)
        return [base + (e < extra) for e in range(experts)]
    top = round(imbalance * assignments / experts)
    base, extra = divmod(assignments - top, experts - 1)
    rest = iter(base + (i < extra) for i in range(experts - 1))
    return [top if e == hot else next(rest) for e in range(experts)]


class _RouterLogits(torch.autograd.Function):
    """``F.linear(x.to(dt), weight.to(dt))``, the router's logits in fp32 (or x's wider
    type), keeping x in its own dtype for the backward: autograd kept the fp32 copy, twice
    a bf16 x's bytes (a MoE layer's input, T h a token)."""

    @staticmethod
    def forward(ctx, x, weight, dt):
        # x for the weight's gradient (a frozen router, LoRA's, keeps only the weight)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.dt, ctx.x_dtype = dt, x.dtype
        return F.linear(x.to(dt), weight.to(dt))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = (grad @ weight.to(ctx.dt)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad.t() @ x.to(ctx.dt)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class _Combine(torch.autograd.Function):
    """Each assignment's expert output times its routing weight, added into its token's
    row: ``zeros(N, C).index_add(0, token, ys * weight)``, keeping ``ys`` and the weights
    (for each other's gradients) but not the product, which autograd's ``index_add`` kept
    whole as well (M h a layer)."""

    @staticmethod
    def forward(ctx, ys, weight, token, n):
        w = weight.to(ys.dtype)[:, None]
        ctx.save_for_backward(ys, w, token)
        ctx.weight_dtype = weight.dtype
        return ys.new_zeros(n, ys.shape[1]).index_add_(0, token, ys * w)

    @staticmethod
    def backward(ctx, grad):
        ys, w, token = ctx.saved_tensors
        g = grad.index_select(0, token)  # (M, C): each assignment's row of the gradient
        gys = g * w if ctx.needs_input_grad[0] else None
        gw = (g * ys).sum(-1).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gys, gw, None, None


@dataclass
class Routing:
    """One micro-batch's routing: ``idx`` (N, K) chosen experts, ``weights`` (N, K) fp32
    differentiable, ``keep`` (N, K) or None (dropless), ``counts`` (E,) assignments per
    expert before drops over the whole micro-batch, ``aux`` the differentiable aux loss
    (coefficients applied; this rank's share), ``aux_value`` / ``z_value`` (the whole
    micro-batch's, detached)."""

    idx: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor | None
    counts: torch.Tensor
    aux: torch.Tensor | None
    aux_value: torch.Tensor
    z_value: torch.Tensor
    host_counts: list[int] | None = None  # ``modelled_routing``: counts known on the host
    host_kept: list[int] | None = None  # ... and those a capacity factor keeps of them
    kept_at: torch.Tensor | None = None  # ... at these flat (N K) positions, where it drops


def capacity(cfg, tokens: int) -> int | None:
    """Assignments an expert takes from a micro-batch of ``tokens``: ceil(C N K / E)."""
    if cfg.moe_capacity_factor is None:
        return None
    return math.ceil(cfg.moe_capacity_factor * tokens * cfg.moe_top_k / cfg.moe_experts)


def capacity_keep(idx: torch.Tensor, score: torch.Tensor, *, num_experts: int, cap: int):
    """(N, K) mask of the assignments kept: per expert its ``cap`` best by ``score``,
    ties to the earlier token (stable sorts: deterministic on any device)."""
    flat_e, flat_s = idx.reshape(-1), score.reshape(-1)
    order = torch.sort(flat_s, descending=True, stable=True).indices
    order = order[torch.sort(flat_e[order], stable=True).indices]  # by expert, best first
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(order.numel(), device=idx.device) - starts[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank < cap
    return keep.view_as(idx)


class Experts(nn.Module):
    """``n`` expert MLPs of width ``ffn``, stacked: gpt2 ``w_fc`` (n, F, C), ``b_fc``
    (n, F), ``w_proj`` (n, C, F), ``b_proj`` (n, C); llama ``w_gate``, ``w_up`` (n, F, C),
    ``w_down`` (n, C, F). F is split over tp (``ShardSpec``) like the dense MLP's.
    ``of``: (experts in all, index of the first held) when ``n`` is an ep rank's share."""

    def __init__(self, cfg, n: int, ffn: int, *, topo: Topology, of: tuple[int, int] | None = None):
        super().__init__()
        self.arch, self.topo, self.n = cfg.block, topo, n
        h, tp = cfg.hidden, topo.tp
        if ffn % tp:
            raise ValueError(f"expert FFN width {ffn} does not split over --tp {tp}")
        f = ffn // tp

        def param(*shape, dim):
            p = set_shard(nn.Parameter(torch.empty(*shape)), ShardSpec(dim=dim))
            if of is not None:
                p.expert_shard = of  # init_weights: slice of the (of[0], ...) full tensor
            return p

        if self.arch == "gpt2":
            self.w_fc, self.b_fc = param(n, f, h, dim=1), param(n, f, dim=1)
            self.w_proj, self.b_proj = param(n, h, f, dim=2), param(n, h, dim=None)
            if tp > 1:  # added on tp rank 0 only (bias_share), summed over tp
                mark_tp_partial(self.b_proj)
            # on the CPU whatever the build's device, as MoE's routing state (below)
            self.register_buffer("bias_share", torch.tensor(float(topo.tp_rank == 0),
                                 device="cpu"), persistent=False)  # fmt: skip
        else:
            self.w_gate, self.w_up = param(n, f, h, dim=1), param(n, f, h, dim=1)
            self.w_down = param(n, h, f, dim=2)
        self.lora = None  # {weight name: ExpertLoRA} under --lora-rank (model/lora.py)

    def autocast_params(self) -> list[nn.Parameter]:
        """The stacked weights (and GPT-2's first bias), which only ``F.linear`` reads, through
        their one compute-dtype copy of a step: ZeRO-3 gathers them in the compute dtype
        (``zero_units.compute_dtype_params``). Gathered in fp32, each layer's cast was a
        new tensor the step's ``weight_casts`` kept to the step's end, every expert weight
        of the rank held at once (rehearsed: a MoE block 1.083 of the model at ZeRO-3)."""
        if self.arch == "gpt2":
            return [self.w_fc, self.b_fc, self.w_proj]
        return [self.w_gate, self.w_up, self.w_down]

    def _linear(self, name: str, x: torch.Tensor, e: int, bias=None,
                stacks: dict | None = None) -> torch.Tensor:  # fmt: skip
        """x times expert e's weight ``name`` (plus its adapter's update, if it has one).
        Under autocast the stacked weight is cast once a step (``tensor.step_cast``), not
        once per expert and micro-batch: autocast's copies were kept for each
        micro-batch's backward, E/ep x 3 h F / t elements a layer and micro-batch in
        flight (rehearsed: a tiny llama MoE layer held 8.25 of its 84 units in them).
        ``stacks``: the forward's uses of the copies, one per weight (each use is an
        autograd node that casts its gradient back: one per expert would cast the whole
        stack's gradient E times)."""
        stacked = None if stacks is None else stacks.get(name)
        if stacked is None:
            stacked = step_cast((self, name), getattr(self, name), x.device.type)
            if stacks is not None:
                stacks[name] = stacked
        y = F.linear(x, stacked[e], bias)
        if self.lora is not None and name in self.lora:
            y = y + self.lora[name](x, e)
        return y

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (M, C) sorted by expert, ``counts[e]`` rows for expert e -> (M, C), a partial
        sum over tp. An expert with no rows still takes part (zero gradients)."""
        out, stacks = [], {}

        def lin(name, xe, e, bias=None):
            return self._linear(name, xe, e, bias, stacks)

        for e, xe in enumerate(x.split(counts)):
            if self.arch == "gpt2":
                hid = F.gelu(lin("w_fc", xe, e, self.b_fc[e]), approximate="tanh")
                y = lin("w_proj", hid, e)  # the bias in y's dtype, as F.linear adds one:
                y = y + (self.b_proj[e] * self.bias_share).to(y.dtype)  # fp32 doubled the rows
            else:
                hid = SwiGLU.apply(lin("w_gate", xe, e), lin("w_up", xe, e))
                y = lin("w_down", hid, e)
            out.append(y)
        return torch.cat(out)


class MoE(nn.Module):
    """The routed MLP of one block: router, ``experts`` (all E, or this ep rank's E/n
    with ``ep=(topo, axis)``), optional ``shared`` experts every token goes through.
    x (B, T, C) -- (B, T/t, C) under sequence parallelism -- to the same shape.

    ``token_axes``: where the micro-batch's tokens are split (default ``token_groups``)."""

    def __init__(self, cfg, *, topo: Topology, sequence_parallel: bool = False, ep=None,
                 token_axes: tuple | None = None):  # fmt: skip
        super().__init__()
        self.cfg, self.topo, self.sequence_parallel, self.ep = cfg, topo, sequence_parallel, ep
        self.token_axes = token_groups(topo) if token_axes is None else tuple(token_axes)
        E, n_ep = cfg.moe_experts, 1 if ep is None else ep[0].size(ep[1])
        if E % n_ep:
            raise ValueError(f"--moe-experts {E} do not split over --ep {n_ep}")
        self.router = nn.Linear(cfg.hidden, E, bias=False)
        if topo.tp > 1:
            mark_tp_partial(self.router.weight)
        # The routing state (expert bias, statistics: E numbers each) is built on the CPU
        # whatever the build's device: a model built on meta (ZeRO-3: parameters only,
        # ``transformer.hollow``) still holds it, and ``hollow`` moves it to the device.
        if cfg.moe_bias_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E, device="cpu"))
        else:
            self.expert_bias = None
        of = None
        if ep is not None:
            of = (E, ep[0].group_ranks[ep[1]].index(ep[0].rank) * (E // n_ep))
        self.experts = Experts(cfg, E // n_ep, cfg.moe_ffn_hidden, topo=topo, of=of)
        self.shared = None
        if cfg.moe_shared_experts:
            width = cfg.moe_shared_experts * cfg.moe_ffn_hidden
            self.shared = Experts(cfg, 1, width, topo=topo)
        self.reset_stats()
        self._bias_load = torch.zeros(E, dtype=torch.float64, device="cpu")

    # -- statistics ----------------------------------------------------------------------

    def reset_stats(self) -> None:
        E = self.cfg.moe_experts
        cpu = dict(dtype=torch.float64, device="cpu")  # (moved on first use: ``_record``)
        self._load = torch.zeros(E, **cpu)  # assignments per expert
        self._dropped = torch.zeros((), **cpu)
        self._aux = torch.zeros(2, **cpu)  # aux, z summed over micro-batches
        self._micro_batches = 0

    def _record(self, r: Routing) -> None:
        """A training forward's statistics (not a recomputation's: it would count twice)."""
        if not self.training or torch._C._current_graph_task_id() != -1:
            return
        dev = r.counts.device
        if self._load.device != dev:
            self._load, self._dropped = self._load.to(dev), self._dropped.to(dev)
            self._aux, self._bias_load = self._aux.to(dev), self._bias_load.to(dev)
        self._load += r.counts
        self._bias_load += r.counts
        if r.keep is not None:
            self._dropped += (~r.keep).sum()
        elif r.host_kept is not None:
            self._dropped += sum(r.host_counts) - sum(r.host_kept)
        self._aux += torch.stack([r.aux_value, r.z_value])
        self._micro_batches += 1

    # -- routing -------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Routing:
        """x (N, C) -> this micro-batch's ``Routing`` (module docstring)."""
        cfg, E, K = self.cfg, self.cfg.moe_experts, self.cfg.moe_top_k
        dt = torch.promote_types(x.dtype, torch.float32)  # fp32, or the input's wider type
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = _RouterLogits.apply(x, self.router.weight, dt)  # (N, E)
        if cfg.moe_router == "softmax":
            scores = probs = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        pick = scores if self.expert_bias is None else scores.detach() + self.expert_bias
        idx = pick.topk(K, dim=-1).indices  # (N, K)
        host = None
        if _MODELLED is not None:
            idx, host = self._modelled_choices(x.shape[0], x.device)
        weights = scores.gather(-1, idx)
        if cfg.moe_norm_topk or cfg.moe_router == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if host is None:
            counts = torch.bincount(idx.reshape(-1), minlength=E).to(dt)
        else:
            counts = torch.tensor(host, dtype=dt, device=x.device)
        # (N,): differentiated only under a z loss; else statistics, no graph to keep
        z = (logits if cfg.moe_z_loss_coef > 0 else logits.detach()).logsumexp(-1).square()
        stats = torch.cat([counts, probs.detach().sum(0), z.detach().sum()[None],
                           x.new_full((1,), x.shape[0], dtype=dt)])  # fmt: skip
        for axis in self.token_axes:  # the whole micro-batch's
            comm.all_reduce(stats, topo=self.topo, axis=axis)
        counts, prob_sum, z_sum, n = stats[:E], stats[E : 2 * E], stats[2 * E], stats[2 * E + 1]
        frac = counts / (n * K)  # f_e: sums to 1
        aux_value, z_value = E * (frac * prob_sum / n).sum(), z_sum / n
        aux = None
        if cfg.moe_aux_loss_coef > 0:  # this rank's tokens' share, with the global f and n
            aux = cfg.moe_aux_loss_coef * E * (frac * probs.sum(0) / n).sum()
        if cfg.moe_z_loss_coef > 0:
            z_loss = cfg.moe_z_loss_coef * z.sum() / n
            aux = z_loss if aux is None else aux + z_loss
        if host is None:
            whole = int(n.item()) if self.token_axes else x.shape[0]
        else:  # modelled: every rank of the token axes holds as many tokens as this one
            whole = x.shape[0] * math.prod(self.topo.size(a) for a in self.token_axes)
        keep, cap = None, capacity(cfg, whole)
        kept, kept_at = host, None
        if cap is not None and host is None:
            keep = capacity_keep(idx, scores.detach().gather(-1, idx), num_experts=E, cap=cap)
        elif cap is not None and max(host) > cap:  # modelled: each expert's first ``cap``
            kept = [min(c, cap) for c in host]
            kept_at = self._modelled_kept(x.shape[0], host, kept, x.device)
        return Routing(idx, weights, keep, counts, aux, aux_value, z_value, host, kept, kept_at)

    def _modelled_kept(self, N: int, counts: list[int], kept: list[int], device):
        """Flat (N K, row-major) positions of the assignments a capacity factor keeps under
        ``modelled_routing``: each expert's first ``kept[e]`` in ``_modelled_choices``'
        layout, in flat order (as ``capacity_keep``'s mask selects them)."""
        E, K = self.cfg.moe_experts, self.cfg.moe_top_k
        pieces, start = [], 0
        for e, (c, k) in enumerate(zip(counts, kept)):
            if _MODELLED == 1.0:  # balanced, expert j mod E: j = e + E i
                pieces.append(torch.arange(e, e + E * k, E, device=device))
            else:  # laid out by expert, dealt a slot at a time: p = k N + t is t K + k
                p = torch.arange(start, start + k, device=device)
                pieces.append((p % N) * K + p // N)
            start += c
        return torch.cat(pieces).sort().values

    def _modelled_choices(self, N: int, device) -> tuple[torch.Tensor, list[int]]:
        """(idx (N, K), assignments per expert) under ``modelled_routing``: the counts of
        ``modelled_counts``, laid out by expert over the N K assignments and dealt to the
        tokens a slot at a time (assignment j to token j mod N), so a token never picks an
        expert twice (each expert's run is at most N long: g <= E / K)."""
        E, K = self.cfg.moe_experts, self.cfg.moe_top_k
        hot = 0
        if self.ep is not None:  # the first expert of this rank's ep coordinate
            topo, axis = self.ep
            hot = topo.coord(axis) * (E // topo.size(axis))
        counts = modelled_counts(N * K, E, _MODELLED, hot)
        if _MODELLED == 1.0:
            idx = torch.arange(N * K, device=device) % E  # balanced: expert j mod E
            return idx.view(N, K), counts
        ends = torch.tensor(counts, device=device).cumsum(0)[:-1]
        flat = torch.bucketize(torch.arange(N * K, device=device), ends, right=True)
        return flat.view(K, N).t(), counts

    # -- forward -------------------------------------------------------------------------

    def forward(self, x):  # (B, T, C) or (B, T/t, C) -> the same
        full = enter_tp(x, self.topo, self.sequence_parallel)
        B, T, C = full.shape
        # sequence parallelism: what the router and the shared experts save of the gathered
        # input is this rank's shard, gathered again in the backward, as the dense blocks'
        with keeping_shard(x, full, self.topo, self.sequence_parallel) as kept:
            xf = full.reshape(B * T, C)
            r = self.route(xf)
            self._record(r)
            y = self._routed(xf, r)  # (N, C), partial over tp
            if self.shared is not None:
                y = y + self.shared(xf, [xf.shape[0]])
            if r.aux is not None and torch.is_grad_enabled():
                y = _AttachAux.apply(y, r.aux, self.topo.tp)
        if kept is not None:  # the backward re-gathers the input under the experts'
            kept.prefetch_from(y)
        return leave_tp(y.view(B, T, C), self.topo, self.sequence_parallel)

    def _routed(self, xf: torch.Tensor, r: Routing) -> torch.Tensor:
        """Permute the kept assignments to expert order, run the experts (here or over
        the ep group), and add each back to its token times its weight."""
        N, K = r.idx.shape
        E = self.cfg.moe_experts
        expert = r.idx.reshape(-1)
        token = torch.arange(N, device=xf.device).repeat_interleave(K)
        weight = r.weights.reshape(-1)
        kept = r.keep.reshape(-1) if r.keep is not None else r.kept_at
        if kept is not None:
            expert, token, weight = expert[kept], token[kept], weight[kept]
        order = torch.argsort(expert, stable=True)  # (M,), tokens by expert
        token, weight = token[order], weight[order]
        if r.host_counts is None:
            counts = torch.bincount(expert, minlength=E)
        else:  # modelled_routing: known on the host
            counts = torch.tensor(r.host_kept, device=xf.device)
        xs = xf[token]  # (M, C)
        if self.ep is None:
            ys = self.experts(xs, counts.tolist() if r.host_counts is None else r.host_kept)
        else:
            from plait.parallel.expert import expert_parallel

            ys = expert_parallel(xs, counts, self.experts, topo=self.ep[0], axis=self.ep[1],
                                 host_counts=r.host_kept)  # fmt: skip
        return _Combine.apply(ys, weight, token, N)


# -- the model's MoE layers --------------------------------------------------------------


def moe_layers(model: nn.Module) -> list[MoE]:
    """``model``'s MoE layers, found once per model (the trainer asks every step, and a
    walk of every module is Python time the GPU waits for): a model gains or loses no MoE
    layer after it is built."""
    found = model.__dict__.get("_plait_moe_layers")
    if found is None:
        found = model.__dict__["_plait_moe_layers"] = [
            m for m in model.modules() if isinstance(m, MoE)
        ]
    return found


_KEYS = ("moe_tokens_min", "moe_tokens_max", "moe_tokens_mean", "moe_imbalance",
         "moe_dropped", "moe_aux_loss", "moe_z_loss")  # fmt: skip


def _layer_of(name: str) -> int:
    """The global layer index of a module named ``...blocks.<i>.mlp``."""
    return int(name.split("blocks.")[-1].split(".")[0])


def _rows(layers: list[MoE]) -> torch.Tensor:
    """(L, E + 4) float64: each layer's [assignments per expert (E), dropped, aux sum,
    z sum, micro-batches] since its last reset."""
    return torch.stack([torch.cat([m._load.double(), m._dropped.double()[None],
                                   m._aux.double().to(m._load.device),
                                   m._load.new_full((1,), m._micro_batches)])
                        for m in layers])  # fmt: skip


def _summary(table: torch.Tensor) -> dict:
    """``_rows``' table (of any layers, summed over any ranks) -> the metrics: tokens per
    expert per layer and micro-batch (min / max / mean; imbalance = max / mean, the largest
    over layers), dropped fraction of the assignments, mean aux and z losses."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(table):  # ``plait rehearse``: no values to summarise
        return {}
    table = table[table[:, -1] > 0].double().cpu()
    if not len(table):
        return {}
    mb = table[:, -1:]
    loads = table[:, :-4] / mb  # (L, E)
    mean = loads.mean(-1)
    aux = (table[:, -3:-1] / mb).mean(0)
    values = torch.cat([
        loads.min(-1).values.min()[None], loads.max(-1).values.max()[None], mean.mean()[None],
        (loads.max(-1).values / mean.clamp_min(1e-12)).max()[None],
        (table[:, -4].sum() / table[:, :-4].sum().clamp_min(1))[None], aux,
    ])  # fmt: skip
    return dict(zip(_KEYS, values.tolist()))


def moe_stats(model: nn.Module, *, reset: bool = True) -> dict:
    """This rank's MoE statistics since the last reset, over its MoE layers (``_summary``;
    no reduction: dp ranks differ -- ``stats_table`` is the run's). {} without MoE layers
    or micro-batches."""
    layers = [m for m in moe_layers(model) if m._micro_batches]
    if not layers:
        return {}
    out = _summary(_rows(layers))
    if reset:
        for m in layers:
            m.reset_stats()
    return out


def stats_table(model: nn.Module, cfg, *, count: bool, device) -> torch.Tensor:
    """(n_layers x (E + 4),) float64 on ``device``: ``_rows`` of this rank's MoE layers at
    their global layer's row (zeros elsewhere, and everywhere if not ``count``: a tp rank
    other than 0 routes the same tokens as rank 0, a cp rank other than 0 holds the same
    whole-micro-batch counts as cp rank 0), then resets them. Summed over every
    rank -- dp ranks' other micro-batches, pp stages' other layers -- it is the whole
    step's, the same at any layout (``summary_of``). Empty without MoE: the trainer adds
    it to its one statistics all-reduce."""
    if not cfg.moe:
        return torch.zeros(0, dtype=torch.float64, device=device)
    table = torch.zeros(cfg.n_layers, cfg.moe_experts + 4, dtype=torch.float64, device=device)
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m._micro_batches:
            if count:
                table[_layer_of(name)] = _rows([m])[0].to(device)
            m.reset_stats()
    return table.reshape(-1)


def summary_of(values, cfg) -> dict:
    """The metrics (``_summary``) of ``stats_table``'s values summed over the ranks."""
    if not cfg.moe:
        return {}
    return _summary(torch.tensor(values, dtype=torch.float64).view(cfg.n_layers, -1))


@torch.no_grad()
def update_expert_bias(model: nn.Module, topo: Topology) -> None:
    """After an optimizer step: each MoE layer's expert bias += rate * sign(mean load -
    load), the load summed over the step's micro-batches and over every rank holding
    other tokens (``balance_axes``): one all-reduce per axis of (L, E) counts. Every rank
    of a dp group holds the same layers, so every one issues it. Resets the step's load."""
    layers = [m for m in moe_layers(model) if m.expert_bias is not None]
    if not layers:
        return
    load = torch.stack([m._bias_load.to(m.expert_bias.device) for m in layers]).float()
    for axis in balance_axes(topo):
        comm.all_reduce(load, topo=topo, axis=axis)
    for m, lo in zip(layers, load):
        m.expert_bias += m.cfg.moe_bias_rate * torch.sign(lo.mean() - lo)
        m._bias_load = torch.zeros_like(m._bias_load)
