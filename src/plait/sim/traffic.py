"""Bytes one rank's collectives move in a step, per axis, as ``comm.py`` counts them: the
byte side of the cost model's communication (``costs.py``, ``step.py``), which turns the
same quantities into seconds. ``plait rehearse`` holds these figures against the calls a
rehearsed rank actually issues.

Communication: none (a formula). Per micro-batch of T = b s / cp tokens (a cp rank's share), hidden h, e bytes per
activation element (``costs.ACT_BYTES``), t = tp, on a pipeline rank whose chunks hold
L_c layers:

- tp: per layer forward 2 all-reduces of T h e and backward 2 more of T h r, r the
  residual stream's bytes per element (``costs.residual_bytes``: e, or 4 under
  ``--fp32-residual``; the backward's input gradients are those of the norms' outputs);
  sequence parallelism: 2 all-gathers (T h r) and 2 reduce-scatters (T h e) forward, the
  reverse backward, plus the all-gather again (T h e) of each column group's saved input
  (two a block, one the head; ``regathered_groups`` under LoRA) --
  the blocks' not under ``--recompute full``, which repeats the forward's -- all but the
  MLP's exit (g, T h e): the recomputation stops at the last tensor the backward needs,
  the down projection's input (``torch.utils.checkpoint``'s early stop), unless dropout
  after the MLP saves its mask last (then the exit runs again too). The embedding's
  all-reduce (stage 0; T h r), the head's backward all-reduce (T h r) and the loss's
  12 T bytes (last stage), and with the scatter/gather the all-gather of every received
  pipeline message (T h e).
- pp: per boundary of a chunk and micro-batch, the activation out and its gradient back,
  T h e / t each (the scatter), send and receive both counted; with tied embeddings the
  first and last stages swap their copy's gradient once per step (V h 4 / t each way).
- dp: ZeRO 0 all-reduces the gradients (P g bytes, P this rank's parameters, g
  ``Runtime.grad_comm_bytes``); ZeRO 1 (plait: whole) / 2 (reduce-scatter: every
  micro-batch under ``zero2_reduce_per_microbatch``, plait's) and then all-gathers the
  updated weights; ZeRO 3 all-gathers every unit before its forward and its backward in
  every micro-batch (P w each, w ``Runtime.param_comm_bytes``) and reduce-scatters the
  gradients (every micro-batch, or once where the runtime accumulates them whole); HSDP
  adds the all-reduce of the summed shard across replicas, once a step.
- cp: per layer the exchanges of ``sim/context.py``'s ``layer_bytes`` (counted), forward
  and backward; ``--recompute full`` repeats the forward's. The gradients' dp traffic
  runs over dp x cp ranks (``costs.grad_ranks``) and counts on the dp axis, as
  ``Topology.grad_view`` counts it.
- ep: per MoE layer the dispatch of ``sim/expert.py``'s ``layer_bytes`` (balanced;
  counted), forward and backward; ``--recompute full`` repeats the forward's. Routed
  experts' gradients reduce over their edp group, counted on the dp axis.
- dp under ``--dp-algo`` / ``--compress`` (``dp_algo``, at optimizer step ``step``): the
  engine's own traffic inside a replica of K ranks (ZeRO over ``--zero-shard-group``;
  nothing at K = 1) and the algorithm's across replicas, ``dp_algos.volume.step_volume``
  of this rank's tensors (``sim/dp_algos.rank_shapes``, its shards at K > 1): a compressed
  gradient's codec in place of the all-reduce (ZeRO-1 still gathers the weights; ZeRO 2/3
  reduce-scatter inside the shard group first); local SGD's and DiLoCo's sync, gossip's
  sends and receives (after which ZeRO 1/2 over K > 1 ranks gather the weights, in place
  of the optimizer step's gather: ``DPAlgorithm.rewrites_shards``).
- world: the step's statistics, 8 (3 + R + W) bytes, R = 1 or the replicas where they
  differ, and a MoE model's routing table (``step.stats_bytes``).
"""

from __future__ import annotations

from plait.dp_algos.config import compress_group, replicas_of
from plait.layout import Layout
from plait.model import sizes
from plait.model.config import ModelConfig
from plait.sim import context as cp_sim
from plait.sim import expert as ep_sim
from plait.sim.costs import ACT_BYTES, dp_groups, grad_ranks, residual_bytes
from plait.sim.memory import chunk_blocks, stage_params
from plait.sim.runtime import Runtime
from plait.sim.step import stats_bytes


def lora_skipped_entries(lora) -> int:
    """Backward entries of the first block whose tp reduction a LoRA run never issues:
    below the first block nothing trains (the embedding is frozen), so autograd computes no
    gradient of its input -- the attention's entry (f's all-reduce, or sequence
    parallelism's reduce-scatter) is skipped whatever the targets, and the MLP's too when
    the block's attention has no adapter (nothing before the MLP then needs a gradient)."""
    return 1 if lora.adapts_attention else 2


def regathered_groups(lora, model: ModelConfig) -> tuple[int, int, int]:
    """(attention, MLP, MoE MLP): whether a block's column group (q, k, v; the MLP's first
    GEMMs; a MoE block's router and shared experts) saves its input for the backward,
    which sequence parallelism then all-gathers again (``tensor.keeping_shard``): where a
    weight or an adapter in it trains -- always without LoRA, and with it where
    ``--lora-targets`` names one of the group's layers. Under LoRA a MoE block's router is
    frozen and its routed experts read permuted rows, not the gathered input: only shared
    experts with an adapter on up or gate keep it."""
    if lora is None:
        return 1, 1, 1
    targets = set(lora.targets)
    mlp = int(bool(targets & {"up", "gate"}))
    return int(bool(targets & {"q", "k", "v"})), mlp, mlp * int(model.moe_shared_experts > 0)


def tp_sync_params(model: ModelConfig, layout: Layout, layers: int, moe_layers: int,
                   first: bool, last: bool) -> float:  # fmt: skip
    """Parameters of a virtual stage whose gradients ``tensor.TPGradSync`` sums over tp once
    a step (its R + K), on a tp rank of a run without LoRA: under sequence parallelism
    every tp-replicated one -- a block's two norms, its row-parallel biases (o and the
    MLP's second GEMM, with ``biases``), the query / key norms, GPT-2's learned positions
    (first stage), the final norm (last); without it, the query / key norms only; a MoE
    block's router (and GPT-2 experts' second bias: E / ep of them, and the shared experts'
    one) either way; and the key / value weights (and biases) wherever tp exceeds the
    key / value heads."""
    t, h = layout.tp, model.hidden
    if t == 1:
        return 0.0
    qk = 2 * model.head_dim if model.qk_norm else 0
    n = 0.0
    if layout.sequence_parallel:
        norm = 2 * h if model.biases else h  # LayerNorm's weight and bias, or RMSNorm's
        n += layers * (2 * norm + (2 * h if model.biases else 0) + qk)
        if model.biases:  # a MoE block has the experts' bias in place of the MLP's
            n -= moe_layers * h
        if first and model.arch == "gpt2":
            n += model.seq_len * h
        if last:
            n += sizes.final_norm_params(model)
    else:
        n += layers * qk
    if moe_layers:
        n += moe_layers * model.moe_experts * h  # the router
        if model.arch == "gpt2":  # the shared experts are one expert of S F columns
            shared = 1 if model.moe_shared_experts else 0
            n += moe_layers * (model.moe_experts // layout.ep + shared) * h
    if model.n_kv_heads < t:
        kv_bias = model.kv_dim if (model.biases or model.qkv_bias) else 0
        n += layers * 2 * (model.kv_dim * h + kv_bias)
    return n


def bytes_per_axis(
    model: ModelConfig, layout: Layout, runtime: Runtime, stage_layers: list[int], pp_rank: int,
    lora=None, dp_algo=None, step: int = 1,
) -> dict[str, float]:  # fmt: skip
    """Counted bytes per axis ("tp", "pp", "dp", "world") of one optimizer step on a rank
    of pipeline rank ``pp_rank`` (module docstring); axes of size 1 are left out. ``lora``
    (a ``LoRAConfig``): the base is frozen, so only the adapters' gradients are reduced
    (and, at ZeRO 1-2, their weights gathered); ZeRO-3 still gathers every weight."""
    p, v, m, t = layout.pp, layout.vpp, layout.num_microbatches, layout.tp
    S = p * v
    T, h, e = (
        layout.micro_batch_size * model.seq_len // layout.cp,
        model.hidden,
        ACT_BYTES[layout.dtype],
    )
    sp = layout.sequence_parallel and t > 1
    out: dict[str, float] = {}
    chunks = [(c * p + pp_rank, stage_layers[c * p + pp_rank]) for c in range(v)]
    if t > 1:
        r = residual_bytes(layout)
        fwd = 2 * T * h * (e + r if sp else e)  # f (sp: all-gathers, T h r) and g
        per_layer = fwd + 2 * T * h * (e + r if sp else r)  # backward: the same reversed
        # a recomputing block (``Layout.recomputed_blocks``) runs the forward again, up to
        # its last saved tensor (checkpoint's early stop: the MLP's exit is not, unless
        # dropout's mask after it is that tensor)
        again = fwd - (0.0 if model.dropout else T * h * e)
        # sequence parallelism: each column group's saved input gathered again (T h e)
        # by a block that does not recompute (one that does gathers it in its forward)
        attn_re, mlp_re, moe_re = regathered_groups(lora, model) if sp else (0, 0, 0)
        moe_at = ep_sim.stage_moe_layers(model, stage_layers)
        tp = 0.0
        for stage, layers in chunks:
            tp += layers * per_layer
            for recomputed, (dense, routed) in chunk_blocks(model, layout, stage_layers,
                                                             stage).items():  # fmt: skip
                if recomputed and layout.recompute == "full":
                    tp += (dense + routed) * again
                else:
                    tp += T * h * e * ((dense + routed) * attn_re + dense * mlp_re
                                       + routed * moe_re)  # fmt: skip
            if stage == S - 1 and sp and lora is None:  # the head's (frozen under LoRA)
                tp += T * h * e
            if stage == 0 and lora is not None and layers:
                tp -= T * h * r * (2 if sp else 1) * lora_skipped_entries(lora)
            if stage == 0:
                tp += T * h * r * (2 if sp else 1)  # the embedding's reduction
            if stage == S - 1:
                tp += T * h * r * (2 if sp else 1) + 12 * T  # the head's; the loss's
            if p > 1 and not sp:  # gathers of received slices
                tp += T * h * e * ((stage > 0) + (stage < S - 1))
        out["tp"] = m * tp
        if lora is not None:  # TPGradSync: each adapter's tp-replicated factor, fp32, once
            out["tp"] += 4 * _adapters(model, layout, lora, chunks, stage_layers).tp_partial
        else:  # TPGradSync: the replicated parameters' gradients, fp32, once
            out["tp"] += 4 * sum(
                tp_sync_params(model, layout, layers, moe_at[stage], stage == 0, stage == S - 1)
                for stage, layers in chunks
            )
    if p > 1:
        share = t
        messages = sum(2 * ((stage > 0) + (stage < S - 1)) for stage, _ in chunks)
        pp = m * messages * T * h * e / share
        if model.tied_embeddings and pp_rank in (0, p - 1):
            pp += 2 * model.vocab_size * h * 4 / t
        out["pp"] = pp
    if layout.cp > 1:
        nb = cp_sim.layer_bytes(model, layout)
        # recomputation (full, or selective's attention core) runs the exchange again
        # (under --recompute-layers the chunk's first blocks: ``memory.chunk_blocks``)
        again = sum(sum(chunk_blocks(model, layout, stage_layers, stage)[True])
                    for stage, _ in chunks) if layout.recompute != "none" else 0  # fmt: skip
        out["cp"] = m * (sum(layers for _, layers in chunks) * nb.counted
                         + again * nb.fwd_counted)  # fmt: skip
    moe_layers = sum(ep_sim.stage_moe_layers(model, stage_layers)[stage] for stage, _ in chunks)
    if layout.ep > 1 and moe_layers:  # the experts' dispatch (sim/expert.py), balanced
        nb = ep_sim.layer_bytes(model, layout, runtime.moe_imbalance)
        again = sum(chunk_blocks(model, layout, stage_layers, stage)[True][1]
                    for stage, _ in chunks) if layout.recompute == "full" else 0  # fmt: skip
        out["ep"] = m * (moe_layers * nb.counted + again * nb.fwd_counted)
        first = 0 in (stage for stage, _ in chunks) and model.is_moe_layer(0)
        if lora is not None and first and not lora.adapts_attention:
            # nothing below the first block trains: its dispatch's backward is never issued
            R = ep_sim.rows(model, layout, runtime.moe_imbalance)[1]
            out["ep"] -= m * R * model.hidden * ep_sim.act_bytes(layout)
    moe = ep_sim.stage_moe_layers(model, stage_layers)
    groups = [(sum(stage_params(model, layout, layers, stage == 0, stage == S - 1, moe[stage])
                   for stage, layers in chunks), False),
              (moe_layers * ep_sim.expert_params(model, layout), True)]  # fmt: skip
    if lora is not None:  # the adapters train: the dense ones over dp, the routed over edp
        held = _adapters(model, layout, lora, chunks, stage_layers)
        # ZeRO-3: the frozen embedding in a unit of its own (``zero_units``: untied, or a
        # first stage without the head) has no gradient to compute, so it is gathered for
        # its forward only
        alone = any(stage == 0 and (S > 1 or not model.tied_embeddings) for stage, _ in chunks)
        once = stage_params(model, layout, 0, True, False) if alone else 0.0
        dp = _dp_bytes(
            held.replicated, layout, runtime, False, gathered=groups[0][0] + held.replicated,
            forward_only=once,
        )  # fmt: skip
        dp += _dp_bytes(held.routed, layout, runtime, True, gathered=groups[1][0] + held.routed)
    elif dp_algo is not None and not dp_algo.plain:  # dense only (``RunConfig``'s checks)
        held = [(layers, stage == 0, stage == S - 1) for stage, layers in chunks]
        dp = _algo_dp_bytes(model, layout, runtime, dp_algo, held, groups[0][0], step)
    else:
        dp = sum(_dp_bytes(params, layout, runtime, experts) for params, experts in groups)
    if dp:
        out["dp"] = dp
    if layout.world_size > 1:
        differ = dp_algo is not None and dp_algo.replicas_differ
        out["world"] = stats_bytes(layout, model, replicas_of(layout)[0] if differ else 1)
    return out


def _group_layout(layout: Layout, k: int) -> Layout:
    """``layout`` as one group of k of its dp ranks sees it: the same micro-batches."""
    gbs = layout.global_batch_size * k // layout.dp
    return layout.replace(dp=k, zero_shard_group=None, global_batch_size=gbs)


def _algo_dp_bytes(model, layout, runtime, algo, held, params, step) -> float:
    """Counted dp bytes of optimizer step ``step`` under ``algo`` (module docstring) for
    a rank holding ``params`` weights in the chunks ``held`` ((layers, first, last))."""
    from plait.dp_algos import volume
    from plait.sim import dp_algos as sim_dp

    shapes = sim_dp.rank_shapes(model, layout, held, params)
    if algo.grad_codec is not None:
        n, k = compress_group(layout)
        if layout.zero >= 2:  # reduce-scatter (and gather) inside the shard group first
            inner = _dp_bytes(params, _group_layout(layout, k), runtime, False)
        elif layout.zero == 1:  # the sharded optimizer's gather of the updated weights
            inner = params * runtime.state_bytes(layout.dtype)[0]
        else:
            inner = 0.0
    else:
        n, k = replicas_of(layout)
        inner = _dp_bytes(params, _group_layout(layout, k), runtime, False)
    vol = volume.step_volume(algo, step=step, shapes=sim_dp.shard_shapes(shapes, k), n=n)
    return inner + sum(vol.counted.values())


def _adapters(model: ModelConfig, layout: Layout, lora, chunks, stage_layers):
    """``lora.stage_adapters`` of a pipeline rank's chunks."""
    from plait.model.lora import stage_adapters

    moe = ep_sim.stage_moe_layers(model, stage_layers)
    return stage_adapters(model, lora, tp=layout.tp, ep=layout.ep,
                          layers=sum(layers for _, layers in chunks),
                          moe_layers=sum(moe[stage] for stage, _ in chunks))  # fmt: skip


def _dp_bytes(params: float, layout: Layout, runtime: Runtime, experts: bool,
              gathered: float | None = None, forward_only: float = 0.0) -> float:  # fmt: skip
    """Counted dp bytes of one step for ``params`` trained weights (module docstring);
    ``experts``: routed experts over their edp group (a dp sub-group: counted on the dp
    axis); ``gathered``: the weights ZeRO-3 gathers, when more than those trained, of which
    ``forward_only`` are not gathered again for the backward."""
    gathered = params if gathered is None else gathered
    if grad_ranks(layout, experts) <= 1 or not gathered:  # (ZeRO-3 gathers frozen ones too)
        return 0.0
    m = layout.num_microbatches
    g = params * runtime.grad_comm_bytes(layout.dtype)
    shard, replicas = dp_groups(layout, experts)
    across = g / shard if replicas > 1 else 0.0
    if layout.zero == 0:
        return g
    if layout.zero in (1, 2):
        # the updated weights, in their stored dtype (``gather_in_compute_dtype`` is a
        # ZeRO-3 unit's: plait's stage 1-2 gather fp32 weights, as ``plait rehearse`` logs)
        gather = params * runtime.state_bytes(layout.dtype)[0]
        if layout.zero == 1 and runtime.zero1_all_reduce(layout.dtype):
            return g + gather
        reduces = m if layout.zero == 2 and runtime.zero2_reduce_per_microbatch else 1
        return reduces * g + across + gather
    w = runtime.param_comm_bytes(layout.dtype)
    reduces = m if runtime.zero3_reduce_per_microbatch else 1
    return m * (2 * gathered - forward_only) * w + reduces * g + across
