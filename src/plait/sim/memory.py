"""Device memory per pipeline rank: model state, activations, buffers, overhead.

- Model state: the rank's parameters (its layers' share for tensor parallelism, plus the
  embedding on the first virtual stage and the head on the last; a tied embedding is held
  on both ends when they are different ranks) times the runtime's bytes per parameter
  for weights, gradients and AdamW state, sharded per ZeRO stage over the shard group
  (``sizes.model_state_breakdown``). An offloaded optimizer keeps its state on the host.
  With LoRA (Hu et al. 2021) the base is frozen: its weights are held (sharded under
  ZeRO-3) with no gradient or optimizer state; only the adapters of the rank's blocks
  carry them. ``average_model_state`` is the one-line figure of ``plait info`` and
  ``plait train --dry-run``: the parameters split evenly over tp x pp, in plait's own
  bytes (fp32 weights and gradients, AdamW's two fp32 moments).
- Activations: ``sizes.activation_bytes_per_layer`` (Korthikanti et al. 2022) per layer
  and micro-batch, times the layers of each chunk, held from a micro-batch's F to its B
  (from BI to W, zero-bubble schedules keep the weight-gradient inputs: the inputs of
  the four linear layers, and where W re-runs autograd the norms' inputs too). The peak
  is found by walking the rank's actual action list, so 1F1B's p - r micro-batches,
  GPipe's m and interleaving's extra (p - 1) / (p v) all come out of the schedule. The last stage also keeps, per micro-batch in flight,
  its final-norm and head inputs and the logits in the activation dtype plus fp32 for the
  loss: T (h (r + e) + V / t (e + 4)) bytes, r the residual stream's bytes per element
  (e, or 4 under ``--fp32-residual``; Korthikanti's 4 s b h / t (1 + V / h) at e = 2).
- Weight gradients exist from a chunk's first backward on (autograd makes them there).
  A rank whose last forward comes before its first backward -- GPipe, 1F1B's rank r at
  m <= p - r, one stage at one micro-batch -- never holds its activation peak and its
  gradients at once: its peak is the larger of the activations alone and, at the end of
  its first backward, the gradients, the activations still in flight and that backward's
  working set (``backward_transient``). ``Memory.grads_apart`` is what this takes off
  the sum of the two peaks (``pipeline.peak_with_grads``).
- A backward starts with every activation of its chunk held and its last block's MLP
  making its gradients (``mlp_backward_working_set``, ``Memory.temporaries``), less what
  it freed before (the head's buffers): the walk's states after a local peak carry it.
- ZeRO-3 keeps two gathered layers (the current one and the prefetched next) and one
  layer's full gradient before it is reduce-scattered. A runtime that keeps k packed
  gradients in flight (``Runtime.zero3_grads_in_flight``; plait's ``ReduceScatterGrads``:
  2) peaks either as the forward ends (the two gathered layers beside the activations'
  peak) or in the backward as it reaches a unit (``zero3_backward_moments``): the last k
  units' packed fp32 gradients in flight and their reduce-scatters' output shards, every
  activation behind it freed (on the last stage the head's first), the next block's
  working set and first weight gradient held. Each category is the one at that moment:
  ``plait rehearse`` of LLaMA-2 7B dp 64 agrees in every category to 0.1% (2026-11-28;
  the model that added k blocks' gradients beside the gathered layers and took off k
  blocks' activations agreed in sum, not by category: gradients 0.26 of the rehearsal's
  at one micro-batch, buffers 1.56; with one gradient, under recomputation, 4.87 GiB
  against 5.64 rehearsed). A gathered layer holds its linear
  weights in the dtype they are gathered in -- under bf16 / fp16 the compute dtype for
  plait and FSDP2, half of fp32 -- and its norms in the weights' dtype
  (``gathered_layer_bytes``).
- A vocabulary table's gradient is made whole and new beside the state, where a large
  vocabulary can put a rank's peak: the first stage's embedding backward at the end of
  each of its backwards (``embedding_backward_transient``: the table's gradient before
  it lands, three with a tied head on the same rank; the schedule walk's x = 3
  states), ZeRO-0/1's head as its gradient lands and the final norm's backward after
  it (``head_backward_moment``, ``final_norm_transient``), and the
  end of the step, every activation gone (``finish_transient``: buckets flattened by
  ``finish()``, ZeRO-1/2's gathers of the updated weights); a pipeline's tied copy is
  held whole under ZeRO-2 (``deferred_table_grads``).
- Every block's backward casts each weight's bf16 gradient back to fp32, both held
  beside the state from a step's second micro-batch on; the MLP's two are the largest
  (``weight_grad_cast_working_set``, a working set like ``mlp_backward_working_set``).
- ZeRO-2 under a runtime that reduce-scatters every micro-batch (plait) may peak on the
  last stage as the head's backward ends (``zero2_head_moment``): the head's whole
  weight gradient beside the shard rows, until the final norm's closes its bucket.
  Gradients a moment holds beyond the state (or, at one micro-batch, short of its rows)
  are ``Memory.grads_moment``; ``Memory.grads`` stays the state's.
- Context parallelism (``sim/context.py``): every per-token figure above counts the
  s / cp tokens a cp rank holds, and the cp attention keeps no scores (only Q, K, V, the
  output and a fp32 log-sum-exp: fused attention's accounting, whatever the runtime);
  ``cp_buffers`` is what one layer's exchange holds while it runs
  (``context.buffer_bytes``: the K/V blocks in flight, the gathered sequence, or the
  head-sharded Q/K/V, per mode) -- never at a backward's start or end, so only where a
  ZeRO-2 run or a ZB-H1 stage that runs BI has no moment of its attention's backward;
  elsewhere that moment holds the exchange's backward working set
  (``cp_attention_moments``, ``zero3_backward_moments``).
- Mixtures of experts (``sim/expert.py``): a MoE block holds its router, shared experts
  and E / ep routed experts; the routed experts' state is sharded by ZeRO over their edp
  = dp / ep group (``rank_model_state(..., experts=)``), and a MoE block's activations
  hold the routed rows of the busiest ep rank in place of the dense MLP's.
- Framework overhead: the hardware entry's fixed ``framework_overhead_bytes``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

from plait.layout import Layout
from plait.model import sizes
from plait.model.config import ModelConfig
from plait.parallel.pipeline.schedules import (
    ScheduleError,
    awaiting_weight_bound,
    in_flight_bound,
)
from plait.sim import context as cp_sim
from plait.sim import expert as ep_sim
from plait.sim.costs import ACT_BYTES, dp_groups, grad_ranks, residual_bytes
from plait.sim.pipeline import Compiled, compile_schedule, forward_peaks, peak_held, peak_with_grads
from plait.sim.runtime import Runtime


@dataclass(frozen=True)
class Memory:
    """Bytes on one device of pipeline rank ``rank``."""

    rank: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float  # ZeRO-3 gathered layers
    overhead: float
    cp_buffers: float = 0.0  # one layer's context-parallel exchange (sim/context.py)
    weight_casts: float = 0.0  # the step's compute-dtype weight copy (``weight_cast_bytes``)
    # activations' peak + temporaries + grads less their joint peak (module docstring)
    grads_apart: float = 0.0
    # the working set at the peak: what a backward holds beside the activations' peak as
    # it starts (the MLP's gradients, ``mlp_backward_working_set``) beyond what it frees
    # first (the head's buffers); or, where the peak is a backward's end, what it holds
    # there (``backward_transient``, ``embedding_backward_transient``; a zero-bubble BI's
    # end: the output gradients it captured for its W, ``bi_captured_bytes``)
    temporaries: float = 0.0
    # gradients the peak holds beyond the state's ``grads`` (negative: short of them): a
    # ZeRO-2/3 backward's reduce-scatter outputs in flight and weight gradients not yet
    # packed, less the shard rows a step's first micro-batch has not written yet
    grads_moment: float = 0.0
    # of the activations, the output gradients zero-bubble BIs captured for their Ws: made
    # in a backward, which ``plait rehearse`` counts among the temporaries; and the peak of
    # the rest, what forwards made, at its own moment (None: the activations')
    w_gradients: float = 0.0
    forward_made_peak: float | None = None
    # the rotary tables the model caches (``rotary_table_bytes``)
    tables: float = 0.0

    @property
    def total(self) -> float:
        return (
            (self.weights + self.grads + self.optimizer + self.activations + self.buffers)
            + self.overhead
            + self.cp_buffers
            + self.weight_casts
            + self.tables
            + self.temporaries
            + self.grads_moment
            - self.grads_apart
        )

    def to_dict(self) -> dict:
        cp = {"cp_buffers": self.cp_buffers} if self.cp_buffers else {}
        if self.weight_casts:
            cp["weight_casts"] = self.weight_casts
        if self.grads_apart:
            cp["grads_apart"] = self.grads_apart
        if self.temporaries:
            cp["temporaries"] = self.temporaries
        if self.grads_moment:
            cp["grads_moment"] = self.grads_moment
        if self.w_gradients:
            cp["w_gradients"] = self.w_gradients
        if self.tables:
            cp["tables"] = self.tables
        return {
            "rank": self.rank,
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "overhead": self.overhead,
            **cp,
            "total": self.total,
        }


def stream_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """One micro-batch of the residual stream as a rank holds it: T h (T / t under
    sequence parallelism) in the stream's dtype (``costs.residual_bytes``)."""
    split = layout.tp if layout.sequence_parallel else 1
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    return tokens * cfg.hidden / split * residual_bytes(layout)


def rotary_table_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """The rotary tables a model chunk caches from its first forward on: cos and sin of
    each position of the s / cp a rank holds, D / 2 fp32 angles each (T D 4 bytes: 2 MiB
    at 4,096 tokens and heads of 128). ``plait rehearse`` finds them among the activations,
    made in a forward."""
    if not cfg.rotary:
        return 0.0
    return cfg.seq_len // layout.cp * cfg.head_dim * 4.0


def table_elements(cfg: ModelConfig, layout: Layout) -> float:
    """Elements of a vocabulary table (the embedding's or the head's) on one tp rank."""
    return cfg.vocab_size / layout.tp * cfg.hidden


def stage_params(
    cfg: ModelConfig, layout: Layout, layers: int, first: bool, last: bool, moe_layers: int = 0
) -> float:
    """Parameters one tp rank holds for a virtual stage of ``layers`` blocks, ``moe_layers``
    of them MoE blocks, less their routed experts (``expert.expert_params``: sharded over
    another group)."""
    t = layout.tp
    n = layers * sizes.layer_params_per_rank(cfg, t)
    n += moe_layers * ep_sim.dense_part_extra(cfg, layout)
    vh = cfg.vocab_size * cfg.hidden / t
    if first:
        n += vh + (cfg.seq_len * cfg.hidden if cfg.arch == "gpt2" else 0)
    if last:
        n += sizes.final_norm_params(cfg)
        if not cfg.tied_embeddings or not first:  # untied head, or the tied copy
            n += vh
    return n


def rank_model_state(
    layout: Layout,
    params: float,
    adapters: float | None = None,
    state_bytes: tuple[int, int, int] = (4, 4, 8),
    experts: float = 0.0,
    expert_adapters: float = 0.0,
) -> dict[str, float]:
    """``sizes.model_state_breakdown`` of one device holding ``params`` parameters, sharded
    over its ZeRO shard group; ``state_bytes``: bytes per parameter of the weights, the
    gradients and the optimizer state (default plait's: fp32, fp32, AdamW's two fp32
    moments). With ``adapters`` (LoRA) the ``params`` are the frozen base and only the
    adapters are trained. ``experts``: routed expert parameters on top, sharded over their
    edp group (frozen too under LoRA, where ``expert_adapters`` of theirs train)."""
    w_bytes, g_bytes, o_bytes = state_bytes
    out = None
    for n, group in ((params, False), (experts, True)):
        if group and not n:
            break
        shard, _ = dp_groups(layout, group)
        state = sizes.model_state_breakdown(
            n if adapters is None else (expert_adapters if group else adapters), dp=shard,
            zero=layout.zero,
            offload_optimizer=layout.offload_optimizer,
            param_bytes=w_bytes, grad_bytes=g_bytes, optim_bytes=o_bytes,
            frozen_params=0 if adapters is None else n,
        )  # fmt: skip
        out = state if out is None else {k: out[k] + v for k, v in state.items()}
    return out


def average_model_state(cfg: ModelConfig, layout: Layout, lora=None) -> dict[str, float]:
    """Model-state bytes of one device (``sizes.model_state_breakdown``'s keys) when the
    parameters split evenly over the tp x pp ranks, in plait's fp32 weights, gradients and
    AdamW moments: the estimate ``plait info`` and ``plait train --dry-run`` print.
    ``memory_per_rank`` is the per-stage figure (embedding and head where they live, the
    runtime's bytes). A MoE model's routed experts split over ep as well, their state
    sharded over edp (``sim/expert.py``)."""
    routed = cfg.n_moe_layers * ep_sim.layer_expert_params(cfg, ep=1, tp=1)  # all of them
    experts = routed / (layout.ep * layout.tp * layout.pp)
    params = round((sizes.num_params(cfg) - routed) / (layout.tp * layout.pp))  # whole ones
    adapters, routed_adapters = None, 0.0
    if lora is not None:  # the adapters of the rank's n_layers / pp blocks
        from plait.model.lora import stage_adapters

        held = stage_adapters(cfg, lora, tp=layout.tp, ep=layout.ep, layers=cfg.n_layers,
                              moe_layers=cfg.n_moe_layers)  # fmt: skip
        adapters = round(held.replicated / layout.pp)
        routed_adapters = round(held.routed / layout.pp)
    return rank_model_state(layout, params, adapters, experts=round(experts),
                            expert_adapters=routed_adapters)  # fmt: skip


def last_stage_buffers(cfg: ModelConfig, layout: Layout, lora=None) -> float:
    """Bytes the last stage keeps per micro-batch in flight for the final norm, the head
    and the loss: T (h (r + e) / s + V / t (e + 4)), r the residual stream's bytes (the
    final norm's input; ``costs.residual_bytes``), s = t under sequence parallelism (the
    head keeps its input's sequence shard and gathers it again for its backward:
    ``keeping_shard``), else 1; less the logits in the compute dtype, gone as the loss's
    forward ends (``head_logits_bytes``). Under LoRA (``lora``) the head is frozen and
    keeps no input (h e) for a weight gradient. ``plait rehearse`` of four llama blocks
    of h 2048 at ``--tp 2 --sp --pp 2``, 4,096 tokens: the last stage's activations' own
    peak was 0.969 of the model's while it counted the whole sequence's norm input and
    output; GPipe's last stage at ``--pp 2`` 0.982 while each finished micro-batch kept
    its bf16 logits."""
    e, r = ACT_BYTES[layout.dtype], residual_bytes(layout)
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    head_input = 0 if lora is not None else e
    split = layout.tp if layout.sequence_parallel else 1
    kept = tokens * (cfg.hidden * (r + head_input) / split + cfg.vocab_size / layout.tp * (e + 4))
    return kept - head_logits_bytes(cfg, layout)


def head_logits_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """The logits in the compute dtype (T V / t e), made by the head's GEMM and let go as
    the loss's forward returns: the vocabulary-parallel cross-entropy keeps its own fp32
    copy for the backward (``tensor._VocabParallelCrossEntropy``). Held at the loss's
    moment of the micro-batch whose forward runs (``forward_end_moment``), by none of
    those in flight. 0 under fp32, whose loss keeps the caller's logits."""
    e = ACT_BYTES[layout.dtype]
    if e == 4:
        return 0.0
    return layout.micro_batch_size * cfg.seq_len // layout.cp * cfg.vocab_size / layout.tp * e


def tied_zero3_unit(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> tuple[float, float]:
    """ZeRO-3 of a tied model whose one rank holds both ends (pp 1): (its table, positions
    and final norm -- one unit -- gathered, in the stored dtype: the embedding reads the
    table other than through ``F.linear``, ``zero_units.compute_dtype_params``; the head's
    cast of the table to the compute dtype, which it keeps for its backward). The unit is
    gathered from the head's forward to the embedding's backward, where its gradient is
    complete. (0, 0) otherwise. ``plait rehearse`` of LLaMA 3.2 1B (vocabulary 128,256)
    at dp 8: 1.0 and 0.5 GiB, a 13% larger peak than a model without them."""
    if layout.zero != 3 or not cfg.tied_embeddings or layout.pp != 1:
        return 0.0, 0.0
    unit = stage_params(cfg, layout, 0, True, True) * runtime.state_bytes(layout.dtype)[0]
    cast = 0.0 if layout.dtype == "fp32" else table_elements(cfg, layout) * ACT_BYTES[layout.dtype]
    return unit, cast


def lora_dropped_inputs(cfg: ModelConfig, layout: Layout, lora) -> float:
    """Elements per token of a block's activations a LoRA run does not keep: the inputs
    that only a frozen linear's weight gradient would need. The QKV input (the first
    norm's output) stays if q, k or v has an adapter; the MLP's first input (the second
    norm's output) if up or gate has one; its second GEMM's input (the activation's
    output) if down has one. The attention output stays: the fused attention keeps it for
    its own backward. Counted with ``plait rehearse``'s saved tensors (a 7B LoRA run on
    q, v: its activations were x0.90 of the model's before)."""
    targets = set(lora.targets)
    split_all = layout.tp if layout.sequence_parallel else 1
    out = 0.0
    if not targets & {"q", "k", "v"}:
        out += cfg.hidden / split_all
    if not targets & {"up", "gate"}:
        out += cfg.hidden / split_all
    if "down" not in targets:
        out += cfg.ffn_hidden / layout.tp
    return out


def chunk_blocks(model: ModelConfig, layout: Layout, stage_layers, stage: int) -> dict:
    """A virtual stage's blocks as (dense, MoE) counts: {True: those priced under the
    layout's recomputation, False: those that keep their activations}. The False entry
    exists only under ``--recompute-layers``, where a chunk's first blocks recompute in
    full and the rest do not (``Layout.recomputed_blocks``)."""
    start = sum(stage_layers[:stage])
    layers = stage_layers[stage]
    n = layers if layout.recompute_layers is None else min(layout.recompute_layers, layers)
    out = {}
    for recomputed, blocks in ((True, range(start, start + n)),
                               (False, range(start + n, start + layers))):  # fmt: skip
        if recomputed or layout.recompute_layers is not None:
            moe = sum(1 for i in blocks if model.is_moe_layer(i))
            out[recomputed] = (len(blocks) - moe, moe)
    return out


def recompute_transient(cfg: ModelConfig, layout: Layout, runtime: Runtime, lora=None,
                        moe: bool = False) -> float:  # fmt: skip
    """Bytes a block that recomputes holds on top of its checkpoint while its backward runs:
    its forward's saved tensors, made again (one block at a time; a MoE block's with
    ``moe``). ``plait rehearse`` of LLaMA-2 7B at pp 4 under ``--recompute full``: rank 0's
    activations peaked at 1.139 of the model's without it (4.573 GiB against 4.016)."""
    if layout.recompute != "full":
        return 0.0
    k = 1 if moe else 0
    kept = chunk_activation_bytes(cfg, layout.without_recompute(), runtime, 1, k, lora)[0]
    ckpt = chunk_activation_bytes(cfg, layout.recomputing_all(), runtime, 1, k, lora)[0]
    return max(0.0, kept - ckpt)


def mlp_forward_transient(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """Bytes a dense MLP's forward holds for a moment beyond what it keeps: under plait's
    kernels SwiGLU's silu(gate), T x F / t in the activation dtype, until its product with
    the up projection is made (``ops.SwiGLU``: two kernels, on a GPU as here); a fused
    kernel holds none, nor does GELU. It tops the activations' own peak where a recomputed
    block's forward is made again on top of every checkpoint: ``plait rehearse`` of
    LLaMA-2 70B dp 64 ZeRO-3 under ``--recompute full`` held 226 MiB more than the model
    there, silu(gate) at 224 (2026-11-28). A MoE block's experts run one at a time, each
    holding its own rows' (not modelled: their largest expert's rows are not)."""
    if cfg.arch == "gpt2" or runtime.layer_kernels != "plait":
        return 0.0
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    return tokens * cfg.ffn_hidden / layout.tp * ACT_BYTES[layout.dtype]


def forward_end_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime, last_stage: bool,
                       dense_end: bool, lora=None) -> float:  # fmt: skip
    """Bytes a chunk's forward holds at its last moments beyond its micro-batch's saved
    tensors (the head's buffers not yet made): the largest of
    - its last block's MLP making its product: silu(gate) (``mlp_forward_transient``),
      beside the MLP's fp32 input on an fp32 stream (the norm's output, which the MLP
      casts for its GEMMs and holds as its argument);
    - its last block's output being made: the down projection's product (T h e,
      all-reduced in place; under sequence parallelism reduce-scattered beside it into
      T h / t e -- the pieces in order, no copy, at one sequence a micro-batch:
      ``comm.joined``), a biased one's fp32 sum with its bias, the residual sum (fp32 if
      either side is) and its cast back to the stream's dtype (``Block._forward``);
    - on the last stage, the final norm's: its input (that output) with the fp32 copy of
      it (none where the stream is fp32), the fp32 result and its cast to the stream's
      dtype (``_LowPrecisionNorm``: PyTorch's fused kernels, as on a GPU).
    ``dense_end``: the last block is a dense one that keeps its activations (a MoE block's
    or a recomputing one's last moments are not modelled: its output alone). Under LoRA
    (``lora``) an MLP whose frozen linears keep neither their input nor the down
    projection's (``lora_dropped_inputs``) still holds both at silu(gate)'s moment: the
    input is the forward's argument, the product is being made (``plait rehearse`` of four
    llama blocks of h 2048 at ``--pp 2 --lora-rank 16``, rank 0: the activations' own
    peak 1.049 of the model's without them, 2026-11-29).
    ``plait rehearse`` of four llama blocks of h 2048 at 4,096 tokens and tp 2: rank 0 of
    ``--pp 2`` peaked as its last block's output was made, the model 5.9 % short without
    it; the last stage of one, at the final norm (2026-11-29)."""
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    e, r = ACT_BYTES[layout.dtype], residual_bytes(layout)
    sp = layout.sequence_parallel and layout.tp > 1
    row = tokens * cfg.hidden / (layout.tp if sp else 1)  # elements of the stream a rank holds
    output = stream_bytes(cfg, layout)
    moments = [output]
    if dense_end:
        # an fp32 stream's norm output, fp32 too, is the MLP's argument: held through it
        held = row * 4 if r == 4 and e != 4 else 0.0
        dropped = 0.0  # what a LoRA run does not keep, alive at silu(gate)'s moment
        if lora is not None and mlp_forward_transient(cfg, layout, runtime):
            targets = set(lora.targets)
            dropped += 0.0 if targets & {"up", "gate"} else row * e
            dropped += 0.0 if "down" in targets else down_projection_input(cfg, layout)
        moments.append(mlp_forward_transient(cfg, layout, runtime) + held + dropped)
        product = tokens * cfg.hidden * e
        branch = row * e  # the product as the residual add takes it: this rank's rows
        moments.append(product + held + (branch if sp else 0.0))  # (its reduce-scatter)
        if cfg.biases and e != 4:  # the bias, held in fp32, promotes the branch
            moments.append(branch + row * 4)
            branch = row * 4
        total = row * max(r, branch / row)  # the residual sum
        moments.append(branch + total)
        if total != output:
            moments.append(total + output)  # cast back to the stream's dtype
    if last_stage:
        copies = 4 + (0 if r == 4 else 4 + r)  # fp32 result; fp32 input copy, cast back
        moments.append(output + row * copies)
    return max(moments)


def backward_transient(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """Bytes a block's backward holds beyond its activations and the gradients as it ends:
    its input norm's backward, over the tokens a rank holds (split over tp under sequence
    parallelism) x h -- the gradient coming in, the one going out and their residual sum
    in the stream's dtype, and under the ``plait`` runtime three fp32 copies besides
    (input, gradient and input gradient: ``_LowPrecisionNorm`` runs PyTorch's fp32 norm
    kernels; fused norms keep those in registers). ``plait rehearse`` of LLaMA-2 70B tp 8
    pp 4 dp 8 at 4 micro-batches held exactly these at rank 0's peak: 3 x 128 MiB fp32
    and 3 x 64 MiB bf16 (2026-11-27)."""
    return _norm_backward_bytes(cfg, layout, runtime, 3 * residual_bytes(layout))


def _norm_backward_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                         gradients: float) -> float:  # fmt: skip
    """A norm's backward over the tokens a rank holds: ``gradients`` bytes an element of
    the h-wide gradients it holds, and under the ``plait`` runtime with a low-precision
    stream ``_LowPrecisionNorm``'s three fp32 copies."""
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = layout.tp if layout.sequence_parallel else 1
    copies = 3 * 4 if runtime.layer_kernels == "plait" and residual_bytes(layout) < 4 else 0
    return tokens * cfg.hidden / split * (gradients + copies)


def chunk_param_elements(cfg: ModelConfig, layout: Layout, layers: int, first: bool,
                         last: bool) -> list[float] | None:  # fmt: skip
    """Each trained parameter's elements on one rank of a pipeline chunk of ``layers``
    dense blocks, in the order the model registers them (``Transformer``): the embedding
    (the table's rows split over tp, padded to a multiple of it; GPT-2's learned
    positions whole) where the chunk holds it, each block's input norm, q, k, v (their
    biases after each weight), the output
    projection, Qwen 3's q and k norms, the MLP's norm and its matrices, then the final
    norm and an untied head. None with MoE blocks (not walked)."""
    if cfg.moe_experts:
        return None
    t, h, f = layout.tp, cfg.hidden, cfg.ffn_hidden
    kv = sizes.kv_width_per_rank(cfg, t)
    norm = [h, h] if cfg.arch == "gpt2" else [h]
    qkv_bias = cfg.biases or cfg.qkv_bias
    out: list[float] = []
    table = math.ceil(cfg.vocab_size / t) * h  # rows padded to a multiple of tp
    if first or (last and cfg.tied_embeddings and layout.pp > 1):
        out.append(table)
        if first and cfg.arch == "gpt2":
            out.append(cfg.seq_len * h)
    for _ in range(layers):
        out += norm
        for width in (cfg.q_dim / t, kv, kv):
            out += [width * h] + ([width] if qkv_bias else [])
        out += [cfg.q_dim / t * h] + ([h] if cfg.biases else [])
        out += [cfg.head_dim] * 2 if cfg.qk_norm else []
        out += norm
        if cfg.arch == "gpt2":
            out += [f / t * h, f / t, h * f / t, h]
        else:
            out += [f / t * h] * 3
    if last:
        out += norm
        if not cfg.tied_embeddings:
            out.append(table)
    return out


def bucket_runs(elements: list[float], layout: Layout, w_bytes: float) -> list[list[int]]:
    """The gradient buckets ``split_buckets`` cuts from a chunk's parameters
    (``chunk_param_elements``), each as the indices of its parameters, last parameter
    first: the order the backward launches them. The last holds the first registered (the
    embedding's, on a first stage)."""
    limit, runs, run, size = layout.bucket_mb * 2**20, [], [], 0.0
    for i in reversed(range(len(elements))):
        run.append(i)
        size += elements[i] * w_bytes
        if size >= limit:
            runs.append(run)
            run, size = [], 0.0
    return runs + ([run] if run else [])


def bucket_bytes_in_launch_order(elements: list[float], layout: Layout,
                                 w_bytes: float) -> list[float]:  # fmt: skip
    """The bytes of each of ``bucket_runs``' buckets, in launch order."""
    return [sum(elements[i] for i in run) * w_bytes
            for run in bucket_runs(elements, layout, w_bytes)]  # fmt: skip


def embedding_backward_transient(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                                 head_here: bool, layers: int = 0) -> float:  # fmt: skip
    """Bytes beyond the gradients' state a first stage holds as its embedding's backward
    runs, the last of a micro-batch's backward there. The table's dense gradient (V h / t
    in the weights' dtype) is new: autograd hands it to ``p.grad`` as it is in a step's
    first micro-batch and adds it in place after, and the data-parallel hooks copy its
    whole bucket into a flat buffer as they launch -- the table and what ``split_buckets``
    left beside it, the first block's first matrices (``chunk_param_elements``), the
    gradients' storage from then on (a dp group of one has no hooks: one micro-batch
    holds nothing more). Where the rank also holds a tied head
    (``head_here``), the head's gradient of the table waits in autograd's buffer for the
    embedding's and the two are summed: three tables, the state's one not yet written. A
    pipeline's tied copies are deferred (``GradReducer``: no hooks), their gradient
    accumulated in ``p.grad`` (``deferred_table_grads``). ZeRO-2 reducing every
    micro-batch (``ReduceScatterGrads``) packs the table into fp32 beside its gradient,
    one earlier bucket still in flight with its shard; tied, it peaks before packing,
    three tables beside two buckets in flight; either way, in a step of one micro-batch,
    without the table's shard in its rows. ZeRO-3 has its own moments
    (``zero3_backward_moments``). ``plait rehearse`` of GPT-3 1.3B at ``--tp 2 --dp 4
    --sequence-parallel``, one micro-batch: three fp32 tables of 196 MiB at the step's
    peak, the gradients 0.192 GiB short of the state (2026-11-28)."""
    if layout.zero == 3 or not runtime.bucket_from_layout:  # plait's ``GradReducer`` only
        return 0.0
    m = layout.num_microbatches
    table = table_elements(cfg, layout) * runtime.state_bytes(layout.dtype)[0]
    if cfg.tied_embeddings and not head_here:  # a pipeline's tied copy, added in place
        return table if m > 1 else 0.0
    tied = cfg.tied_embeddings
    if layout.zero < 2 or not runtime.zero2_reduce_per_microbatch:
        if tied:
            return 2 * table
        if grad_ranks(layout) > 1:  # the hooks copy its whole bucket, what shares it too
            walk = chunk_param_elements(cfg, layout, layers, True, head_here)
            w_bytes = runtime.state_bytes(layout.dtype)[0]
            if walk is not None:
                return max(table, bucket_bytes_in_launch_order(walk, layout, w_bytes)[-1])
        return table if grad_ranks(layout) > 1 or m > 1 else 0.0
    shard = dp_groups(layout, False)[0]
    packed = table_elements(cfg, layout) * 4  # fp32 rows of every shard
    # the bucket before it: the first block's first matrix, or --bucket-mb's worth
    prev = max(layout.bucket_mb * 2**20, cfg.hidden * cfg.q_dim / layout.tp * 4)
    unwritten = packed / shard if m == 1 else 0.0  # no rows yet
    if tied:
        return 3 * table + 2 * prev * (1 + 1 / shard) - unwritten
    return table + packed + prev * (1 + 1 / shard) - unwritten


def waiting_table_grad(cfg: ModelConfig, layout: Layout, runtime: Runtime, one_stage: bool,
                       lora=None) -> float:  # fmt: skip
    """Bytes of a tied head's gradient of the table held through a backward's blocks, on a
    rank that holds both ends (``one_stage``): autograd keeps the head's contribution in
    its buffer until the embedding's backward adds its own (V h / t in the weights'
    dtype; ``embedding_backward_transient`` then sums them). None under LoRA (a frozen
    table) or ZeRO-3 (``zero3_backward_moments``' ``tied_grad``). GPT-2 (h 2048, four
    blocks) at ``--dp 2 --zero 1``: 32 MiB among the temporaries at its peak, the down
    projection's weight-gradient cast (2026-11-29)."""
    if not (one_stage and cfg.tied_embeddings and lora is None and layout.zero < 3):
        return 0.0
    return table_elements(cfg, layout) * runtime.state_bytes(layout.dtype)[0]


def deferred_table_grads(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                         holds_table: bool) -> float:  # fmt: skip
    """Gradient bytes beyond the ZeRO-2 state on a rank holding a pipeline's tied copy of
    the table (``holds_table``: the first or the last stage): the copy's gradient is
    deferred (``GradReducer``), accumulated whole in ``p.grad`` from its first backward
    and reduce-scattered by ``finish()``, where its shard is what the state counts.
    ``plait rehearse`` of a tied four-block model (vocabulary 65,536, h 2048) at ``--pp 2
    --dp 2 --zero 2``: the last stage's gradients 0.25 GiB over the shards'."""
    if not (holds_table and cfg.tied_embeddings and layout.pp > 1 and layout.zero == 2):
        return 0.0
    table = table_elements(cfg, layout) * runtime.state_bytes(layout.dtype)[1]
    return table * (1 - 1 / dp_groups(layout, False)[0])


def _bucket_bytes(layout: Layout, largest: float) -> float:
    """A gradient bucket's bytes (``split_buckets``): parameters of ``largest`` bytes each
    until ``--bucket-mb`` is reached."""
    limit = layout.bucket_mb * 2**20
    return largest * max(1, math.ceil(limit / largest)) if largest else limit


def finish_transient(cfg: ModelConfig, layout: Layout, runtime: Runtime, layers: int,
                     first: bool, last: bool) -> float:  # fmt: skip
    """Bytes beyond the gradients a rank holds after its last backward, every activation
    and weight cast gone, at the larger of two moments. ``finish()`` launching what the
    hooks did not: in a dp group of one under ZeRO-0/1 every bucket (no hooks), the
    largest copied into its flat buffer -- the table's on a stage that holds one; a
    pipeline's tied copy of the table, its peer's received to be added
    (``_sync_tied_grads``), then flattened (ZeRO-0/1) or packed into fp32 (ZeRO-2, beside
    the buckets still in flight). And ZeRO-1/2's step gathering the updated parameters
    (``gather_params``): two buckets in flight, each whole and its packed shard, the
    table's with the next. ``plait rehearse`` of four llama blocks at ``--pp 2``, one
    micro-batch: the first stage peaked at the first, the table's 512 MiB flat beside its
    gradient, and at ``--dp 2 --zero 1`` at the second, 816 MiB (2026-11-28)."""
    if layout.zero == 3 or not runtime.bucket_from_layout:  # plait's ``GradReducer`` only
        return 0.0
    w_bytes = runtime.state_bytes(layout.dtype)[0]
    t = layout.tp
    table = table_elements(cfg, layout) * w_bytes
    has_table = first or (last and (not cfg.tied_embeddings or layout.pp > 1))
    tied_copy = cfg.tied_embeddings and layout.pp > 1 and (first or last)
    width = (2 if cfg.arch != "gpt2" else 1) * cfg.ffn_hidden  # the MLP's entry
    block = cfg.hidden * max(width, cfg.q_dim) / t * w_bytes if layers else 0.0
    bucket = _bucket_bytes(layout, block)
    largest = max(table if has_table else 0.0, bucket)
    # the bucket next to the table's: the first block's first matrices (q), or the last
    # block's down projection -- but a tied copy's bucket is deferred, after the stage's
    # others, and follows its first block's
    beside = cfg.hidden * (cfg.q_dim if first or tied_copy else cfg.ffn_hidden) / t * w_bytes
    if has_table and layers:
        bucket = _bucket_bytes(layout, beside)
    shard = dp_groups(layout, False)[0]
    out = 0.0
    if layout.zero == 2 and tied_copy:  # two buckets in flight as the copies are summed
        # (``_sync_tied_grads``: the peer's received), one as the copy is packed in fp32
        prev = bucket * (1 + 1 / shard)
        out = max(table + 2 * prev, table / w_bytes * 4 + prev)
    elif layout.zero < 2 and grad_ranks(layout) == 1:
        out = largest
    elif layout.zero < 2 and tied_copy:
        out = table
    if layout.zero in (1, 2):  # the two largest buckets gathered, and their shards; a
        # tied copy's whole gradient (ZeRO-2: ``deferred_table_grads``) gone by then
        pair = largest + (bucket if layers else 0.0)
        # no more than the rank's weights: a model smaller than two buckets is gathered
        # whole (a tiny llama at --dp 4 --zero 1: x3 its gradients without this)
        pair = min(pair, stage_params(cfg, layout, layers, first, last) * w_bytes)
        gone = deferred_table_grads(cfg, layout, runtime, first or last)
        out = max(out, pair * (1 + 1 / shard) - gone)
    return out


def head_backward_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                         lora=None) -> list[tuple[float, float, float, float]]:  # fmt: skip
    """ZeRO-0/1's last stage at the end of its backward: two moments. First as the head's
    weight gradient lands, its buffers freed (``last_stage_buffers``) and the head
    input's gradient held: the gradient (V h / t) is new beside the state, made by
    autocast's cast from the compute dtype's, both held at once -- from a step's second
    micro-batch on a temporary, added into ``.grad`` in place (and in the last
    micro-batch copied into its bucket's flat buffer by a dp group's hooks); in a step of
    one micro-batch the only gradient yet, twice where the hooks copy it. Then the final
    norm's backward, its input still held and ``final_norm_transient`` beside it.
    [(gradients, buffers, activations freed, temporaries)], as ``zero2_head_moment``;
    none for a tied head on the embedding's rank -- its gradient waits for the
    embedding's (``embedding_backward_transient``) -- and under ZB-H1, whose head makes
    it in a W (the ZB-H1 rows of ``tests/test_rehearse.py`` hold without it). ``plait rehearse``
    (2026-11-28): four llama blocks (vocabulary 65,536) at ``--pp 2 --dp 2``, one
    micro-batch, peaked there on the last stage, 2 x 512 MiB of the head's gradient;
    Qwen 2.5 7B at dp 8 (vocabulary 152,064) at the cast, 2.03 + 1.04 GiB."""
    if layout.zero > 1 or lora is not None or (cfg.tied_embeddings and layout.pp == 1):
        return []
    if not runtime.bucket_from_layout:  # plait's ``GradReducer`` only
        return []
    if layout.schedule == "zb-h1":  # made in the head's W, its inputs held to then
        return []
    g_bytes, e = runtime.state_bytes(layout.dtype)[1], ACT_BYTES[layout.dtype]
    elements = table_elements(cfg, layout)
    head = elements * g_bytes
    hooked = not cfg.tied_embeddings and grad_ranks(layout) > 1  # a tied copy is deferred
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = layout.tp if layout.sequence_parallel else 1
    temps = tokens * cfg.hidden / split * e  # the head input's gradient
    freed = last_stage_buffers(cfg, layout, lora)
    # as autocast's cast carries the compute-dtype gradient back to the weights' dtype,
    # both are held; then, in a step of one micro-batch, the hooks' copy beside it
    cast = elements * e if layout.dtype != "fp32" else 0.0
    # then the final norm's backward: the head's buffers gone but the norm's input
    norm = (0.0 if layout.num_microbatches > 1 else head, 0.0,
            freed - tokens * cfg.hidden * residual_bytes(layout),
            final_norm_transient(cfg, layout, runtime))  # fmt: skip
    if layout.num_microbatches == 1:  # the cast's output becomes ``.grad``: a gradient
        if hooked and head > cast:
            return [(2 * head, 0.0, freed, temps), norm]
        return [(head, 0.0, freed, temps + cast), norm]
    # from the second micro-batch on, autograd adds it into ``.grad`` in place: until
    # then it is a temporary beside the state's gradient (as the rehearsal counts it)
    return [(0.0, 0.0, freed, temps + cast + head), norm]


def final_norm_transient(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """Bytes the last stage's final norm holds as its backward runs, beyond its input:
    the gradient coming in from the head (the compute dtype), the one going out (the
    stream's), and under the ``plait`` runtime the three fp32 copies of
    ``backward_transient`` -- a block's norm without the residual sum. ``plait rehearse``
    of LLaMA-2 70B tp 8 pp 4 dp 8 ZeRO-1, last stage: 3 x 128 MiB fp32 and 2 x 64 MiB
    bf16 at its peak, the head's buffers freed (2026-11-28)."""
    return _norm_backward_bytes(cfg, layout, runtime,
                                ACT_BYTES[layout.dtype] + residual_bytes(layout))  # fmt: skip


def mlp_backward_working_set(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                             moe: bool = False) -> float:  # fmt: skip
    """Bytes a block's backward holds beyond its activations as it starts, in its MLP: the
    residual stream's incoming gradient (T h / t under sequence parallelism, the stream's
    dtype) and the MLP's own gradients at their fullest, each T x F / t in the activation
    dtype -- SwiGLU under plait's kernel four (the gradient coming out of the down
    projection, silu(gate) recomputed, the gate's and the up's gradients: ``ops.SwiGLU``),
    three under a fused kernel that keeps silu(gate) (its output is the two gradients
    side by side); GELU two (the gradient in, the gradient out). A MoE block's experts hold
    theirs for the busiest rank's R rows (``expert.rows``). ``plait rehearse`` of a llama
    block (h 2048, F 5632, T 2048, bf16) held exactly 4 x 22 + 8 MiB of temporaries there,
    on top of every activation of the step, where ZeRO-3 under LoRA (no weight gradients
    to wait for) put its peak (2026-11-28)."""
    e, t = ACT_BYTES[layout.dtype], layout.tp
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    if cfg.arch == "gpt2":
        k = 2
    else:
        k = 4 if runtime.layer_kernels == "plait" else 3
    rows, width, regather = tokens, cfg.ffn_hidden, mlp_input_regather(cfg, layout, runtime)
    if moe:
        rows, width = ep_sim.rows(cfg, layout, runtime.moe_imbalance)[1], cfg.moe_ffn_hidden
        regather = 0.0
    return (
        tokens * cfg.hidden / split * residual_bytes(layout) + k * rows * width / t * e + regather
    )


def mlp_input_regather(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """Bytes of a dense MLP's input all-gathered again for its backward under sequence
    parallelism (T h e), where the runtime issues that gather as the backward reaches the
    MLP's output (``Runtime.prefetch_sp_regather``): held from the down projection's
    backward until the up projection's takes it. ``plait rehearse`` of one llama block
    (h 2048, F 5632, 4,096 tokens, tp 2 + sp): 16 MiB of it beside the activation's
    backward, 112 MiB of temporaries in all (2026-11-28)."""
    if not (runtime.prefetch_sp_regather and layout.sequence_parallel and layout.tp > 1):
        return 0.0
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    return tokens * cfg.hidden * ACT_BYTES[layout.dtype]


def mlp_backward_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime, moe: bool, lora,
                        first_stage: bool, last_stage: bool,
                        fresh: bool = False) -> tuple[float, ...]:  # fmt: skip
    """(Bytes held beyond the activations, activations freed by then) where a block's MLP
    backward holds the most, the larger net of what it freed: inside the down projection's
    node, both its gradients made and its input still held (the residual stream's incoming
    gradient, ``mlp_input_regather``, T F / t and F h / t in the activation dtype); as
    the activation's backward runs (``mlp_backward_working_set``, that input gone:
    ``down_projection_input``); or as an MLP weight's gradient is cast
    (``weight_grad_cast_working_set``). The node's moment leads for GELU (two T F / t
    there, one here beside the weight's gradient; and a biased model's fp32 gradient out of
    its bias add) and where T > 2 h outweighs the cast.
    Under a zero-bubble BI, which keeps the input for W and makes no weight gradient, and
    for a MoE block: the working set alone; under LoRA that with the down projection's
    input gone where its adapter kept it (``plait rehearse`` of four llama blocks, every
    linear adapted: activations at the peak 0.978 of the model's while it was held).
    ``plait rehearse`` of GPT-2 124M pp 2, rank 0 (2,048 tokens): its peak in the node,
    the activations there 1.024 of the model's without it, 1.005 with (2026-11-28)."""
    ws = mlp_backward_working_set(cfg, layout, runtime, moe)
    whole_w = first_stage and runtime.zb_autograd_split  # a first stage's W: its backward
    if moe or (layout.schedule == "zb-h1" and not whole_w):
        return ws, 0.0
    if lora is not None:  # the down projection's input, if its adapter kept it, gone
        return ws, down_projection_input(cfg, layout) if "down" in lora.targets else 0.0
    e, t = ACT_BYTES[layout.dtype], layout.tp
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    freed = down_projection_input(cfg, layout)
    # a row-parallel layer's bias is added in fp32 after the reduction (``RowParallelLinear``):
    # the gradient reaching the node came out of that add in fp32, and is held through it
    bias = tokens * cfg.hidden / split * 4 if cfg.biases and e < 4 else 0.0
    node = (tokens * cfg.hidden / split * residual_bytes(layout) + bias
            + mlp_input_regather(cfg, layout, runtime) + freed
            + cfg.ffn_hidden * cfg.hidden / t * e)  # fmt: skip
    cast, cast_freed = weight_grad_cast_working_set(cfg, layout, runtime, whole_w)
    # a stage short of the last holds the output gradient it received through the chunk's
    # backward (``executor._backward``); where the block's output is rounded from an fp32
    # sum (a biased model's), the stream's gradient is a cast of it, not it: held apart
    # once the node's own gradients are gone (in the node, the bias add's output gradient
    # counted above is as large)
    apart_held = not last_stage and bias
    if apart_held:
        apart = boundary_bytes(cfg, layout)
        ws, cast = ws + apart, cast + apart if cast else cast
    if fresh:  # (``fresh_backward_grads``)
        head, down = fresh_backward_grads(cfg, layout, runtime, last_stage)
        # and the MLP norm's backward, every MLP weight's gradient made, its saved tensors
        # and its input gone (``backward_transient``'s working set, the norm's)
        widths = (2 if cfg.arch == "gpt2" else 3) * cfg.ffn_hidden  # entry and down
        gone = tokens * (widths / layout.tp + cfg.hidden / split) * e
        every = down * widths / cfg.ffn_hidden  # each MLP weight's, as the down projection's
        norm = (
            backward_transient(cfg, layout, runtime) + (apart if apart_held else 0.0),
            gone,
            head + every,
        )  # (a biased block's received gradient apart: above)
        return max((node, 0.0, head), (ws, freed, head + down), norm,
                   key=lambda x: x[0] + x[2] - x[1])  # fmt: skip
    return max((node, 0.0), (ws, freed), (cast, cast_freed), key=lambda x: x[0] - x[1])


def fresh_backward_grads(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                         last_stage: bool) -> tuple[float, float]:  # fmt: skip
    """Weight gradients a chunk's first backward of a step has made as its last block's
    MLP backward runs -- (the head's and the final norm's on the last stage, an untied
    head's: a tied one's waits, ``waiting_table_grad``; the down projection's, once its
    node has ended) -- where the chunk holds none yet (ZeRO-0/1, dense, no LoRA: what a
    backward start adds beyond the walk's gradients of the chunks that have them).
    ``plait rehearse`` of four llama blocks (h 2048, 4,096 tokens) at ``--tp 2
    --sequence-parallel``, one micro-batch, peaked in the last block's SwiGLU backward with
    the head's 16 and the down projection's 22 MiB made (1.016 of the model without
    them)."""
    g_bytes = runtime.state_bytes(layout.dtype)[1]
    head = 0.0
    if last_stage and not cfg.tied_embeddings:
        head = (table_elements(cfg, layout) + cfg.hidden) * g_bytes
    return head, cfg.ffn_hidden * cfg.hidden / layout.tp * g_bytes


def boundary_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """Bytes of one tensor a pipeline stage sends or receives: its output, or the output
    gradient it receives (T h / t under sequence parallelism, else T h, in the activation
    dtype: the executor's ``act_shape``)."""
    split = layout.tp if layout.sequence_parallel else 1
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    return tokens * cfg.hidden / split * ACT_BYTES[layout.dtype]


def down_projection_input(cfg: ModelConfig, layout: Layout) -> float:
    """Bytes of a dense MLP's down projection's input (the activation's output, T F / t in
    the activation dtype). Autograd lets go of it as that projection's backward node ends,
    when the node computes both gradients: so the MLP's backward working set
    (``mlp_backward_working_set``) and its weight's gradient cast
    (``weight_grad_cast_working_set``) come with it freed, but under a zero-bubble BI,
    which keeps it for W. ``plait rehearse`` of a llama of h 2048, F 5632 at 2,048 tokens,
    dp 2 ZeRO-1: the peak's activations 0.978 of the model's with it held (2026-11-28)."""
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    return tokens * cfg.ffn_hidden / layout.tp * ACT_BYTES[layout.dtype]


def bi_captured_bytes(
    cfg: ModelConfig, layout: Layout, runtime: Runtime, layers: int, last: bool = False
) -> float:
    """The output gradients a zero-bubble BI captures for its W (``executor.backward_input``)
    over a chunk of ``layers`` blocks: each linear's (QKV's and FC1's split by t, the
    output projection's and FC2's h), each norm's under ``zb_autograd_split``, GPT-2's two
    row-parallel bias adds' in fp32, Qwen 3's q and k norms' (their outputs: q and k
    widths), and on the ``last`` stage the head's (V / t) and the final norm's.
    ``plait rehearse`` of Qwen 3 0.6B pp 2 ZB-H1: 1.517 GiB a micro-batch on its last
    stage, 1.349 without the q/k norms' 12 MiB a block."""
    e, t = ACT_BYTES[layout.dtype], layout.tp
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    up = (1 if cfg.arch == "gpt2" else 2) * cfg.ffn_hidden
    qkv = cfg.q_dim / t + 2 * sizes.kv_width_per_rank(cfg, t)
    norms = cfg.hidden / split * e if runtime.zb_autograd_split else 0.0
    if cfg.qk_norm and runtime.zb_autograd_split:
        qkv += cfg.q_dim / t + sizes.kv_width_per_rank(cfg, t)
    # a row-parallel layer's bias is added after the reduction in its own fp32
    # (``RowParallelLinear``): that add's output gradient is fp32, and its own joint
    biases = 2 * cfg.hidden / split * 4 if cfg.biases and e < 4 else 0.0
    out = layers * tokens * (e * (qkv + up / t + 2 * cfg.hidden) + 2 * norms + biases)
    if last:
        out += tokens * (e * cfg.vocab_size / t + norms)
    return out


def weight_grad_cast_working_set(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                                 whole_w: bool = False) -> tuple[float, float]:  # fmt: skip
    """(Bytes held beyond the activations, activations freed by then) where an MLP weight's
    gradient is cast back to the weights' fp32 (``Runtime.weight_cast_per_step``: autocast's
    cast of the step's weight copy), both copies held (e + 4 bytes a weight of the tp
    shard) -- from a step's second micro-batch on beside the state, into whose ``.grad``
    autograd then adds it in place. Two moments, the larger net of what they freed: the
    down projection's (FC2), the block's first GEMM backward, with the residual stream's
    incoming gradient held and the down projection's input gradient (T F / t), its input
    freed as its backward ended; the up projection's (FC1; SwiGLU's fused gate and up,
    twice the weights), the MLP's saved tensors and its input gone, its input's gradient
    (T h) held. (0, 0) where the moment is not one: one micro-batch (the
    cast is the gradient's first, its ``.grad``), ZeRO-2/3 (their own moments), a
    zero-bubble W (but ``whole_w``: a first stage's under ``zb_autograd_split``, which is
    its whole backward -- the up projection's there, ``plait rehearse`` of LLaMA 3 8B pp 2
    ZB-H1 rank 0: 448 + 224 + 16 MiB of temporaries, 2.867 of the model's without it),
    fp32. ``plait rehearse``: GPT-3 175B tp 8 pp 16 rank 0 peaked at FC2's
    (144 + 288 MiB of weight gradient, 48 + 24 MiB of gradients; 0.492 GiB of temporaries
    where the model had 0.094), Qwen 2.5 7B pp 2 rank 0 at the fused gate and up's
    (259 + 518 MiB; 2026-11-28). The freed activations are apart at the peak
    (``memory_per_rank``'s ``starts``), as the rehearsal finds them."""
    if (not runtime.weight_cast_per_step or layout.dtype == "fp32" or layout.zero > 1
            or layout.num_microbatches == 1 or (layout.schedule == "zb-h1" and not whole_w)):  # fmt: skip
        return 0.0, 0.0
    e, t, r = ACT_BYTES[layout.dtype], layout.tp, residual_bytes(layout)
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    f, h = cfg.ffn_hidden, cfg.hidden
    up = (1 if cfg.arch == "gpt2" else 2) * f
    saved = (2 if cfg.arch == "gpt2" else 3) * f  # the MLP's split part (sizes)
    down_input = down_projection_input(cfg, layout)  # and its gradient, as large
    regather = mlp_input_regather(cfg, layout, runtime)
    down = (tokens * h / split * r + regather + f * h / t * (e + 4) + down_input, down_input)
    gone = tokens * (saved / t * e + h / split * e)
    first = (tokens * h / split * r + tokens * h * e + up * h / t * (e + 4), gone)
    return max(down, first, key=lambda x: x[0] - x[1])


def codec_launch_moments(cfg: ModelConfig, layout: Layout, runtime: Runtime, first_stage: bool,
                         last_stage: bool, blocks: bool, last: float,
                         params: float) -> list[tuple]:  # fmt: skip
    """[(Gradients beyond the state's rows -- None: all of the rank's --, a bucket's flat
    copy, codec messages, activations freed of the last micro-batch's ``last``, working
    set)] of a ZeRO-0/1 backward, on a rank of ``params`` parameters, under a gradient codec
    (``Runtime.grad_codec``) as it launches the bucket of one of the largest tensors in the
    step's last micro-batch, at each of the codec's moments (``sim/dp_algos.codec_buffers``:
    its messages and working set). Four places, each its tensor's gradient made -- from
    the second micro-batch on the new one in fp32 beside the accumulated, with one
    micro-batch the gradients made so far -- and copied into its bucket's flat buffer:

    - an MLP entry weight's (the gate's or the up's, each a parameter, the largest of a
      block), the MLP's saved tensors and input gone, the residual stream's gradient and
      the MLP input's held (``weight_grad_cast_working_set``'s FC1 moment; with one
      micro-batch, ``fresh_backward_grads`` and the entry's);
    - an untied head's on the last stage, first in the backward, its input's gradient held
      (``head_backward_moment``'s first), and the last block's down projection's after
      it, the head's messages still in flight;
    - the table's at the backward's end on the first stage (a tied copy's, deferred to
      ``finish()``, on either end of a pipeline), every activation gone.

    No moments where no codec runs in the backward (none; ZeRO-2/3, whose codec runs in
    ``finish()`` on shards; one rank). ``plait rehearse`` of four llama blocks (h 2048,
    F 5632, two micro-batches) at ``--dp 16 --zero 1 --compress qsgd:4`` peaked at an
    entry's: 88 MiB of the new gradient in fp32, 44 of the bucket's flat copy, 375 of
    messages (2026-11-29)."""
    from plait.dp_algos.config import compress_group
    from plait.sim import dp_algos as sim_dp

    n = compress_group(layout)[0]
    if runtime.grad_codec is None or layout.zero > 1 or n < 2:
        return []
    codec, arg = runtime.grad_codec
    e, t, r = ACT_BYTES[layout.dtype], layout.tp, residual_bytes(layout)
    g_bytes = runtime.state_bytes(layout.dtype)[1]
    m = layout.num_microbatches
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    f, h = cfg.ffn_hidden, cfg.hidden
    table = table_elements(cfg, layout)
    head, down = fresh_backward_grads(cfg, layout, runtime, last_stage)
    untied_head = last_stage and not cfg.tied_embeddings

    def bucket_of(elements: float) -> float:  # (of the rank's parameters at most)
        return min(_bucket_bytes(layout, elements * g_bytes) / g_bytes, params)

    # (tensor elements, elements of the buckets in flight as its hook fires, gradients
    # made by then with one micro-batch -- None: all --, activations gone, held beyond
    # them, whether the bucket's flat copy is held beside autograd's gradients, and held
    # before its launch besides)
    places = []
    if blocks:  # the new gradient of the entry's one GEMM (SwiGLU: gate and up) in fp32
        # beside the accumulated, both halves until the second is added in, and before
        # the hook the compute dtype's it was cast from; the flat copy beside
        # (``plait rehearse``: 88 + 44 MiB at h 2048, F 5632). In flight: the down
        # projection's, and before it the head's (the last block) or a block's
        up = (1 if cfg.arch == "gpt2" else 2) * f
        saved = (2 if cfg.arch == "gpt2" else 3) * f
        block = min(bucket_of(f * h / t), params - bucket_of(f * h / t))
        flying = (max(block, bucket_of(table) if untied_head else 0.0), block)
        cast = up * h / t * e if m > 1 and e < 4 and runtime.weight_cast_per_step else 0.0
        places.append((f * h / t, flying, head + down + up * h / t * g_bytes,
                       tokens * (saved / t * e + h / split * e),
                       tokens * h / split * r + tokens * h * e + (up * h / t * 4 if m > 1 else 0.0),
                       True, cast))  # fmt: skip
        if untied_head:  # the last block's down projection, right after the head (the
            # backward's first bucket, still in flight): its node done, its input gone and
            # its input's gradient held, the gradient added in (a parameter of its own)
            node = tokens * h / split * r + mlp_input_regather(cfg, layout, runtime)
            node += down_projection_input(cfg, layout)  # (the input's gradient, as large)
            places.append((f * h / t, (bucket_of(table),), head + down,
                           down_projection_input(cfg, layout), node, False, 0.0))  # fmt: skip
    # a table's gradient, a parameter of its own, is added in before its hook: no new
    # gradient or flat copy beside it (``plait rehearse`` of LLaMA 3.2 1B, --seq-len 1024
    # --dp 16 --compress qsgd:4: 4.44 GiB of temporaries at its launch, its 17 messages)
    if untied_head:  # the backward's first
        places.append((table, (), head, 0.0, tokens * h / split * e, False, 0.0))
    if first_stage or (last_stage and cfg.tied_embeddings):  # the backward's last: after
        # the first block's attention projections' buckets
        query = min(bucket_of(cfg.q_dim * h / t), params - bucket_of(table)) if blocks else 0.0
        places.append((table, (query, query) if query else (), None, last, 0.0, False, 0.0))
    out = []
    for tensor, flying, made, gone, held, beside, early in places:
        bucket = bucket_of(tensor)
        pack = bucket * g_bytes if beside else 0.0  # the bucket's flat copy
        moments = sim_dp.codec_buffers(codec, arg, n, bucket, tensor, flying)
        for i, (messages, work, packed) in enumerate(moments):  # (the first, before the
            # bucket is packed: as the hook fires, the compute dtype's gradient not yet gone)
            out.append((0.0 if m > 1 else made, pack if packed else 0.0, messages, gone,
                        held + work + (early if i == 0 and not packed else 0.0)))  # fmt: skip
    return out


def w_cast_working_set(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                       last: bool) -> tuple[float, float, float]:  # fmt: skip
    """(Bytes a zero-bubble W holds beyond its micro-batch's kept tensors and the gradients
    as it casts an MLP weight's gradient back to the weights' fp32 to add it to the
    ``.grad`` an earlier W made (``Runtime.weight_cast_per_step``), of that micro-batch's
    kept inputs and of its captured output gradients let go by then). The cast holds the
    GEMM's e-byte gradient and its fp32 copy, e + 4 bytes a weight of the tp shard: the
    down projection's first, then the entry's (SwiGLU's fused gate and up, twice the
    weights), once the down projection's input and captured output gradient are gone; on
    the last stage the head's W and the final norm's come before both (their inputs and
    captured output gradients gone: ``bi_captured_bytes``). The moment of the two with the
    more held. (0, 0, 0) on a first stage's W under ``zb_autograd_split`` (a whole
    backward: ``weight_grad_cast_working_set``), for MoE, LoRA, fp32 or ZeRO-2/3.
    ``plait rehearse`` of four llama blocks (h 2048) at ``--pp 2 --cp 2``, ZB-H1 and two
    micro-batches, peaked on the last stage in the second W's entry cast (44 + 88 MiB),
    no cp exchange held there: 1.004 of the model without the moment, activations 1.57
    and temporaries 0.71 (the model at a BI's end, its exchange held)."""
    if (not runtime.weight_cast_per_step or layout.dtype == "fp32" or layout.zero > 1
            or layout.schedule != "zb-h1"):  # fmt: skip
        return 0.0, 0.0, 0.0
    e, t = ACT_BYTES[layout.dtype], layout.tp
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    f, h = cfg.ffn_hidden, cfg.hidden
    up = (1 if cfg.arch == "gpt2" else 2) * f
    inputs = caps = 0.0
    if last:  # the head's W and the final norm's, as the keep counts them
        norm = residual_bytes(layout) / split if runtime.zb_autograd_split else 0.0
        caps = bi_captured_bytes(cfg, layout, runtime, 0, last=True)
        inputs = tokens * h * (e + norm)
    down = (f * h / t * (e + 4), inputs, caps)
    entry = (up * h / t * (e + 4), inputs + tokens * f / t * e, caps + tokens * h / split * e)
    return max(down, entry, key=lambda x: x[0] - x[1] - x[2])


def chunk_activation_bytes(
    cfg: ModelConfig, layout: Layout, runtime: Runtime, layers: int, moe_layers: int = 0,
    lora=None, first: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(bytes its blocks hold per in-flight micro-batch, of which kept until W). With cp,
    of the s / cp tokens a rank holds, and no scores (module docstring). ``moe_layers`` of
    the ``layers`` are MoE blocks (``expert.activation_bytes`` for their MLP). ``lora``
    (a ``LoRAConfig``): a frozen linear keeps no input for a weight gradient, so the
    inputs only the base's weight gradients kept go unless an adapter on that linear
    keeps them (``lora_dropped_inputs``). ``first``: the chunk holds the model's first
    block, whose attention under LoRA without an attention adapter sees nothing that
    trains (the embedding is frozen) and keeps nothing at all."""
    e = ACT_BYTES[layout.dtype]
    b, t, s = layout.micro_batch_size, layout.tp, cfg.seq_len // layout.cp
    per_layer = sizes.activation_bytes_per_layer(
        cfg,
        micro_batch_size=b,
        seq_len=s,
        tp=t,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute,
        act_bytes=e,
        flash_attention=runtime.flash_attention or layout.cp > 1,
        residual_bytes=residual_bytes(layout),
    )
    tokens = b * s
    split_all = t if layout.sequence_parallel else 1
    # weight-gradient inputs: QKV and FC1 inputs (h, split under SP), attention output
    # (heads x head size / t: h unless ``head_dim`` is set) and the FC2 input (f / t)
    w_keep = tokens * e * (2 * cfg.hidden / split_all + (cfg.q_dim + cfg.ffn_hidden) / t)
    # and their output gradients (``bi_captured_bytes``); where W re-runs the norms'
    # backwards, their inputs too
    if lora is None:
        w_keep += bi_captured_bytes(cfg, layout, runtime, 1)
        if runtime.zb_autograd_split:
            w_keep += 2 * tokens * cfg.hidden / split_all * residual_bytes(layout)
            if cfg.qk_norm:  # Qwen 3's q and k norms: the fused QKV storage, 1/rms
                kv = sizes.kv_width_per_rank(cfg, t)
                heads = (cfg.q_dim / t + kv) / cfg.head_dim
                w_keep += tokens * ((cfg.q_dim / t + 2 * kv) * e + 4 * heads)
    if layout.recompute == "full":
        w_keep = 0.0  # recomputed in the backward, freed with it
    mlp_adapters = 0.0  # the dense MLP's adapters' products, which a MoE block has not
    if lora is not None and layout.recompute != "full":
        dropped = tokens * e * lora_dropped_inputs(cfg, layout, lora)
        per_layer, w_keep = per_layer - dropped, max(0.0, w_keep - dropped)
        # each adapter keeps its rank-r product (B's input: T r, a partial sum beside a
        # row-parallel layer), the dense MLP's targets in dense blocks only
        per_layer += tokens * e * lora.rank * len(lora.targets)
        mlp = sum(1 for x in lora.targets if x in ("up", "gate", "down"))
        mlp_adapters = tokens * e * lora.rank * mlp
    held, keep = layers * per_layer, layers * w_keep
    if first and layers and lora is not None and layout.recompute != "full":
        # block 0's input norm: its input (the frozen embedding's output) takes no gradient
        # and its weight is frozen, so autograd records nothing there (``plait rehearse``
        # of four llama blocks under LoRA on q and v: the activations' own peak 0.991 of
        # the model's while it kept it)
        held -= tokens * cfg.hidden * residual_bytes(layout) / split_all
        if not lora.adapts_attention:  # block 0's attention: no graph
            kv = sizes.kv_width_per_rank(cfg, t)
            core = 4 * cfg.n_heads  # fused attention's log-sum-exp
            held -= tokens * ((2 * cfg.q_dim * e + core) / t + 2 * kv * e)
    if layout.cp > 1 and layout.cp_mode == "a2a" and layout.recompute == "none":
        # Ulysses: the attention's output is kept twice -- head-split over the whole
        # sequence by the core, sequence-split by the o projection after the all-to-all
        # back (one storage where they are one tensor; selective recomputes the core)
        held += layers * tokens * e * cfg.q_dim / t
    if moe_layers and layout.recompute != "full":  # the routed MLP's in place of the dense
        dense_mlp = tokens * (2 if cfg.arch == "gpt2" else 3) * cfg.ffn_hidden / t * e
        routed = ep_sim.activation_bytes(cfg, layout, runtime.moe_imbalance)
        held += moe_layers * (routed - dense_mlp)
        M, R = ep_sim.rows(cfg, layout, runtime.moe_imbalance)
        F_t = cfg.moe_ffn_hidden / t  # W keeps the experts' inputs and last GEMMs' inputs
        if lora is not None:
            held -= moe_layers * (lora_moe_dropped(cfg, layout, lora, M, R, tokens) + mlp_adapters)
            # the experts' adapters' rank-r products: the busiest rank's R rows (and every
            # token through the shared experts) per adapted expert weight
            from plait.model.lora import expert_targets

            rows = R + (tokens if cfg.moe_shared_experts else 0)
            held += moe_layers * expert_targets(cfg, lora) * rows * lora.rank * e
        moe_keep = e * (R * (cfg.hidden + F_t) + tokens * cfg.moe_shared_experts * F_t)
        keep += moe_layers * (moe_keep - tokens * e * cfg.ffn_hidden / t)
    return held, keep  # (more than held: the output gradients W needs are BI's)


def lora_moe_dropped(cfg: ModelConfig, layout: Layout, lora, M: float, R: float,
                     tokens: int) -> float:  # fmt: skip
    """Bytes a MoE block of a LoRA run keeps less than ``chunk_activation_bytes`` counts
    from the dense block's drops and ``expert.activation_bytes``: the frozen router keeps
    no input, so the MLP's input (h, split under sequence parallelism) goes even where up
    or gate has an adapter (the routed experts' adapters read the permuted rows) -- unless
    shared experts, which read it, have one; the dense
    block's second-GEMM input that ``lora_dropped_inputs`` took off does not exist in a MoE
    block (it is put back); the permuted rows (M h) go unless up or gate has an adapter,
    the experts' second-GEMM inputs (R F / t) unless down has one. Counted with ``plait
    rehearse`` (a tiny llama MoE block, LoRA on q and v: 0.85 of the model before)."""
    e, t = ACT_BYTES[layout.dtype], layout.tp
    split_all = t if layout.sequence_parallel else 1
    targets = set(lora.targets)
    first = bool(targets & {"up", "gate"})
    # (shared experts with such an adapter read, and keep, the MLP's input themselves)
    out = tokens * e * cfg.hidden / split_all if first and not cfg.moe_shared_experts else 0.0
    if "down" not in targets:
        out -= tokens * e * cfg.ffn_hidden / t  # lora_dropped_inputs' dense term, back
        out += (R + tokens * cfg.moe_shared_experts) * cfg.moe_ffn_hidden / t * e
    if not first:
        out += M * cfg.hidden * e
    return out


def gathered_layer_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """One block's parameters as ZeRO-3 holds them gathered on a tp rank. The weights of
    its matrix multiplies and the biases added inside them (q, k, v, the MLP's first
    layer: column-parallel, split over tp) are held in the dtype they are gathered in --
    under bf16 / fp16 the compute dtype for plait and FSDP2 (``gather_in_compute_dtype``),
    which is what autocast would multiply by anyway; the norms and the biases added after
    a tp reduction (replicated over tp) in the weights' own dtype (plait: fp32)."""
    h, t = cfg.hidden, layout.tp
    w = runtime.state_bytes(layout.dtype)[0]
    e = runtime.param_comm_bytes(layout.dtype)
    inside = sizes.layer_matmul_params(cfg)
    if cfg.biases:
        inside += h + 2 * cfg.kv_dim + cfg.ffn_hidden
    return inside / t * e + (sizes.layer_params(cfg) - inside) * w


def zero3_buffer_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """ZeRO-3's working buffers on one device: two gathered layers (the current one and
    the prefetched next, ``gathered_layer_bytes``), the prefetch's input
    (``gather_input_bytes``) and one layer's full gradient before its reduce-scatter.
    With MoE blocks, of the larger block: a MoE block gathers its router, shared and
    E / ep routed experts in the dtype of the matrix weights -- the
    experts over their edp group, and not at all where that group is one rank, the
    runtime keeps them in place (``zero3_in_place_alone``: ep == dp) and they are
    gathered in their stored dtype (plait: fp32 runs; under bf16 a cast copy is made)."""
    if layout.zero != 3:
        return 0.0
    gathered, grads = _zero3_parts(cfg, layout, runtime)
    return 2 * gathered + grads + gather_input_bytes(cfg, layout, runtime)


def gather_input_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """A ZeRO-3 all-gather's input when the wire dtype is not the shards' (bf16 gathers of
    fp32 shards): this rank's row of a block cast to it (``zero_units.Gather``; FSDP2's
    all-gather input alike), held while the prefetched gather is in flight. A block's
    parameters over the shard group, in the wire dtype: 49 MiB at the rehearsal sweep's
    dp 2, 6 MiB for LLaMA-2 7B at dp 64."""
    w, e = runtime.state_bytes(layout.dtype)[0], runtime.param_comm_bytes(layout.dtype)
    if layout.zero != 3 or e == w:
        return 0.0
    return sizes.layer_params(cfg) / layout.tp / dp_groups(layout, False)[0] * e


def zero3_gathered_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """One gathered layer's bytes under ZeRO-3 (a MoE block's, where larger)."""
    return _zero3_parts(cfg, layout, runtime)[0]


def _zero3_parts(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> tuple[float, float]:
    """(one gathered layer's bytes, one layer's full gradient's bytes) under ZeRO-3
    (``zero3_buffer_bytes``)."""
    _, g_bytes, _ = runtime.state_bytes(layout.dtype)
    gathered, grads = (
        gathered_layer_bytes(cfg, layout, runtime),
        sizes.layer_params(cfg) / layout.tp,
    )
    if cfg.moe:
        routed = ep_sim.expert_params(cfg, layout)
        extra = ep_sim.dense_part_extra(cfg, layout) + routed
        e, w = runtime.param_comm_bytes(layout.dtype), runtime.state_bytes(layout.dtype)[0]
        in_place = runtime.zero3_in_place_alone and dp_groups(layout, True)[0] == 1 and e == w
        held = extra - routed if in_place else extra
        gathered += max(held, 0.0) * e
        grads += max(extra, 0.0)
    return gathered, grads * g_bytes


def weight_cast_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime, layers: int,
                      last: bool = False, moe_layers: int = 0) -> float:  # fmt: skip
    """The compute-dtype copy of a rank's blocks' matrix weights that a step holds
    (``Runtime.weight_cast_per_step``): 2 bytes per matmul parameter of its ``layers``
    blocks' tp shard -- 2.53 GiB a rank for 6 layers of GPT-3 175B at tp 8 -- and on the
    ``last`` stage the head's vocabulary shard (V h / t; a tied head's cast is autocast's,
    held by the micro-batch in flight there: the same bytes). Found by rehearsal: LLaMA-2
    7B's activations outside its blocks were 0.245 GiB over the model at 2,048 and 4,096
    tokens alike, the head's 32,000 x 4,096 bf16 copy. ``moe_layers`` of the ``layers``
    hold their experts' stacked weights (this ep rank's routed ones and the shared ones)
    in place of the dense MLP's (``moe.Experts``: one cast a step, ``tensor.step_cast``).
    Under fp32 ``--qat`` (``Runtime.qat``) the blocks' fake-quantised weights in fp32."""
    if runtime.qat and layout.dtype == "fp32" and layout.zero != 3:  # the quantised copy
        return 4.0 * layers * sizes.layer_matmul_params(cfg) / layout.tp  # of the blocks'
    if not runtime.weight_cast_per_step or layout.dtype == "fp32" or layout.zero == 3:
        return 0.0
    head = cfg.vocab_size * cfg.hidden if last else 0
    n = (layers * sizes.layer_matmul_params(cfg) + head) / layout.tp
    n += moe_layers * ep_sim.mlp_matmul_extra(cfg, layout)  # experts for the dense MLP
    return 2.0 * n


def memory_per_rank(
    cfg: ModelConfig,
    layout: Layout,
    runtime: Runtime,
    stage_layers: list[int],
    overhead: float,
    compiled: Compiled | None,
    lora=None,
) -> list[Memory]:
    """Memory of one device on each pipeline rank (all dp / tp peers are alike). Without
    a compiled schedule, each rank holds ``schedules.in_flight_bound`` micro-batches of
    its average chunk, and under ZB-H1 ``awaiting_weight_bound`` more of what each keeps
    for its deferred W (exact for even stages). ``lora`` (a ``LoRAConfig``): the base is
    frozen -- weights only, sharded under ZeRO-3 -- and the adapters carry gradients and
    optimizer state (each keeps its rank-r product: ``chunk_activation_bytes``)."""
    p, v = layout.pp, layout.vpp
    last_stage = p * v - 1
    w_bytes, g_bytes, o_bytes = runtime.state_bytes(layout.dtype)
    weights, heads, params, adapters, experts = [], [], [], [], []
    routed_adapters = []
    head = last_stage_buffers(cfg, layout, lora)
    moe = ep_sim.stage_moe_layers(cfg, stage_layers)
    # per rank: what a recomputing block's forward, made again in its backward, adds to the
    # micro-batches in flight -- less what that micro-batch's backward freed before it
    # reached the block: the chunk's later blocks, which keep their activations
    # (--recompute-layers), and on the last stage the head's buffers
    transient = []
    # per rank, a moment that tops the activations' own peak and nothing else, as no
    # gradient or working set is held there: a dense MLP's silu(gate)
    # (``mlp_forward_transient``) on top of a recomputing block's forward made again
    own_only = []
    # per rank and chunk, (what its forward holds at its end beyond its micro-batch's
    # weight below, a stage output awaiting its send): ``pipeline.forward_peaks``
    ends_of_forward = []
    # per rank, the same with each block's backward working set on top
    # (``mlp_backward_working_set``): what the rehearsal calls temporaries
    working = []
    # per rank, the backward's start that leads ``working`` (which floors it at 0):
    # (activations freed, working set, whether a kept block's -- a recomputing one's
    # freed is netted in ``transient``); a kept block's freed bytes (the head's buffers,
    # an MLP's input) are apart at the peak, and a ZeRO-3 last stage's start is a moment
    starts = []
    # per rank and chunk, the same two for that chunk's blocks (the rank's: the chunks'
    # largest): a pipeline state knows whose backward follows it (``peak_with_grads``)
    chunk_work = []
    chunk_fresh = []  # per rank and chunk: the same in a first backward (``fresh_work``)

    def lead(work: tuple, net: float, start: tuple) -> tuple:
        """A chunk's (working set, start) with a backward start of ``net`` bytes beyond
        the activations' peak, ``start`` its (freed, working set, kept), weighed in."""
        value, best = work
        return max(value, net), (start if net > best[1] - best[0] else best)

    chunk_params = []  # per rank, each chunk's parameters (its share of the gradients)
    ends = backward_transient(cfg, layout, runtime)
    # per rank, the output gradients a BI captures for its W, of its largest chunk
    captured = [0.0] * p
    w_grads = []  # per rank and chunk: of ``keep``, the output gradients BI captured
    for rank in range(p):
        row, n, x, grad_rows = [], 0.0, 0.0, []
        transient.append(0.0)
        own_only.append(0.0)
        ends_of_forward.append([])
        chunk_work.append([])
        chunk_fresh.append([])
        chunk_params.append([])
        for chunk in range(v):
            stage = chunk * p + rank
            layers = stage_layers[stage]
            chunk_params[rank].append(
                stage_params(cfg, layout, layers, stage == 0, stage == last_stage, moe[stage])
            )
            n += chunk_params[rank][-1]
            x += moe[stage] * ep_sim.expert_params(cfg, layout)
            held = keep = freed = captures = 0.0
            blocks = chunk_blocks(cfg, layout, stage_layers, stage)
            for recomputed, (dense, routed) in blocks.items():
                lay = layout.recomputing_all() if recomputed else layout.without_recompute()
                # the model's first block: the first of those recomputing, if any do
                at_first = stage == 0 and (recomputed or layout.recomputed_blocks(layers) == 0)
                h, k = chunk_activation_bytes(cfg, lay, runtime, dense + routed, routed, lora,
                                              first=at_first and dense + routed > 0)  # fmt: skip
                held, keep = held + h, keep + k
                if not recomputed:
                    freed += h
                if lora is None and lay.recompute != "full":  # of ``k``, BI's captures
                    captures += bi_captured_bytes(cfg, lay, runtime, dense + routed)
            head_freed = head if stage == last_stage else 0.0
            if stage == last_stage and cfg.tied_embeddings and layout.schedule != "zb-h1":
                # and a tied head's autocast cast of the table, which only the head's
                # backward reads (ZB-H1's head W keeps it: ``zb_autograd_split``)
                head_freed += weight_cast_bytes(cfg, layout, runtime, 0, last=True)
            waits = waiting_table_grad(cfg, layout, runtime, stage == 0 == last_stage, lora)
            work = (0.0, (0.0, -math.inf, False))  # the chunk's (``chunk_work``)
            index = sum(stage_layers[:stage]) + layers - 1  # the chunk's last block
            dense_end = (layers > 0 and not cfg.is_moe_layer(index)
                         and layout.recomputed_blocks(layers) < layers)  # fmt: skip
            end = forward_end_moment(cfg, layout, runtime, stage == last_stage, dense_end, lora)
            # a stage output awaiting its send, in the wire's dtype
            output = 0.0 if stage == last_stage else boundary_bytes(cfg, layout)
            if stage == last_stage:  # its weight counts the head's buffers, not made yet,
                end -= head  # and the step's casts the head's weight's, made at the step's
                if cfg.tied_embeddings or layout.num_microbatches == 1:  # first head (a
                    end -= weight_cast_bytes(cfg, layout, runtime, 0, last=True)  # tied one: each)
                # or the loss's moment, the head's buffers made and its logits still held
                end = max(end, head_logits_bytes(cfg, layout))
            ends_of_forward[rank].append((end if layers or stage == last_stage else 0.0,
                                          output))  # fmt: skip
            if layout.recompute == "full":
                freed += head_freed
                dense, routed = blocks[True]
                for count, moe_block in ((dense, False), (routed, True)):
                    if count:
                        t = recompute_transient(cfg, layout, runtime, lora, moe_block)
                        transient[rank] = max(transient[rank], t - freed)
                        if not moe_block:  # made again, silu(gate) beside the MLP's entry
                            fwd = mlp_forward_transient(cfg, layout, runtime)
                            own_only[rank] = max(own_only[rank], t + fwd - freed)
                        ws, gone = mlp_backward_moment(cfg, layout, runtime, moe_block, lora,
                                                       stage == 0, stage == last_stage)  # fmt: skip
                        work = lead(work, t + ws + waits - freed - gone,
                                    (freed + gone, t + ws + waits, False))  # fmt: skip
            # a block that keeps its activations starts its backward with them all held,
            # the head's buffers freed (the recomputing ones: above)
            keeps = {k: v for k, v in blocks.items() if not k or layout.recompute != "full"}
            # and in a chunk's first backward of a step, with the gradients it has made by
            # then (``fresh_backward_grads``): (working set net of what it freed, the
            # gradients made, start)
            fresh_work = (-math.inf, 0.0, None)
            for dense, routed in keeps.values():
                for count, moe_block in ((dense, False), (routed, True)):
                    if count:
                        ws, gone = mlp_backward_moment(cfg, layout, runtime, moe_block, lora,
                                                       stage == 0, stage == last_stage)  # fmt: skip
                        work = lead(work, ws + waits - head_freed - gone,
                                    (head_freed + gone, ws + waits, True))  # fmt: skip
                        if (not moe_block and lora is None and layout.schedule != "zb-h1"
                                and layout.zero < 2):  # fmt: skip
                            ws, gone, made = mlp_backward_moment(
                                cfg, layout, runtime, False, lora, stage == 0,
                                stage == last_stage, fresh=True)  # fmt: skip
                            net = ws + waits - head_freed - gone
                            if net + made > fresh_work[0] + fresh_work[1]:
                                fresh_work = (net, made,
                                              (head_freed + gone, ws + waits, True))  # fmt: skip
            chunk_work[rank].append(work)
            chunk_fresh[rank].append(fresh_work)
            if stage == 0 and runtime.zb_autograd_split:
                keep = held  # no input gradient: its W is the whole backward (runtime.py)
                captures = 0.0
            elif keep and lora is None:
                captured[rank] = max(captured[rank], bi_captured_bytes(
                    cfg, layout, runtime, layers, last=stage == last_stage))  # fmt: skip
            if stage == last_stage and stage and keep and lora is None:  # the head's W: its input
                # and output gradient (the logits'); and the final norm's, where kept
                tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
                split = layout.tp if layout.sequence_parallel else 1
                norm = residual_bytes(layout) / split if runtime.zb_autograd_split else 0.0
                head_grads = bi_captured_bytes(cfg, layout, runtime, 0, last=True)
                captures += head_grads
                keep += head_grads + tokens * cfg.hidden * (ACT_BYTES[layout.dtype] + norm)
                if cfg.tied_embeddings:  # a tied table's autocast cast, saved by the head's
                    # GEMM: its node is W's too, and autograd unpacks every saved tensor of a
                    # node it applies, so the cast stays to the W (``weight_cast_bytes``)
                    keep += weight_cast_bytes(cfg, layout, runtime, 0, last=True)
            row.append((held + (head if stage == last_stage else 0.0), keep))
            grad_rows.append(captures)
        weights.append(tuple(row))
        # the rank's working set and start: its chunks' largest (the first of equals)
        working.append(max(w for w, _ in chunk_work[rank]))
        starts.append(max((b for _, b in chunk_work[rank]), key=lambda b: b[1] - b[0]))
        w_grads.append(grad_rows)
        heads.append(head if rank == last_stage % p else 0.0)
        params.append(n)
        experts.append(x)
        if lora is not None:
            from plait.model.lora import stage_adapters

            held = stage_adapters(cfg, lora, tp=layout.tp, ep=layout.ep,
                                  layers=sum(stage_layers[c * p + rank] for c in range(v)),
                                  moe_layers=sum(moe[c * p + rank] for c in range(v)))  # fmt: skip
            adapters.append(held.replicated)
            routed_adapters.append(held.routed)
    at_bi = [0.0] * p  # closed form, ZB-H1: the held bytes as a BI ends, before it lets go

    def activation_peaks(weights: list) -> tuple[list[float], list[float]]:
        """Each rank's activations' peak with ``weights[rank][chunk]`` = (held from F to
        B / BI, kept until W) per micro-batch, and the output gradients BIs captured
        (``w_grads``) that it holds (fills ``at_bi``)."""
        if compiled is not None:
            return peak_held(compiled, tuple(weights), tuple(w_grads))
        m = layout.num_microbatches
        act, grads = [], []
        for rank in range(p):
            kw = dict(num_ranks=p, num_microbatches=m, num_chunks=v, rank=rank)
            bound = in_flight_bound(layout.schedule, **kw)
            waiting = awaiting_weight_bound(layout.schedule, **kw)  # ZB-H1's deferred W
            blocks = sum(held for held, _ in weights[rank]) - heads[rank]
            kept = sum(keep for _, keep in weights[rank])
            last_in_flight = m if layout.schedule == "gpipe" else 1
            captured_all = sum(w_grads[rank])
            peak = (bound * blocks + waiting * kept) / v + heads[rank] * last_in_flight
            held_grads = waiting * captured_all / v
            if layout.schedule == "zb-h1" and p > 1:  # after BIs, up to r + 1 wait for W
                most = min(rank + 1, bound + waiting)  # (tests/test_schedules.py)
                after = (bound + waiting - most) * (blocks + heads[rank]) + most * kept
                if after > peak:
                    peak, held_grads = after, most * captured_all
                # a BI ends from each chain state that still holds a forward: the larger end
                at_bi[rank] = max((bound + waiting - j) * (blocks + heads[rank]) + j * kept
                                  for j in {waiting, max(waiting, most - 1)})  # fmt: skip
            act.append(peak)
            grads.append(held_grads)
        return act, grads

    def forward_end_peaks(weights: list, bare: list) -> list[float]:
        """Each rank's activations at its forwards' ends (``forward_end_moment``, with
        the stage outputs awaiting their send beside them), ``weights`` and ``bare`` as
        ``activation_peaks``' and its peaks. Without a compiled schedule: the busiest
        chunk's end on top of the peak, one earlier output awaiting its send where a rank
        runs two forwards in a row before its first backward."""
        if compiled is not None:
            return forward_peaks(compiled, tuple(weights), tuple(map(tuple, ends_of_forward)))
        out = []
        for rank in range(p):
            bound = in_flight_bound(layout.schedule, num_ranks=p,
                                    num_microbatches=layout.num_microbatches,
                                    num_chunks=v, rank=rank)  # fmt: skip
            out.append(bare[rank] + max(end + (output if bound > 1 else 0.0)
                                        for end, output in ends_of_forward[rank]))  # fmt: skip
        return out

    # of the activations' peak, the output gradients BIs captured for their Ws: made in a
    # backward (the rehearsal's temporaries), held as long as the inputs W also needs; and
    # the peak of the rest, what forwards made, wherever it falls (``at_bi``: the second)
    made_weights = [[(h, k - g) for (h, k), g in zip(row, grads)]
                    for row, grads in zip(weights, w_grads)]  # fmt: skip
    forward_made = activation_peaks(made_weights)[0]
    forward_made = [
        max(a, f) for a, f in zip(forward_made, forward_end_peaks(made_weights, forward_made))
    ]
    act, awaiting_w = activation_peaks(weights)
    bare = act  # the activations' peak without the recomputation transients
    act = [a + t for a, t in zip(act, transient)]  # (the transients above)
    own = [max(a, b + o) for a, b, o in zip(act, bare, own_only)]  # and their own peak's
    at_ends = forward_end_peaks(weights, bare)  # forwards' ends
    own = [max(a, f) for a, f in zip(own, at_ends)]
    forward_made = [a + t for a, t in zip(forward_made, transient)]
    held = [a + w for a, w in zip(bare, working)]  # ... and the backward's working set
    # only with no more micro-batches than stages can a rank's forwards all come before
    # its first gradients (GPipe's always do): the schedule, short then, says which
    states = compiled
    if states is None and layout.schedule != "gpipe" and layout.num_microbatches <= p:
        try:
            states = compile_schedule(layout.schedule, p, layout.num_microbatches, v)
        except ScheduleError:
            pass  # not a schedule that runs: the simulator says so

    out = []
    for rank in range(p):
        n = params[rank]
        state = rank_model_state(  # LoRA: adapters trained, the base frozen
            layout, n, adapters[rank] if lora is not None else None,
            state_bytes=(w_bytes, g_bytes, o_bytes), experts=experts[rank],
            expert_adapters=routed_adapters[rank] if lora is not None else 0.0,
        )  # fmt: skip
        w, g, o = state["params"], state["grads"], state["optim"]
        g += deferred_table_grads(cfg, layout, runtime, rank in (0, p - 1))
        buffers = zero3_buffer_bytes(cfg, layout, runtime)
        full = _zero3_parts(cfg, layout, runtime)[1] if buffers else 0.0  # a layer's gradient
        if lora is not None and buffers:  # a layer's gradient awaiting its reduce-scatter
            layers = max(1, sum(stage_layers[c * p + rank] for c in range(v)))
            buffers -= g_bytes * (sizes.layer_params(cfg) / layout.tp - adapters[rank] / layers)
            full = g_bytes * adapters[rank] / layers
        moments = []  # where a ZeRO-2/3 backward may peak (``zero2_*_moment``, ``zero3_...``)
        m = layout.num_microbatches
        # every forward of the rank before its first backward (one micro-batch, GPipe, 1F1B
        # with no more micro-batches than the rank's warm-up)
        fresh = in_flight_bound(layout.schedule, num_ranks=p, num_microbatches=m,
                                num_chunks=v, rank=rank) >= m * v  # fmt: skip
        if layout.zero == 2 and runtime.zero2_reduce_per_microbatch:
            moments = [
                zero2_block_moment(cfg, layout, runtime, rank == p - 1, lora),
                zero2_up_cast_moment(cfg, layout, runtime, rank == p - 1, lora),
                zero2_entry_launch_moment(cfg, layout, runtime, rank == p - 1, lora),
                zero2_mlp_norm_moment(cfg, layout, runtime, rank == p - 1, lora),
            ]
            waits = waiting_table_grad(cfg, layout, runtime, p == 1, lora)
            # (a moment that does not arise here is all zeros: not one to add the wait to)
            moments = [(a, b, c, d + waits) for a, b, c, d in moments if (a, b, c, d) != (0,) * 4]
            if rank == p - 1:
                moments.append(zero2_head_moment(cfg, layout, runtime, lora))
                moments.append(zero2_head_pack_moment(cfg, layout, runtime, lora))
            moments = zero2_fresh_moments(moments, g if m > 1 else 0.0, bare[rank] / m,
                                          fresh and m > 1)  # fmt: skip
        elif layout.zero < 2 and rank == p - 1:
            for grads, zbufs, freed, temps in head_backward_moment(cfg, layout, runtime, lora):
                if layout.schedule == "gpipe" and m > 1:  # with the gradients of m - 1
                    freed += bare[rank] * (m - 1) / m  # micro-batches: only the last's held
                moments.append((grads, zbufs, freed, temps))
        head_cast = 0.0
        # a backward's start or end runs no cp exchange: its attention's backward is a
        # moment of its own (``zero3_backward_moments``' ``attend``, ``cp_attention_moments``)
        exchange = True
        whole_w = rank == 0 and runtime.zb_autograd_split  # a first stage's W: a backward
        zero2 = layout.zero == 2 and runtime.zero2_reduce_per_microbatch and lora is None
        if (layout.cp > 1 and (layout.zero < 2 or zero2)
                and (layout.schedule != "zb-h1" or whole_w)):  # fmt: skip
            # (ZB-H1's BI keeps the MLP's saved tensors to its end: not modelled)
            last_layers = stage_layers[(v - 1) * p + rank]  # its last chunk's, first back
            layers = sum(stage_layers[c * p + rank] for c in range(v))
            attend = cp_attention_moments(
                cfg, layout, runtime, bare[rank], g, rank == 0, rank == p - 1, fresh,
                weights[rank][0][0] if v == 1 and layers > 1 else None,
                layout.recompute == "full" and layout.recomputed_blocks(last_layers) >= last_layers,
                lora,
            )  # fmt: skip
            if zero2:  # the first attention of a backward, its gradients in buckets
                made, done, packed = zero2_attention_moment(cfg, layout, runtime, rank == p - 1)
                attend = zero2_fresh_moments([(made, packed, attend[0][2], attend[0][3])],
                                             g if m > 1 else 0.0, bare[rank] / m,
                                             fresh and m > 1, done)  # fmt: skip
            moments += attend
            exchange = False
        if buffers and runtime.zero3_grads_in_flight and lora is None:
            exchange = False
            buffers -= full  # the gathered layers and the prefetch's input; in flight: below
            layers = sum(stage_layers[c * p + rank] for c in range(v))
            moments = zero3_backward_moments(cfg, layout, runtime, layers, rank == 0,
                                             rank == p - 1)  # fmt: skip
            # as the forward ends, a tied unit and the backward's first block gathered
            tied, head_cast = tied_zero3_unit(cfg, layout, runtime)
            if tied:
                buffers = max(buffers, tied + zero3_gathered_bytes(cfg, layout, runtime))
        elif buffers and runtime.zero3_grads_in_flight:  # LoRA: the adapters' gradients
            k = runtime.zero3_grads_in_flight
            lay = layout.recomputing_all() if layout.recompute_layers else layout
            a = chunk_activation_bytes(cfg, lay, runtime, 1, 0, lora)[0]
            shard = dp_groups(layout, False)[0]  # each in flight also writes its shard
            buffers += max(0.0, k * (full * (1 + 1 / shard) - a)) - full
        if buffers and rank == p - 1 and cfg.tied_embeddings and p == 1 and head_cast:
            # tied on one stage: the head's backward beside the tied unit (gathered through
            # the backward), the last block prefetched and the gather's input; the head
            # keeps its cast of the table to its end (off what every moment frees)
            _, _, logits, temps = zero3_head_backward_moment(cfg, layout, runtime)
            gathered = tied + zero3_gathered_bytes(cfg, layout, runtime) + gather_input_bytes(
                cfg, layout, runtime)  # fmt: skip
            moments.append((0.0, gathered, logits - head_cast, temps))
        elif buffers and rank == p - 1 and not (cfg.tied_embeddings and p == 1):
            moments.append(zero3_head_backward_moment(cfg, layout, runtime))
            freed, ws, _ = starts[rank]
            if ws - freed < 0:  # the activations' peak is the forward's end, the head's
                # unit gathered; the last block's backward start (two) a moment of its own
                moments.append((0.0, buffers, freed, ws))
                buffers = zero3_head_unit_bytes(cfg, layout, runtime)
        cp = 0.0
        if exchange:  # (ZeRO-2, ZB-H1's BI: not modelled at their moments, kept at the peak)
            cp = cp_sim.buffer_bytes(cfg, layout, not cp_sim.math_attention(layout, runtime))
        layers = sum(stage_layers[c * p + rank] for c in range(v))
        moe_here = sum(moe[c * p + rank] for c in range(v))
        tables = rotary_table_bytes(cfg, layout) * v  # each model chunk caches its own
        casts = weight_cast_bytes(cfg, layout, runtime, layers, last=rank == p - 1,
                                  moe_layers=moe_here)  # fmt: skip
        # of those, a tied head's is autocast's, kept by its micro-batch for the head's
        # backward only: gone at every backward moment (``weight_cast_bytes``)
        tied_cast = 0.0
        if casts and cfg.tied_embeddings and rank == p - 1:
            tied_cast = casts - weight_cast_bytes(cfg, layout, runtime, layers, last=False,
                                                  moe_layers=moe_here)  # fmt: skip
        # a backward ends after the last stage's head has let go of a tied table's cast;
        # the first stage's, in its embedding's backward (the table's gradients)
        end = ends - tied_cast
        emb = 0.0
        if rank == 0:
            emb = embedding_backward_transient(cfg, layout, runtime, p == 1, stage_layers[0])
            emb -= tied_cast
        if v == 1 and rank < p - 1:  # a stage short of the last holds the output gradient it
            # received until its chunk's backward returns (``executor._backward``)
            end += boundary_bytes(cfg, layout)
            emb += boundary_bytes(cfg, layout) if rank == 0 else 0.0
        # and the input it received, its first norm's saved input, until then: an
        # activation, made in a forward
        received = stream_bytes(cfg, layout) if rank > 0 else 0.0
        end += received
        # the gradients and the activations' peak together (module docstring)
        ending = 0.0  # of the joint peak, a backward's end's working set, if it is there
        short = 0.0  # of the gradients, what the joint peak's state has not made yet
        captures = 0.0  # of the joint peak, what a BI captured for its W as it ends
        w_at_peak = awaiting_w[rank]  # and what the waiting Ws' BIs captured
        # a BI's end: what it captured, as a backward ends its first block's input norm's
        # working set held (``backward_transient``)
        bi_end = captured[rank] + ends if captured[rank] else 0.0
        # the working set at the peak, and the start that leads it: the rank's largest,
        # or that of the chunk whose backward starts at the peak, where that is known
        work, start = working[rank], starts[rank]
        chunk = -1  # of the walk: the chunk whose backward starts at the peak, -2 a W's cast,
        # -3 a forward's end
        if states is not None:
            shares = [g * c / n if n else g / v for c in chunk_params[rank]]
            by_chunk = tuple(w for w, _ in chunk_work[rank])
            # a W's cast, per chunk (none on a first stage whose W is a whole backward)
            casting = [
                (0.0, 0.0, 0.0) if lora is not None or moe[c * p + rank] or (c * p + rank == 0 and whole_w)
                else w_cast_working_set(cfg, layout, runtime, c * p + rank == last_stage)
                for c in range(v)
            ]  # fmt: skip
            w_cast = tuple(max(0.0, a - b - c) for a, b, c in casting)
            fresh_starts = tuple(f[:2] if f[2] is not None else None for f in chunk_fresh[rank])
            walk = partial(peak_with_grads, states, rank, weights[rank], shares,
                           w_caps=tuple(w_grads[rank]), boundary=boundary_bytes(cfg, layout),
                           last_cast=tied_cast, fresh=fresh_starts,
                           forward_ends=tuple(ends_of_forward[rank]))  # fmt: skip
            found = walk((by_chunk, end, bi_end, emb, w_cast))
            if found[5] == -2 and cp:  # a W runs no cp exchange: against the others with it
                other = walk((by_chunk, end, bi_end, emb, (0.0,) * v))
                found = other if other[0] + cp >= found[0] else found
            joint, ending, made, captures, waiting, chunk, first_b = found
            if chunk == -2:  # a W's cast (its chunk's: the largest), what the Ws waiting
                # then captured less what the casting one has let go
                cast, _, let_go = max(casting, key=lambda x: x[0] - x[1] - x[2])
                cp, w_at_peak = 0.0, waiting - let_go
            if chunk >= 0:
                work, start = chunk_work[rank][chunk]
                if first_b:  # a chunk's first backward: its working set and start there
                    work, _, start = chunk_fresh[rank][chunk]
            if captures:  # a BI's end: its captures and those of the Ws waiting then
                w_at_peak = waiting
            short = max(0.0, g - made)
        elif layout.schedule == "gpipe":  # every forward before the first backward
            m = layout.num_microbatches
            at_end = bare[rank] * (m - 1) / m + g + max(end, emb)
            joint = max(held[rank], at_end)
            ending = max(end, emb) if at_end > held[rank] else 0.0
        else:  # m > p: a forward follows every rank's first backward
            joint = held[rank] + g
            if emb > 0 and bare[rank] - weights[rank][0][0] + g + emb > joint:  # a first-
                joint = bare[rank] - weights[rank][0][0] + g + emb  # chunk backward's end
                ending = emb
            if captured[rank] and at_bi[rank] and at_bi[rank] + bi_end + g > joint:
                joint, ending = at_bi[rank] + bi_end + g, 0.0  # a BI's end
                captures = bi_end
        if states is None:  # a forward's end: before any gradient under GPipe
            at_forward = at_ends[rank] + (0.0 if layout.schedule == "gpipe" else g)
            if at_forward > joint:
                joint, ending, captures, chunk = at_forward, 0.0, 0.0, -3
        # the temporaries at the peak: a backward's end's working set, where the peak is
        # there (its transient is net of a tied head's cast, gone by then: off the
        # activations); a BI's end's captured output gradients, made in its backward;
        # else the working set a backward starts with
        if chunk == -2:  # a W's cast: the whole cast (what it let go: off the activations)
            temps = cast
        elif chunk == -3:  # a forward's end: all of it made by forwards
            temps = 0.0
        elif ending > 0:
            temps = ending + tied_cast - (received if ending == end else 0.0)
        else:
            temps = captures if captures > 0 else bare[rank] + work - act[rank]
        freed, _, kept = start
        if (ending <= 0 and not captures and work > 0 and kept and chunk != -3
                and (layout.schedule != "zb-h1" or whole_w)):  # fmt: skip
            # a kept block's backward start: what it freed is gone from the activations
            # (``apart``). Not under ZB-H1, whose BI lets go of its saved tensors only as it
            # ends and whose head's W keeps its input (``zb_autograd_split``), but on its
            # first stage, whose W is a whole backward
            temps += freed
        apart = act[rank] + temps + g - joint
        # of which the gradients not made yet are the gradients' (short of the state's),
        # the rest the activations'
        # the activations at their own peak, where a moment of theirs alone tops it: apart
        apart += own[rank] - act[rank]
        # a first stage's backward ending in its embedding's: under ZeRO-0/1 with hooks,
        # the bucket copied into its flat buffer is the gradients' storage from then on
        flat = 0.0
        if (rank == 0 and ending > 0 and ending == emb and layout.zero < 2
                and not cfg.tied_embeddings and grad_ranks(layout) > 1):  # fmt: skip
            flat = min(temps, emb)
        mem = Memory(rank, w, g, o, own[rank], buffers, overhead, cp, casts + head_cast,
                     apart - short, temporaries=temps - flat, grads_moment=flat - short,
                     w_gradients=w_at_peak,
                     forward_made_peak=forward_made[rank] if awaiting_w[rank] else None,
                     tables=tables)  # fmt: skip
        # as ``finish()`` launches what the hooks did not: every activation and cast gone
        fin = finish_transient(cfg, layout, runtime, layers, rank == 0, rank == p - 1)
        if fin:
            gone = own[rank] + casts + head_cast
            end_of_step = Memory(rank, w, g, o, own[rank], 0.0, overhead, 0.0, casts + head_cast,
                                 gone, grads_moment=fin,
                                 forward_made_peak=mem.forward_made_peak,
                                 tables=tables)  # fmt: skip
            if end_of_step.total > mem.total:
                mem = end_of_step
        rows = g if layout.num_microbatches > 1 else 0.0  # the shard rows, from the second on
        # a codec's launches: the last micro-batch's activations, the head's buffers gone
        last = weights[rank][0][0] - (head if rank == p - 1 and v == 1 else 0.0)
        for made, pack, zbufs, gone, temps in codec_launch_moments(
                cfg, layout, runtime, rank == 0, rank == p - 1, layers > 0, last, n):  # fmt: skip
            moments.append(((g if made is None else made) + pack, zbufs,
                            bare[rank] - last + gone, temps))  # fmt: skip
        for grads, zbufs, freed, temps in moments:  # a peak in the backward (module doc)
            # no cp exchange runs at these moments but the attention's own, whose
            # working set is among its temporaries
            # (the head's cast of a tied table is among the activations' peak, and gone
            # once the head's backward is: freed with the rest)
            back = Memory(rank, w, g, o, own[rank], zbufs, overhead, 0.0, casts + head_cast,
                          own[rank] - bare[rank] + freed + head_cast + tied_cast,
                          temporaries=temps,
                          grads_moment=rows + grads - g, w_gradients=mem.w_gradients,
                          forward_made_peak=mem.forward_made_peak, tables=tables)  # fmt: skip
            if back.total > mem.total:
                mem = back
        out.append(mem)
    return out


def zero2_head_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                      lora=None) -> tuple[float, float, float, float]:  # fmt: skip
    """ZeRO-2's last stage as the head's backward ends, before the final norm's: the
    head's weight gradient made whole (V h / t in the gradients' dtype: its bucket,
    closed by the norm's, not yet packed into the shard rows), the head's buffers freed
    (``last_stage_buffers``), and the logits' fp32 gradient and the head input's
    gradient held. (gradients, buffers, activations freed, temporaries), as
    ``zero3_backward_moments``. ``plait rehearse`` of LLaMA-2 7B dp 64 peaked there:
    0.488 GiB of the head's gradient beside the shard rows, 0.52 of temporaries."""
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    e, g_bytes = ACT_BYTES[layout.dtype], runtime.state_bytes(layout.dtype)[1]
    split = layout.tp if layout.sequence_parallel else 1
    head = 0.0 if lora is not None else table_elements(cfg, layout) * g_bytes
    temps = tokens * (cfg.vocab_size / layout.tp * 4 + cfg.hidden / split * e)
    return head, 0.0, last_stage_buffers(cfg, layout, lora), temps


def zero2_head_pack_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                           lora=None) -> tuple[float, float, float, float]:  # fmt: skip
    """ZeRO-2's last stage as the head's bucket packs, the final norm's backward done: the
    head's weight gradient still whole beside its copy packed into fp32 rows of every
    shard (V h / t + h: ``ZeroDataParallel._launch``, before the gradient is let go), the
    logits' gradient gone, the final norm's input gradient held (T h / t under sequence
    parallelism, the stream's dtype). (gradients, buffers, activations freed,
    temporaries), as ``zero2_head_moment``; the packed copy is the pack's output, not yet
    handed to its reduce-scatter: a temporary. Where the table outweighs the logits' fp32
    gradient (LLaMA 3 8B, vocabulary 128,256, at 2,048 tokens: 2.0 GiB against 1.0) it
    leads: ``plait rehearse`` at dp 8 held 1.973 GiB of temporaries there, 67.566 in all
    (66.571 modelled without it). A tied table's gradient waits for the embedding's
    (none here), as under LoRA."""
    if lora is not None or cfg.tied_embeddings:
        return 0.0, 0.0, 0.0, 0.0
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = layout.tp if layout.sequence_parallel else 1
    g_bytes = runtime.state_bytes(layout.dtype)[1]
    head = table_elements(cfg, layout)
    packed = (head + cfg.hidden) * 4
    temps = packed + tokens * cfg.hidden / split * residual_bytes(layout)
    return head * g_bytes, 0.0, last_stage_buffers(cfg, layout, lora), temps


def zero2_head_bucket(cfg: ModelConfig, layout: Layout, last: bool) -> float:
    """Elements of ZeRO-2's first bucket on the last stage, the untied head's table and the
    final norm (a bucket of its own at any real size); 0 elsewhere."""
    return table_elements(cfg, layout) + cfg.hidden if last and not cfg.tied_embeddings else 0.0


def zero2_block_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime, last: bool,
                       lora=None) -> tuple[float, float, float, float]:  # fmt: skip
    """ZeRO-2 as a stage's last block starts its MLP's backward, its down projection's
    weight gradient made: that projection's gradient packed into fp32 with the final norm's
    (its bucket closed: a block's large tensors each fill a bucket of ``--bucket-mb``
    alone at any real size) and on the last stage the head's before it -- the two packed
    inputs in flight (``ZeroDataParallel``'s ``in_flight`` = 2) and the shard of each that
    its reduce-scatter writes, the head's buffers and the projection's input freed, and
    the MLP's working set (``mlp_backward_working_set``). (gradients, buffers, activations
    freed, temporaries), as ``zero2_head_moment``.
    ``plait rehearse`` of four llama blocks (h 2048, vocabulary 4,096, dp 2) peaked there:
    the head's and the down projection's packed gradients, 32 and 44 MiB, and the MLP's
    96 MiB of temporaries. LLaMA-2 7B dp 64 held there 55.617 GiB, buffers 0.656 and
    temporaries 0.367 as here (55.613 modelled): its head's moment, 55.706, leads."""
    if lora is not None:
        return 0.0, 0.0, 0.0, 0.0
    e, t = ACT_BYTES[layout.dtype], layout.tp
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    down = cfg.ffn_hidden * cfg.hidden / t
    head = zero2_head_bucket(cfg, layout, last)
    packed = (down + head) * 4  # fp32 rows of every shard: the whole gradient
    freed = (last_stage_buffers(cfg, layout) if last else 0.0) + tokens * cfg.ffn_hidden / t * e
    # each reduce-scatter in flight writes this rank's shard of its input, a row of its own
    # until it completes and is added to the bucket's
    outputs = packed / dp_groups(layout, False)[0]
    return outputs, packed, freed, mlp_backward_working_set(cfg, layout, runtime)


def zero2_up_cast_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime, last: bool,
                         lora=None) -> tuple[float, float, float, float]:  # fmt: skip
    """ZeRO-2 a step on from ``zero2_block_moment``: the same block's up projection (SwiGLU's
    fused gate and up; GPT-2's FC1) casting its weight gradient back to fp32
    (``Runtime.weight_cast_per_step``), both copies held (e + 4 bytes a weight of the tp
    shard), beside its input's gradient and the stream's; the packed gradients still in
    flight, the MLP's saved tensors and its input freed. (gradients, buffers, activations
    freed, temporaries), as ``zero2_head_moment``. ``plait rehearse`` of Mistral 7B dp 8
    (2,048 tokens) peaked there: the head's and the down projection's packed gradients
    (500 + 224 MiB) and 448 + 224 + 2 x 16 MiB of temporaries (60.151 GiB; 59.838
    modelled without the moment)."""
    if lora is not None or not runtime.weight_cast_per_step or layout.dtype == "fp32":
        return 0.0, 0.0, 0.0, 0.0
    outputs, packed, freed, _ = zero2_block_moment(cfg, layout, runtime, last)
    e, t, r = ACT_BYTES[layout.dtype], layout.tp, residual_bytes(layout)
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    split = t if layout.sequence_parallel else 1
    f, h = cfg.ffn_hidden, cfg.hidden
    up = (1 if cfg.arch == "gpt2" else 2) * f  # the MLP's entry width
    # beyond the down projection's input (freed above): the entry's output and its input
    gone = tokens * (up / t * e + h / split * e)
    temps = up * h / t * (e + 4) + tokens * (h * e + h / split * r)
    return outputs, packed, freed + gone, temps


def zero2_entry_launch_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime, last: bool,
                              lora=None) -> tuple[float, float, float, float]:  # fmt: skip
    """ZeRO-2 a step on from ``zero2_up_cast_moment``, on SwiGLU's fused gate and up: the
    bf16 weight gradient gone, the fp32 cast kept whole (the gate's and the up
    projection's gradients are views of it) as the first of the two launches -- its
    packed input and the shard its reduce-scatter writes, made in the backward and not
    yet handed to the collective (temporaries) -- where each weight fills a bucket of its
    own (``split_buckets``). Launching it first completes the oldest in flight when
    ``Runtime.zero3_grads_in_flight`` are (the head's, on the last stage), which lets go
    of that packed input. (gradients, buffers, activations freed, temporaries), as
    ``zero2_head_moment``. ``plait rehearse`` of four llama blocks (h 2048, 2,048 tokens)
    at ``--pp 2 --dp 2 --zero 2``, 2 micro-batches, peaked there on the first stage:
    the 88 MiB cast, the up projection's 44 MiB packed and 22 MiB shard, the down
    projection's in flight (1.014 of the model without the moment)."""
    if cfg.arch == "gpt2" or lora is not None:
        return 0.0, 0.0, 0.0, 0.0
    outputs, packed, freed, temps = zero2_up_cast_moment(cfg, layout, runtime, last, lora)
    if not temps:
        return 0.0, 0.0, 0.0, 0.0
    e, t = ACT_BYTES[layout.dtype], layout.tp
    weight = cfg.ffn_hidden * cfg.hidden / t * 4  # one entry weight's gradient, fp32
    if weight < layout.bucket_mb * 2**20:
        return 0.0, 0.0, 0.0, 0.0  # its bucket waits for the next parameter's
    shard = dp_groups(layout, False)[0]
    temps += weight * (1 + 1 / shard) - 2 * cfg.ffn_hidden * cfg.hidden / t * e
    head = zero2_head_bucket(cfg, layout, last)
    if head and runtime.zero3_grads_in_flight <= 2:  # the head's and the down projection's
        packed -= head * 4  # in flight, the oldest (the head's) completes: its input goes
    return outputs, packed, freed, temps


def zero2_mlp_norm_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime, last: bool,
                          lora=None) -> tuple[float, float, float, float]:  # fmt: skip
    """ZeRO-2 as the same block's MLP norm runs its backward, the MLP's weight gradients all
    launched: the last ``Runtime.zero3_grads_in_flight`` of its buckets still in flight --
    GPT-2's FC1 and FC2, SwiGLU's gate and up (each weight a bucket of its own:
    ``split_buckets``) -- their packed fp32 inputs and the shards their reduce-scatters
    write, the MLP's saved tensors and its input freed (``zero2_up_cast_moment``'s), and
    the norm's working set (``backward_transient``). (gradients, buffers, activations
    freed, temporaries), as ``zero2_head_moment``. GPT-2 has no launch beside its entry's
    cast (``zero2_entry_launch_moment``), so its two in flight meet the norm: ``plait
    rehearse`` of four GPT-2 blocks (h 2048, vocabulary 4,096, 2,048 tokens) at ``--dp 2
    --zero 2`` peaked there, at the second micro-batch's, with 2 x 64 MiB packed, 2 x 32
    of shards and 72 + 32 MiB of temporaries (the norm's, and the tied table's gradient
    waiting for the embedding's): 1.018 of the model without the moment; at ``--pp 2``
    the first stage, 1.033, where a biased block also holds the output gradient it
    received apart (``mlp_backward_moment``)."""
    if lora is not None or layout.dtype == "fp32":
        return 0.0, 0.0, 0.0, 0.0
    weight = cfg.ffn_hidden * cfg.hidden / layout.tp * 4  # one MLP weight's gradient, fp32
    if weight < layout.bucket_mb * 2**20 or not runtime.zero3_grads_in_flight:
        return 0.0, 0.0, 0.0, 0.0  # the buckets mix parameters: not this moment
    _, _, freed, _ = zero2_up_cast_moment(cfg, layout, runtime, last, lora)
    packed = min(runtime.zero3_grads_in_flight, 2) * weight
    outputs = packed / dp_groups(layout, False)[0]
    temps = backward_transient(cfg, layout, runtime)
    if not last and cfg.biases and ACT_BYTES[layout.dtype] < 4:  # the received gradient,
        temps += boundary_bytes(cfg, layout)  # apart from its fp32 sum's cast (as there)
    return outputs, packed, freed, temps


def zero2_fresh_moments(moments: list, rows: float, one: float, fresh: bool,
                        done: float = 0.0) -> list:  # fmt: skip
    """ZeRO-2's backward moments (gradients beyond the shard rows, buffers, activations
    freed, temporaries) where the rank's first backward of a step has every forward in
    flight (``fresh``, more than one micro-batch): there no shard row exists yet but the
    shards its launches wrote -- those in flight, which the moments count apart from the
    rows, and ``done``, those already completed -- so the rows' ``rows`` bytes come off;
    the next backward has the rows, and one micro-batch's activations (``one``) fewer in
    flight. Not fresh: the moments as they are (one micro-batch: no rows, ``done`` its
    own)."""
    if not fresh:
        return [(a + (done if rows == 0 else 0.0), b, c, d) for a, b, c, d in moments]
    return ([(a + done - rows, b, c, d) for a, b, c, d in moments]
            + [(a, b, c + one, d) for a, b, c, d in moments])  # fmt: skip


def zero2_attention_moment(cfg: ModelConfig, layout: Layout, runtime: Runtime,
                           last: bool) -> tuple[float, float, float]:  # fmt: skip
    """ZeRO-2's gradients and buffers as a stage's last block runs its cp attention's
    backward, the moment ``cp_attention_moments`` prices for ZeRO-0/1. ``split_buckets``
    cuts the parameters, last first, into buckets of ``--bucket-mb``; the backward has by
    then made the head's and final norm's gradients (on the last stage, untied), the
    MLP's, its norm's and the output projection's; every bucket all of whose gradients are
    made has been packed and launched, the last ``Runtime.zero3_grads_in_flight`` of them
    (``ReduceScatterGrads.in_flight``) still in flight, their fp32 input packed whole and
    their shard written apart, the others done; a made gradient in a bucket that waits for
    another (the attention's q, k, v, Qwen 3's q/k norms) is held whole. Returns
    (gradients apart from the shard rows: the in-flight shards and the whole gradients;
    the done buckets' shards, rows of their own in a step's first backward and added to
    the rows after it (``zero2_fresh_moments``); the packed inputs in flight).
    ``plait rehearse`` of four llama blocks (h 2048, vocabulary 4,096) at
    ``--cp 2 --dp 2 --zero 2`` peaked there:
    the gate's and up projection's packed gradients in flight (2 x 44 MiB), the head's,
    down projection's and those two's shards (8 + 11 + 2 x 11 MiB) and the output
    projection's gradient (16 MiB) in a bucket that also takes v's."""
    w = 4  # fp32 weights, packed in fp32
    # made by the moment, last parameter first (``bucket_runs``' order): the head's
    # (untied), the block's MLP, its norm and the output projection; Qwen
    # 3's q/k norms (registered after it), v, k, q and the input norm not yet. The block's
    # MLP as a dense one's (the walk does not list experts)
    block = chunk_param_elements(dataclasses.replace(cfg, moe_experts=0), layout, 1,
                                 False, last)  # fmt: skip
    # in the model's order: the input norm, q, k, v (their biases), o (its bias), q/k norms
    o = (2 if cfg.arch == "gpt2" else 1) + 3 * (2 if cfg.biases or cfg.qkv_bias else 1)
    after_o = o + (2 if cfg.biases else 1)
    rest = after_o + (2 if cfg.qk_norm else 0)
    made = [o <= i < after_o or i >= rest for i in range(len(block))]
    launched, whole = [], 0.0  # buckets launched; made gradients in buckets that are not
    for run in bucket_runs(block, layout, w):
        if all(made[i] for i in run):
            launched.append(sum(block[i] for i in run) * w)
        else:
            whole += sum(block[i] for i in run if made[i]) * w
    shard = dp_groups(layout, False)[0]
    flying = launched[-runtime.zero3_grads_in_flight :] if runtime.zero3_grads_in_flight else []
    g_bytes = runtime.state_bytes(layout.dtype)[1]
    done = (sum(launched) - sum(flying)) / shard
    return sum(flying) / shard + whole / w * g_bytes, done, sum(flying)


def zero3_head_unit_bytes(cfg: ModelConfig, layout: Layout, runtime: Runtime) -> float:
    """An untied head's ZeRO-3 unit, gathered: the final norm in the weights' dtype and
    the head's table (a linear's weight) in the gathered one."""
    e, w = runtime.param_comm_bytes(layout.dtype), runtime.state_bytes(layout.dtype)[0]
    return table_elements(cfg, layout) * e + sizes.final_norm_params(cfg) * w


def zero3_head_backward_moment(cfg: ModelConfig, layout: Layout,
                               runtime: Runtime) -> tuple[float, float, float, float]:  # fmt: skip
    """A ZeRO-3 last stage as its head's backward runs, every other activation of the
    micro-batch still held: (gradients, buffers, activations freed, temporaries), as
    ``zero3_backward_moments``. Gathered are the head's unit (``zero3_head_unit_bytes``)
    and, prefetched as the backward began, the last block, with the gather's input; the
    logits' gradient in the compute dtype held (the logits themselves went as the loss's
    forward returned: ``head_logits_bytes``). Two blocks
    are gathered only as the last block's backward starts, the head's activations gone
    by then; at the forward's end, only the head's unit. ``plait rehearse`` of LLaMA-2 7B
    dp 64 ZeRO-3 LoRA r16 (2026-11-28) peaked here, with 0.628 GiB of buffers (the head
    0.244, a block 0.377 and the gather's input) where the model had two blocks (0.760);
    LLaMA 3 8B at dp 8 with 2 x 1,002 MiB of logits and their gradient."""
    e = ACT_BYTES[layout.dtype]
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    logits = tokens * cfg.vocab_size / layout.tp * e if e < 4 else 0.0
    buffers = zero3_head_unit_bytes(cfg, layout, runtime) + zero3_gathered_bytes(
        cfg, layout, runtime) + gather_input_bytes(cfg, layout, runtime)  # fmt: skip
    return 0.0, buffers, 0.0, logits


def zero3_backward_moments(
    cfg: ModelConfig, layout: Layout, runtime: Runtime, layers: int, first: bool, last: bool
) -> list[tuple[float, float, float, float]]:
    """What a ZeRO-3 rank holds, beyond its shards and its activations' peak, as its last
    micro-batch's backward finishes each unit: (gradients, buffers, activations freed,
    temporaries). ``Runtime.zero3_grads_in_flight`` = k: each unit's backward packs its
    full gradient (fp32) for a reduce-scatter that writes this rank's shard of it, and
    packing one more first completes the oldest of the k in flight (plait's
    ``ReduceScatterGrads``). The buffers are those packed inputs, the next block gathered
    and the one after it being gathered (with the gather's input), none once the chunk's
    last block is done. Going down, the backward has freed the activations of the units
    behind it (on the last stage first the head's: its buffers and logits) and holds the
    next block's working set (``mlp_backward_working_set``, and a recomputing block's
    forward made again: "freed" is net of it) and that block's first weight gradient,
    its down projection's in the gathered dtype, whose input the gradient has consumed;
    then its up projection's, beside that projection's output gradient, its input's and
    the stream's, the MLP's saved tensors but the norm's output freed (``plait rehearse``
    of LLaMA-2 70B dp 64: 1.438 GiB of temporaries there, 2026-11-28).
    Or, as a block packs, its own weight gradients (the size of the gathered block) not
    yet let go, the block itself freed and only the next gathered, nothing of it begun.
    Under cp, also the next block's cp-attention backward: its MLP's and output
    projection's weight gradients made, the MLP's saved tensors freed, the attention's
    working set held (``context.backward_buffer_bytes``; a fused kernel's, without cp, is
    smaller than the MLP's and never leads). llama h 2048, --cp 2 --dp 2: 1.003 (ring),
    1.004 (allgather) of the model.
    The gradients are the reduce-scatters' outputs: in flight, and in a step of one
    micro-batch those completed (from the second micro-batch on the rows hold them:
    ``memory_per_rank`` adds them). An untied model's final norm and head are a unit of
    their own, the first to reduce on the last stage, and its embedding the last on the
    first; a tied model's head, norm and embedding are one unit, reduced at the end --
    where one rank holds both ends, gathered through the whole backward with the table's
    gradient from the head, and at the embedding's backward three fp32 tables at once
    (the head's gradient, the embedding's, their sum: ``tied_zero3_unit``).
    ``plait rehearse`` of LLaMA-2 7B dp 64 at one micro-batch held at its peak 0.103 GiB
    of gradients (the head's and the last block's shards in flight, the down projection's
    4096 x 11008 bf16 gradient) and 2.002 of buffers (the two packed, the two gathered
    blocks and the gather's input); a pipeline's first stage peaks as its chunk's
    backward ends, two packed blocks in flight and nothing gathered."""
    k = runtime.zero3_grads_in_flight
    shard = dp_groups(layout, False)[0]
    gathered, full = _zero3_parts(cfg, layout, runtime)
    gather_input = gather_input_bytes(cfg, layout, runtime)
    # a block recomputing (the chunk's first ``recomputed_blocks``) frees its checkpoint
    # and remakes its forward when its backward starts; the others free what they kept
    ckpt = chunk_activation_bytes(cfg, layout.recomputing_all(), runtime, 1, 0)[0]
    kept = chunk_activation_bytes(cfg, layout.without_recompute(), runtime, 1, 0)[0]
    again = recompute_transient(cfg, layout, runtime)
    redo = layout.recomputed_blocks(layers)
    work = mlp_backward_working_set(cfg, layout, runtime)
    down = cfg.ffn_hidden * cfg.hidden / layout.tp * runtime.param_comm_bytes(layout.dtype)
    # that projection's input, freed once its weight gradient is made (before the MLP's
    # working set is whole)
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    down_input = tokens * cfg.ffn_hidden / layout.tp * ACT_BYTES[layout.dtype]
    # the block's up projection (SwiGLU's fused gate and up), its weight gradient made:
    # the MLP's saved tensors but the norm's output freed (``sizes``' split part), and
    # held the weight gradient, the projection's output gradient, its input's gradient
    # and the stream's
    e, split = ACT_BYTES[layout.dtype], layout.tp if layout.sequence_parallel else 1
    up = (1 if cfg.arch == "gpt2" else 2) * cfg.ffn_hidden  # the MLP's entry width
    mlp_saved_bytes = tokens * (up + cfg.ffn_hidden) / layout.tp * e
    up_backward = (up * cfg.hidden / layout.tp * runtime.param_comm_bytes(layout.dtype)
                   + tokens * (up / layout.tp * e + cfg.hidden * e
                               + cfg.hidden / split * residual_bytes(layout)))  # fmt: skip
    g_bytes = runtime.state_bytes(layout.dtype)[1]
    table = table_elements(cfg, layout) * g_bytes  # a vocabulary table's gradient
    # (packed gradient, activations freed, forward remade as its backward starts, a block),
    # in backward order: the chunk's last block first
    units = [(full, ckpt, again, True) if b < redo else (full, kept, 0.0, True)
             for b in reversed(range(layers))]  # fmt: skip
    if last and units:
        head = last_stage_buffers(cfg, layout)
        if cfg.tied_embeddings:
            units[0] = (full, units[0][1] + head, units[0][2], True)
        else:
            units.insert(0, (table + cfg.hidden * g_bytes, head, 0.0, False))
    if units and cfg.tied_embeddings and (first or last):
        units.append((table + (cfg.hidden * g_bytes if last else 0.0), 0.0, 0.0, False))
    elif units and first:
        units.append((table, 0.0, 0.0, False))
    # a tied unit (``tied_zero3_unit``) stays gathered through the backward, and the
    # table's gradient from the head's backward waits with it for the embedding's
    tied = tied_zero3_unit(cfg, layout, runtime)[0] if units and first and last else 0.0
    w_bytes = runtime.state_bytes(layout.dtype)[0]
    tied_grad = table_elements(cfg, layout) * w_bytes if tied else 0.0
    attend = None  # a block's cp attention backward, its MLP's backward done
    if layout.cp > 1:
        flash = not cp_sim.math_attention(layout, runtime)
        working = cp_sim.backward_buffer_bytes(cfg, layout, flash)  # ring or allgather
        working += tokens * cfg.hidden / split * residual_bytes(layout)  # and the stream's
        made = (up + cfg.ffn_hidden + cfg.q_dim) * cfg.hidden / layout.tp  # MLP, output proj.
        # the MLP's saved tensors besides the down projection's input: its norm's input
        # and output (the entry's input) and the entry's output
        saved = tokens * (2 * cfg.hidden / split + up / layout.tp) * e
        attend = (made * runtime.param_comm_bytes(layout.dtype), saved, working)
    out, freed, landed = [], 0.0, 0.0
    for j, (_, act, _, _) in enumerate(units):
        freed += act
        flight = [f for f, _, _, _ in units[max(0, j - k + 1) : j + 1]]
        if j >= k and layout.num_microbatches == 1:
            landed += units[j - k][0] / shard  # completed: its shard written
        ahead = [u for u in units[j + 1 : j + 3] if u[3]]  # blocks gathered and gathering
        nxt = units[j + 1] if j + 1 < len(units) and units[j + 1][3] else None
        held = sum(flight) + len(ahead) * gathered + (gather_input if len(ahead) > 1 else 0.0)
        held += tied
        outputs = landed + sum(flight) / shard
        if first and j == len(units) - 1:  # the embedding's backward, before the unit
            # packs: the k units before it in flight, and the table's gradient -- tied, the
            # head's, the embedding's own and their sum; untied, the embedding's own beside
            # its unit, gathered for the backward in the weights' dtype
            done = units[j - k][0] / shard if j >= k and layout.num_microbatches == 1 else 0.0
            prev = [f for f, _, _, _ in units[max(0, j - k) : j]]
            if tied:
                out.append((landed - done + sum(prev) / shard, sum(prev) + tied, freed,
                            3 * tied_grad))  # fmt: skip
            elif not cfg.tied_embeddings:
                own = table_elements(cfg, layout) * w_bytes
                out.append((landed - done + sum(prev) / shard, sum(prev) + own, freed, own))
        if units[j][3]:  # as it packs: its own weight gradients not yet let go, itself
            # freed (its gradients all in), the next block gathered, not yet the one after
            out.append((outputs + gathered, sum(flight) + (gathered if nxt else 0.0) + tied,
                        freed, tied_grad))  # fmt: skip
        out.append((
            outputs + (down if nxt else 0.0),
            held,
            freed + (down_input - nxt[2] if nxt else 0.0),
            (work if nxt else 0.0) + tied_grad,
        ))  # fmt: skip
        if nxt:  # then its gate and up's (GPT-2: FC1's) weight gradient made, beside
            # their output's gradient, their input's and the stream's; the MLP's saved
            # tensors but their input freed
            out.append((outputs + down, held, freed + mlp_saved_bytes - nxt[2],
                        up_backward + tied_grad))  # fmt: skip
        if nxt and attend:
            made_g, mlp_saved, attn_work = attend
            out.append((outputs + made_g, held, freed + down_input + mlp_saved - nxt[2],
                        attn_work + tied_grad))  # fmt: skip
    return out


def cp_attention_moments(cfg: ModelConfig, layout: Layout, runtime: Runtime, bare: float,
                         grads: float, first: bool, last: bool, fresh: bool,
                         one: float | None, recomputes: bool, lora=None,
                         ) -> list[tuple[float, float, float, float]]:  # fmt: skip
    """ZeRO-0/1 under cp (and LoRA): where a rank's cp attention backward may peak. A backward's
    start and end run no exchange (the joint peak's ``Memory.cp_buffers`` is 0); its
    attention's backward does, after the block's MLP backward has freed the MLP's saved
    tensors and made its weight gradients (as ``zero3_backward_moments``' ``attend``), with
    ``context.backward_buffer_bytes`` and the residual stream's gradient held. First the
    rank's attention backward with its activations' peak in flight (its last chunk's
    last block: the head's buffers freed on the last stage, a recomputing block's
    forward made again; a stage short of the last holding its output's gradient,
    received from the next, beside the stream's). Where
    that is the rank's first backward (``fresh``: every forward in flight before it --
    one micro-batch, GPipe, 1F1B with no more micro-batches than the rank's warm-up)
    the gradients are made as it goes, and ``one`` (a micro-batch's activations of the
    rank's only chunk) gives its last attention backward too (the first block: every
    gradient made but that block's q, k, v and norm's, and the embedding's on the first
    stage; the other micro-batches' activations, and its first block's attention's
    saved tensors, held) and the next backward's first (every gradient made, one
    micro-batch fewer in flight). Otherwise an earlier backward has made every gradient.
    [(gradients, buffers, activations freed, temporaries)], as ``head_backward_moment``:
    the gradients beyond the state's rows (all of them from a step's second micro-batch
    on); ``bare`` is the rank's activations' peak and ``grads`` its gradients. ``plait
    rehearse`` of four llama blocks (h 2048, s 2048) at ``--cp 2``, one micro-batch,
    peaked in block 0's ring attention backward, 80 MiB of gradients short of the state
    (2026-11-29)."""
    if layout.cp == 1:
        return []
    t, e = layout.tp, ACT_BYTES[layout.dtype]
    g_bytes = runtime.state_bytes(layout.dtype)[1]
    split = t if layout.sequence_parallel else 1
    tokens = layout.micro_batch_size * cfg.seq_len // layout.cp
    up = (1 if cfg.arch == "gpt2" else 2) * cfg.ffn_hidden  # the MLP's entry width
    # the MLP's saved tensors: its norm's input and output, the entry's output, the down
    # projection's input; under LoRA (``lora``) but the inputs only a frozen linear's
    # weight gradient would need, and with each MLP adapter's rank-r product
    released = tokens * (2 * cfg.hidden / split + (up + cfg.ffn_hidden) / t) * e
    if lora is not None:
        targets = set(lora.targets)
        mlp = targets & {"up", "gate", "down"}
        released -= tokens * e * (0.0 if targets & {"up", "gate"} else cfg.hidden / split)
        released -= tokens * e * (0.0 if "down" in targets else cfg.ffn_hidden / t)
        released += tokens * e * lora.rank * len(mlp)
        fresh, one = False, None  # the adapters' gradients: a few MiB, taken as made
    # beside the exchange's working set, the residual stream's gradient
    work = cp_sim.backward_buffer_bytes(cfg, layout, not cp_sim.math_attention(layout, runtime))
    work += tokens * cfg.hidden / split * residual_bytes(layout)
    again = recompute_transient(cfg, layout, runtime) if recomputes else 0.0
    head = last_stage_buffers(cfg, layout) if last else 0.0
    table = table_elements(cfg, layout) * g_bytes
    waiting = waiting_table_grad(cfg, layout, runtime, first and last, lora)
    rows = grads if layout.num_microbatches > 1 else 0.0  # the state's, as the caller's
    # made by a first backward at its first attention: the head's and final norm's, the
    # block's MLP's, its norm's and its output projection's
    made = ((up + cfg.ffn_hidden + cfg.q_dim) * cfg.hidden / t + cfg.hidden) * g_bytes
    if last:
        made += (0.0 if waiting else table) + cfg.hidden * g_bytes
    received = 0.0 if last else boundary_bytes(cfg, layout)
    out = [((made if fresh else grads) - rows, 0.0, head - again + released,
            work + waiting + received)]  # fmt: skip
    if fresh and one is not None:
        kept = chunk_activation_bytes(cfg, layout.without_recompute(), runtime, 1, 0,
                                      first=first)[0]  # fmt: skip
        qkv = (cfg.q_dim / t + 2 * sizes.kv_width_per_rank(cfg, t)) * cfg.hidden + cfg.hidden
        # and on the first stage the embedding's: the table's, learned positions'
        embedding = table + (cfg.seq_len * cfg.hidden * g_bytes if cfg.arch == "gpt2" else 0.0)
        left = qkv * g_bytes + (embedding if first else 0.0)
        out.append((grads - left - rows, 0.0, one - kept + released,
                    work + waiting + received))  # fmt: skip
        if layout.num_microbatches > 1:  # the next backward's: every gradient made, one
            # micro-batch fewer in flight
            out.append((0.0, 0.0, one + out[0][2], work + waiting))
    return out
