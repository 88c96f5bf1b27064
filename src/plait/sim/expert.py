"""Mixtures of experts and expert parallelism in the performance model: what a MoE block's
MLP computes, holds and moves per layer (the model: ``model/moe.py``; the dispatch:
``parallel/expert.py``).

Letters, per tp rank and micro-batch: T = b s / cp tokens (the whole micro-batch: every tp
rank routes all of it, after the sequence-parallel all-gather), E experts, K top-k, S
shared experts, F the expert FFN width (``moe_ffn_hidden``, split over t = tp), n = ep,
h hidden, e bytes per activation element, c = 2 FFN matrices for GELU (gpt2), 3 for
SwiGLU (llama). M = T K the assignments a rank routes (dropless; a capacity factor C
keeps at most C T K / E of each expert's: M the kept ones, ``rows``).

Imbalance g (``Runtime.moe_imbalance``, ``--moe-imbalance``; default 1.0): the most-loaded
expert's assignments over the mean, the ``moe_imbalance`` ``plait train`` logs. The
default is a balanced router -- the Switch auxiliary loss or DeepSeek-V3's bias keep it
near 1 once training settles (a few percent above, at the micro-batch level) -- and is
what the published MoE throughput figures assume; a run measured at 1.3 is priced at
1.3 by passing it; at most E / K (an expert cannot take more than every token). The
hottest expert is routed g T K / E of a rank's assignments, each other (E - g) / (E - 1)
T K / E; a capacity factor C keeps at most C T K / E of each (the rest are dropped, not
sent elsewhere). The busiest ep rank holds the hottest expert and E/n - 1 others, and
every rank of its group sends it as many, so its experts receive R = n (hot + (E/n - 1)
cold) rows: R = M at n = 1 (every expert on one rank), n g T K / E at n = E without a
cap (``rows``). Every ep rank waits for it (the all-to-all that returns its outputs), so
a layer costs what the busiest rank does.

Compute per MoE layer, forward, on the busiest rank (``mlp_cost``): the router, a
(T, E, h) GEMM in fp32; the routed experts, E/n GEMMs of R n / E rows each (c h F / t
weights; ``costs.gemm_time`` with a batch: a grouped GEMM, whose weight reads dominate
when experts get few rows); the shared experts, one (T, S F / t, h) MLP; memory-bound
streams of the router's fp32 scores (4 T E 4 bytes), the experts' activation (c F / t per
row), and the permutations (gather M rows, permute R in and out, weight and scatter-add
M: 2 (3 M + 2 R) h e). The backward doubles them as ``costs.py`` does. The dense MLP's
GEMMs, activation and kernels are what it replaces. FLOPs for MFU count the active
parameters (``sizes.model_flops_per_token``): imbalance and routing overhead lower MFU.

Bytes per MoE layer and micro-batch (``layer_bytes``), ``parallel/expert.py``'s
docstring, counted as ``comm.py`` counts (the input of each call):

    forward   8 E (the counts) + (M + R) h e      sent (n-1)/n of (M + R) h e, + 8 E (n-1)/n
    backward  (M + R) h e                         sent (n-1)/n of it
    with full recomputation the forward's again inside the backward

so 2 (M + R) h e + 8 E, 4 M h e + 8 E balanced (R = M). Nothing at n = 1.

Time (``layer_comm``), on the ep link (``link``: the n ranks of an ep group are
consecutive dp ranks, cp x tp apart in the rank order -- inside a node while n cp tp <=
devices per node, otherwise over the network): forward, the counts' all-to-all (latency:
(n-1) messages of 8E/n bytes), one host read of the splits (``Hardware.launch_s``: the
device drains its queue once per layer), then the two token exchanges; backward the two
token exchanges again. Each is an all-to-all of R h e counted bytes (the busiest rank's;
``context.all_to_all_time``), nothing hidden: the exchange sits between the router and
the experts, and the next block needs its output. (Megatron-Core and DeepSeek-V3 overlap
it with another micro-batch's compute; plait does not, and the model does not either.)

Memory: a rank holds its E/n experts of every MoE layer (``expert_params``), their
gradients and optimizer state sharded by ZeRO over the edp = dp / ep ranks holding the
same experts (the dense state over dp as before; ``--zero-shard-group`` applies to the
dense state, the experts shard over their whole edp group); the router and the shared
experts are dense state. Activations of a MoE layer (``activation_bytes``) replace the
dense MLP's c f / t per token with: the router's fp32 logits and probabilities (2 E 4 per
token), each routed row's weighted output and fp32 weight (M (h e + 4)), the experts'
inputs and hidden activations on the busiest rank (R (h + c F / t) e), the shared
experts' hidden (T c S F / t e), and the gathers' int64 positions (``index_bytes``: 8 (T K
+ 2 M), + 16 R under ep). Gradients of expert parameters are reduced over edp
(ranks ep cp tp apart), the dense ones over dp.

Not modelled: overlap of the dispatch with compute, expert tensor parallelism other than the
dense MLP's split, the load-balancing statistics' all-reduce over the cp ring (4 (2E + 2)
bytes per MoE layer and micro-batch under cp), the aux-loss-free bias all-reduce (4 L E
bytes once a step), and where the trainer places ep groups under cp (blocks of the
dp x cp ranks: a replica's cp ranks may share one).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.layout import Layout
from plait.model import sizes
from plait.model.config import ModelConfig
from plait.sim.collectives import group_link
from plait.sim.context import LayerBytes, act_bytes, all_to_all_time
from plait.sim.hardware import Hardware, Link

FP32 = 4
# Kernels of the dense MLP that a MoE block replaces: gpt2 fc, GELU, proj; llama gate, up,
# down, SiLU, product (``costs.LAYER_KERNELS`` counts them): (forward kernels, linears).
DENSE_MLP_KERNELS = {"gpt2": (3, 2), "llama": (5, 3)}
# A MoE block's MLP, forward: the router and its bookkeeping (linear, softmax, top-k,
# gather, normalise, bincount, log-sum-exp, square, statistics, sort, index, gather rows,
# weight, scatter-add: ~20) and per expert run (gpt2: fc, GELU, proj, bias, add; llama:
# gate, up, down, SiLU, product): 5.
ROUTER_KERNELS = 20
EXPERT_KERNELS = 5


def check_imbalance(cfg: ModelConfig, imbalance: float) -> None:
    """Raise ValueError (one line naming the flag) unless 1 <= imbalance <= E / K."""
    if not cfg.moe:
        return
    top = cfg.moe_experts / cfg.moe_top_k
    if not 1.0 <= imbalance <= top * (1 + 1e-9):
        raise ValueError(
            f"--moe-imbalance {imbalance:g}: the most-loaded expert over the mean must be "
            f"between 1 (balanced) and --moe-experts / --moe-top-k = {top:g}"
        )


def tokens(cfg: ModelConfig, layout: Layout) -> float:
    """T: tokens one tp rank routes per micro-batch (the whole micro-batch's s / cp)."""
    return layout.micro_batch_size * cfg.seq_len / layout.cp


def rows(cfg: ModelConfig, layout: Layout, imbalance: float) -> tuple[float, float]:
    """(M, R): assignments one rank routes and keeps, rows the busiest rank's experts
    receive (module docstring). Of a rank's A = T K assignments the hottest expert is
    routed g A / E, every other (E - g) / (E - 1) A / E; a capacity factor keeps at most
    C A / E of each (the excess is dropped, not sent elsewhere). The busiest ep rank holds
    the hottest expert and E/n - 1 others, and every rank of its group sends it as many."""
    A = tokens(cfg, layout) * cfg.moe_top_k
    E, n = cfg.moe_experts, layout.ep
    mean = A / E
    hot = imbalance * mean
    cold = (E - imbalance) / (E - 1) * mean if E > 1 else hot
    if cfg.moe_capacity_factor is not None:
        cap = cfg.moe_capacity_factor * mean
        hot, cold = min(hot, cap), min(cold, cap)
    M = hot + (E - 1) * cold
    if n == 1:
        return M, M
    return M, n * (hot + (E // n - 1) * cold)


def layer_bytes(cfg: ModelConfig, layout: Layout, imbalance: float = 1.0) -> LayerBytes:
    """Bytes of one MoE layer's dispatch and micro-batch on the busiest ep rank (module
    docstring; at imbalance 1 every rank's)."""
    n = layout.ep
    if n == 1 or not cfg.moe:
        return LayerBytes()
    M, R = rows(cfg, layout, imbalance)
    e, frac = act_bytes(layout), (n - 1) / n
    counts = 8 * cfg.moe_experts
    moved = (M + R) * cfg.hidden * e
    return LayerBytes(counts + moved, moved, frac * (counts + moved), frac * moved)


def link(hw: Hardware, layout: Layout) -> Link | None:
    """The ep group's link: n consecutive dp ranks, cp x tp apart."""
    return group_link(hw, layout.ep, layout.cp * layout.tp)


def layer_comm(
    cfg: ModelConfig, layout: Layout, hw: Hardware, imbalance: float
) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one MoE layer's dispatch (module docstring)."""
    n = layout.ep
    if n == 1 or not cfg.moe:
        return 0.0, 0.0
    lk = link(hw, layout)
    _, R = rows(cfg, layout, imbalance)
    tokens_a2a = all_to_all_time(R * cfg.hidden * act_bytes(layout), n, lk)
    counts = all_to_all_time(8 * cfg.moe_experts, n, lk)
    return counts + hw.launch_s + 2 * tokens_a2a, 2 * tokens_a2a


@dataclass(frozen=True)
class MLPCost:
    """A MoE block's MLP on the busiest rank, one micro-batch: (forward, input-gradient,
    weight-gradient) seconds of the GEMMs on each side of the activation (``up``: router,
    routed and shared first GEMMs; ``down``: the last ones), forward memory-bound bytes,
    and kernels (forward, weight-gradient linears). ``shared_down``: the forward seconds of
    the shared experts' down GEMM (of ``down[0]``), the block's last GEMM: plait runs the
    shared experts after the routed ones' combine, so a recomputation that stops at the
    last saved tensor (``Runtime.recompute_stops_early``) does not run it again."""

    up: tuple[float, float, float]
    down: tuple[float, float, float]
    stream_bytes: float
    kernels: int
    linears: int
    shared_down: float = 0.0


def mlp_cost(cfg: ModelConfig, layout: Layout, hw: Hardware, imbalance: float, *,
             gemm_time, linear_times) -> MLPCost:  # fmt: skip
    """Compute of one MoE block's MLP (module docstring). ``gemm_time`` and
    ``linear_times``: ``costs.py``'s GEMM timings, handed in by it (costs imports this
    module)."""

    dtype, t, h = layout.dtype, layout.tp, cfg.hidden
    e = act_bytes(layout)
    T = tokens(cfg, layout)
    M, R = rows(cfg, layout, imbalance)
    E, local, S = cfg.moe_experts, cfg.moe_experts // layout.ep, cfg.moe_shared_experts
    c = 2 if cfg.arch == "gpt2" else 3
    F_t = cfg.moe_ffn_hidden / t
    per = R / local  # rows per local expert

    def grouped(m, n_, k, batch):
        return (gemm_time(hw, dtype, m, n_, k, batch), gemm_time(hw, dtype, m, k, n_, batch),
                gemm_time(hw, dtype, n_, k, m, batch))  # fmt: skip

    router = linear_times(hw, "fp32", T, E, h)
    up_cols = (c - 1) * F_t  # gpt2 fc; llama gate and up together
    parts_up = [router, grouped(per, up_cols, h, local)]
    parts_down = [grouped(per, h, F_t, local)]
    shared_down = 0.0
    if S:
        parts_up.append(linear_times(hw, dtype, T, (c - 1) * S * F_t, h))
        parts_down.append(linear_times(hw, dtype, T, h, S * F_t))
        shared_down = parts_down[-1][0]
    up = tuple(sum(x[i] for x in parts_up) for i in range(3))
    down = tuple(sum(x[i] for x in parts_down) for i in range(3))
    stream = 4 * T * E * FP32 + e * (R * c * F_t + T * c * S * F_t + 2 * (3 * M + 2 * R) * h)
    kernels = ROUTER_KERNELS + EXPERT_KERNELS * (local + (1 if S else 0))
    linears = 1 + c * (local + (1 if S else 0))  # the router; each expert's matrices
    return MLPCost(up, down, stream, kernels, linears, shared_down)


def expert_params(cfg: ModelConfig, layout: Layout) -> float:
    """Parameters of one MoE layer's routed experts one (tp, ep) rank holds: E/n experts
    of c h F / t weights (gpt2 also the fc bias F / t and the replicated proj bias h)."""
    return layer_expert_params(cfg, ep=layout.ep, tp=layout.tp)


def layer_expert_params(cfg: ModelConfig, *, ep: int, tp: int) -> float:
    """``expert_params`` at ``ep`` and ``tp`` (at 1 and 1: all of a layer's routed experts,
    as ``sizes.num_params`` counts them)."""
    if not cfg.moe:
        return 0.0
    local, t = cfg.moe_experts / ep, tp
    one = sizes.expert_matmul_params(cfg) / t
    if cfg.biases:
        one += cfg.moe_ffn_hidden / t + cfg.hidden
    return local * one


def mlp_matmul_extra(cfg: ModelConfig, layout: Layout) -> float:
    """Matrix weights one MoE layer's MLP has on a (tp, ep) rank over the dense MLP's: its
    E / ep routed experts and the shared ones, each c h F / t, less the dense c h f / t
    (the router apart: fp32, no cast)."""
    experts = cfg.moe_experts / layout.ep + cfg.moe_shared_experts
    dense = sizes.dense_mlp_matmul_params(cfg)
    return (experts * sizes.expert_matmul_params(cfg) - dense) / layout.tp


def dense_part_extra(cfg: ModelConfig, layout: Layout) -> float:
    """What one MoE layer's non-expert MLP parameters (router, shared experts) add over the
    dense MLP's, per tp rank (biases unsplit as ``memory.stage_params`` counts them)."""
    if not cfg.moe:
        return 0.0
    t, h, c = layout.tp, cfg.hidden, (2 if cfg.arch == "gpt2" else 3)
    S, F, f = cfg.moe_shared_experts, cfg.moe_ffn_hidden, cfg.ffn_hidden
    moe = cfg.moe_experts * h + c * h * S * F / t
    dense = c * h * f / t
    if cfg.biases:
        moe += S * F + h if S else 0
        dense += f + h
    return moe - dense


def activation_bytes(cfg: ModelConfig, layout: Layout, imbalance: float) -> float:
    """Bytes one MoE layer's MLP keeps for its backward per micro-batch, in place of the
    dense MLP's (module docstring)."""
    e, t = act_bytes(layout), layout.tp
    T = tokens(cfg, layout)
    M, R = rows(cfg, layout, imbalance)
    c = 2 if cfg.arch == "gpt2" else 3
    F_t = cfg.moe_ffn_hidden / t
    return (T * 2 * cfg.moe_experts * FP32 + M * (cfg.hidden * e + FP32)
            + R * (cfg.hidden + c * F_t) * e + T * c * cfg.moe_shared_experts * F_t * e
            + index_bytes(cfg, layout, M, R))  # fmt: skip


def index_bytes(cfg: ModelConfig, layout: Layout, M: float, R: float) -> float:
    """The int64 positions a MoE layer's gathers keep for their backward (``moe.MoE``): the
    chosen experts, which the weights' gather keeps (T K); the expert order and the token
    of each kept row (M each); a capacity factor's mask (T K bools, where it drops); and
    under ep the received rows' order to the local experts and back (R each)."""
    A = tokens(cfg, layout) * cfg.moe_top_k
    out = 8 * (A + 2 * M) + (A if cfg.moe_capacity_factor is not None and M < A else 0)
    return out + (16 * R if layout.ep > 1 else 0)


def stage_moe_layers(cfg: ModelConfig, stage_layers: list[int]) -> list[int]:
    """MoE layers of every virtual stage (stage i holds the next ``stage_layers[i]``
    blocks in order)."""
    out, at = [], 0
    for n in stage_layers:
        out.append(sum(cfg.is_moe_layer(i) for i in range(at, at + n)))
        at += n
    return out
