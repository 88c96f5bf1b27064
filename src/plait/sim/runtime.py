"""What the training software does, as far as time and memory go.

The cost model times *plait*'s runtime by default. Published runs used other software
whose documented behaviour differs in ways that change step time by several percent
(attention kernels, which communication overlaps compute, which dtype the gradients are
reduced in, whether mixed precision keeps fp32 master weights). Rather than fit those
differences away, each is a named, documented switch here; ``plait simulate --runtime``
picks a profile and ``--runs`` files may name one per row (see ``runs.py``).

- ``flash_attention``: fused attention (FlashAttention, cuDNN/TE, PyTorch SDPA): no
  s x s score matrix in device memory, causal blocks skipped, the backward recomputes
  the scores (2.5x the forward's FLOPs). Otherwise attention is two batched GEMMs plus
  a softmax that streams the s x s scores through memory, and stores them.
- ``cp_math_attention``: context-parallel attention (``--cp``) runs as math attention in
  fp32 over the blocks it computes, scores materialised block by block; otherwise as
  fused kernels returning their log-sum-exp (Transformer Engine's ring attention, and
  ``parallel/context.py`` on CUDA's flash / memory-efficient kernels).
  ``cp_document_math``: only document-masked cp blocks (``--document-mask``) run math
  attention (plait: a document mask is a tensor of its own, which the LSE-returning
  kernels do not take). ``sim/context.py`` prices both (``math_attention``).
- ``attention_native``: the fused attention kernels are the device's newest generation
  (Transformer Engine's cuDNN attention, FlashAttention-3 on Hopper) rather than
  FlashAttention-2's (``Efficiency.attention_native``).
- ``overlap_grad_reduce``: the data-parallel gradient reduction runs bucket by bucket
  during the last micro-batch's backward (PyTorch DDP, Megatron-Core
  ``--overlap-grad-reduce``); otherwise after the rank's last backward.
- ``overlap_param_gather``: ZeRO parameter all-gathers are prefetched behind compute
  (FSDP; Megatron-Core ``--overlap-param-gather``); otherwise they are exposed.
- ``overlap_tp_comm``: with sequence parallelism, tensor-parallel all-gathers and
  reduce-scatters are pipelined with the GEMM next to them (Megatron-Core
  ``--tp-comm-overlap``): only the part longer than that GEMM is exposed.
- ``overlap_tp_grad``: the backward's tensor-parallel collectives of a column-parallel
  linear (qkv, up) run asynchronously beside its GEMMs (Megatron-LM from September 2021,
  ``LinearWithGradAccumulationAndAsyncCommunication``, on unless
  ``--no-async-tensor-model-parallel-allreduce``): the input gradient's all-reduce beside
  the weight-gradient GEMM; with sequence parallelism the input's re-gather beside the
  input-gradient GEMM and the input gradient's reduce-scatter beside the weight-gradient
  GEMM. The row-parallel linears' backward gathers stay exposed.
- ``prefetch_sp_regather``: with sequence parallelism, each column group's input, kept as
  the shard, is all-gathered again asynchronously when the backward reaches the group's
  row-parallel exit (plait: ``tensor._SavedShard.prefetch_from``), hidden behind that
  layer's GEMMs and the attention core's backward (the MLP: the down projection's); else
  issued when the first op needs it, exposed.
- ``grad_bucket_bytes``: gradients are reduced in buckets of this size, each leaving
  once the backward has filled it (PyTorch DDP and plait: 25 MiB; Megatron-Core: 40M
  parameters); ``None``: one bucket per layer (FSDP's per-layer units). A model smaller
  than one bucket gets no overlap at all. ``bucket_from_layout``: the layout's
  ``bucket_mb`` (``--bucket-mb``) sets it instead (plait).
- ``master_weights``: mixed precision keeps low-precision weights plus an fp32 master
  copy in the optimizer (Megatron: 2 + 4 + 12 bytes per parameter). plait instead keeps
  fp32 weights and gradients and autocasts (4 + 4 + 8).
- ``grad_reduce_fp32``: gradients are accumulated and reduced in fp32.
- ``zero1_grad_all_reduce``: ZeRO stage 1 all-reduces whole gradients, as ZeRO-0 does,
  and each rank updates its shard from them (plait: stage 1 shards only the optimizer
  state); otherwise stage 1 reduce-scatters them as stage 2 does.
- ``deepspeed_optimizer``: DeepSpeed's mixed-precision optimizers (2022). Under bf16 its
  BF16Optimizer: after every micro-batch's backward, ``update_hp_grads`` casts each
  weight's bf16 gradient to fp32 and adds it to the fp32 gradient (2 + 4, then 4 + 4 + 4
  bytes a weight: ``costs.weight_stream_bytes``), and whole fp32 gradients are all-reduced
  (``grad_reduce_fp32``, ``zero1_grad_all_reduce``). Under fp16 its ZeRO fp16 optimizer:
  autograd accumulates the fp16 ``.grad`` (2 + 2 + 2 bytes a weight from the second
  micro-batch on) and each rank's partition of the fp16 gradients is reduced to it
  (``average_tensor``: a reduce-scatter's traffic), so neither flag holds.
- ``grad_predivide``: before each micro-batch's reduce-scatter FSDP1 divides the whole
  unsharded gradient by about the square root of the data-parallel size, in the reduce
  dtype (``_reduce_grad``: ``_div_if_needed(padded_unsharded_grad,
  _gradient_predivide_factor)``, a pass of 4 + 4 bytes a weight in fp32); FSDP2 leaves
  fp32 and bf16 averaging to NCCL's AVG (``_get_gradient_divide_factors``: "to avoid
  separate div kernels").
- ``zero3_gather_per_tensor``: ZeRO-3 issues one all-gather (and one reduce-scatter) per
  parameter tensor, each paying the ring's latency, instead of one per layer (FSDP's
  flat parameter per wrapped block, plait's per unit). DeepSpeed's ZeRO-3 (2021,
  ``partition_parameters.py``: ``_allgather_param`` / ``_allgather_params_coalesced``
  launch a ``dist.all_gather`` per parameter).
- ``gather_list_outputs``: those gathers write a list of one output per rank (DeepSpeed's
  ``dist.all_gather(partitions, ...)`` into narrow views of a flat buffer, before
  ``all_gather_into_tensor`` existed): the backend copies each rank's shard out
  separately, one kernel per rank launched by the host (``Hardware.kernel_launch``).
- ``zero3_regather_recompute``: with full recomputation, the recomputed forward of a
  layer gathers its parameters again (DeepSpeed's hooks release them after every
  forward; FSDP's pre-backward unshard already holds them when the recomputation runs).
- ``gather_in_compute_dtype``: ZeRO-3 gathers weights in the compute dtype under
  bf16 / fp16 (plait, FSDP2's mixed-precision policy: half the bytes) while the fp32
  masters stay sharded; otherwise in the stored weights' dtype.
- ``gather_copy_out``: a ZeRO-3 all-gather lands rank-major in one buffer and each
  parameter is then copied out of it into its own tensor, on the compute stream (plait:
  ``FlatLayout.unpack``; FSDP2: ``foreach_all_gather_copy_out``'s
  ``split_with_sizes_copy``): 2 x the gathered dtype's bytes a weight, at each of a
  micro-batch's two gathers (forward, backward). FSDP1 gathers its flat parameter in
  place, and its parameters are views of it.
- ``zero3_in_place_alone``: a ZeRO-3 shard group of one rank (the routed experts' edp
  group at ep == dp) gathering in the stored dtype keeps its parameters where they are
  stored, with no gathered copy (plait: ``zero_units.Unit.resident``).
- ``weight_cast_per_step``: under bf16 / fp16 with fp32 weights (``master_weights``
  off), each linear layer's weight is cast to the compute dtype once a step and the copy
  held from its first forward to its last backward (plait's ``tensor.weight_casts``:
  ``Memory.weight_casts``; ``plait rehearse`` finds it among the activations, made in
  a forward); ZeRO-3 gathers in the compute dtype instead (its buffers).
- ``zero3_reduce_per_microbatch``: ZeRO-3 reduce-scatters each layer's gradients in every
  micro-batch's backward (DeepSpeed, FSDP, plait); without it, a runtime accumulates them
  unsharded (the whole model's gradient on every rank) and reduce-scatters in the last
  micro-batch only (plait did until 2026-11-27).
- ``zero2_reduce_per_microbatch``: ZeRO-2 does the same, its reduce-scatter priced in
  each layer's backward (``costs.zero_layer_comm``) and the HSDP sum across replicas once
  a step (plait). Without it (the other profiles, as fitted) the reduce-scatter is priced
  once, in the last micro-batch's backward.
- ``unfused_fp32_loss``: the loss casts the logits to fp32 and runs Megatron's
  vocab-parallel cross entropy as separate passes (max, subtract, exp, sum, divide;
  backward: multiply, cast back), 52 bytes a bf16 logit instead of a fused kernel's 16
  (``costs.loss_bytes_per_logit``): Megatron-LM, Megatron-DeepSpeed and Megatron-Core
  without ``--cross-entropy-loss-fusion`` (``fp16_lm_cross_entropy`` off, the default,
  upcasts).
- ``zb_autograd_split``: a zero-bubble schedule's W is autograd's, restarted on the
  retained graph from where each weight's branch joins the input path down to the
  weights (plait's ``executor.backward_input``): it keeps, besides each linear's input
  and output gradient (Qi et al. 2023's W; Megatron's weight-gradient store), each
  norm's, and BI lets go of every other saved tensor (``SavedBoxes``) only as it ends;
  the first stage, with no input gradient to make, runs its whole backward as W, its
  micro-batches whole until then.
- ``zero3_grads_in_flight``: k > 0, ZeRO-3 packs each layer's full gradient as its
  backward ends and keeps up to k of them awaiting their reduce-scatters (plait's
  ``ReduceScatterGrads``: 2); its backward then peaks k blocks in (``memory.py``). 0: one
  layer's gradient is counted beside the gathered layers (the other profiles, as fitted).
- ``layer_kernels``: how the software writes a block's memory-bound work (norms,
  activations, rotary, residual adds, casts), which sets the bytes it streams
  (``costs.stream_bytes``): "fused" (Megatron, Transformer Engine: one kernel per
  operation), "eager" (PyTorch modules: torchtitan's and llm-foundry's layers, counted
  from their code), "plait" (plait's own blocks, counted from its code).
- ``adamw_bytes``: bytes a parameter AdamW's update streams (weight, gradient, both
  moments), counted with ``StreamBytes`` on PyTorch's code: 28 for a fused kernel (apex's
  FusedAdam in Megatron and DeepSpeed, PyTorch's ``fused=True`` in plait), 56 for
  PyTorch's foreach AdamW with weight decay (torchtitan's ``foreach=True``; IBM's fms-fsdp
  takes the same default), 84 for a per-parameter loop of unfused operations (Composer's
  2023 ``DecoupledAdamW``, llm-foundry's optimizer).
- ``recompute_stops_early``: full recomputation ends at the block's last saved tensor
  (PyTorch's non-reentrant ``torch.utils.checkpoint`` from 2.1, where early stopping is
  the default: pytorch/pytorch#96866). A dense block saves nothing after the input of
  its MLP's down projection, which autograd packs before that GEMM runs, so the
  recomputed forward stops there: the down projection, its tensor-parallel exit and the
  residual add are not run again (about a third of the MLP's FLOPs; checked with
  ``FlopCounterMode`` on plait's blocks, ``tests/test_sim.py``). A MoE block's routed
  experts all run again (their combine saves their outputs), its shared experts' down
  GEMM and the exit do not; with dropout after the MLP (its mask saved last) the whole
  forward runs again. Megatron's and DeepSpeed's reentrant checkpointing, and PyTorch before
  2.1, run the whole forward again.
- ``moe_imbalance``: not the software but the run's routing, priced here because every
  cost function reads the runtime: the most-loaded expert's tokens over the mean
  (``sim/expert.py``; ``simulate(moe_imbalance=)``, ``--moe-imbalance``). 1.0, a balanced
  router, by default.
- ``qat``: not the software but the run's ``--qat``, likewise: the blocks' linear weights
  are fake-quantised, and a step keeps one quantised copy of each in the weights' dtype
  under fp32 (``tensor._StepQuant``; under bf16 / fp16 the compute-dtype copy the step
  keeps anyway, ``weight_cast_per_step``; under ZeRO-3 none, ``tensor.quantised_linear``).
- ``grad_codec``: the run's ``--compress`` gradient codec, likewise (``simulate`` and
  ``plait rehearse`` set it from the run): its messages and working set as the backward
  launches a bucket (``memory.codec_launch_moments``, ``sim/dp_algos.codec_buffers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Runtime:
    name: str
    flash_attention: bool = True
    attention_native: bool = False
    cp_math_attention: bool = False
    cp_document_math: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    overlap_tp_comm: bool = False
    overlap_tp_grad: bool = False
    prefetch_sp_regather: bool = False
    grad_bucket_bytes: float | None = 25 * 2**20
    bucket_from_layout: bool = False
    master_weights: bool = False
    grad_reduce_fp32: bool = True
    zero1_grad_all_reduce: bool = False
    deepspeed_optimizer: bool = False
    grad_predivide: bool = False
    zero3_gather_per_tensor: bool = False
    gather_list_outputs: bool = False
    zero3_regather_recompute: bool = False
    zero3_reduce_per_microbatch: bool = True
    zero2_reduce_per_microbatch: bool = False
    zero3_in_place_alone: bool = False
    gather_copy_out: bool = False
    gather_in_compute_dtype: bool = False
    weight_cast_per_step: bool = False
    unfused_fp32_loss: bool = False
    layer_kernels: str = "fused"
    zb_autograd_split: bool = False
    zero3_grads_in_flight: int = 0
    adamw_bytes: int = 28
    recompute_stops_early: bool = False
    moe_imbalance: float = 1.0  # a property of the run: sim/expert.py
    qat: bool = False  # a property of the run too: --qat (memory.weight_cast_bytes)
    # and --compress's gradient codec, (name, argument): its buffers in the backward
    # (memory.codec_launch_moments)
    grad_codec: tuple | None = None
    description: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.layer_kernels not in ("fused", "eager", "plait"):
            raise ValueError(f"runtime {self.name}: layer_kernels must be fused, eager or plait")

    def grads_fp32(self, dtype: str) -> bool:
        """Gradients accumulated and reduced in fp32 under ``dtype`` (``grad_reduce_fp32``,
        except DeepSpeed's fp16 optimizer: ``deepspeed_optimizer``)."""
        return self.grad_reduce_fp32 and not (self.deepspeed_optimizer and dtype == "fp16")

    def zero1_all_reduce(self, dtype: str) -> bool:
        """ZeRO-1 all-reduces whole gradients under ``dtype`` (``zero1_grad_all_reduce``,
        except DeepSpeed's fp16 ZeRO optimizer, which reduces each rank's partition)."""
        return self.zero1_grad_all_reduce and not (self.deepspeed_optimizer and dtype == "fp16")

    def state_bytes(self, dtype: str) -> tuple[int, int, int]:
        """Bytes per parameter of (weights, gradients, optimizer state) with AdamW."""
        if dtype == "fp32" or not self.master_weights:
            return 4, 4, 8
        return 2, (4 if self.grads_fp32(dtype) else 2), 12

    def grad_comm_bytes(self, dtype: str) -> int:
        """Bytes per gradient element on the wire in the data-parallel reduction."""
        if dtype == "fp32" or self.grads_fp32(dtype):
            return 4
        return 2

    def param_comm_bytes(self, dtype: str) -> int:
        """Bytes per weight element in ZeRO all-gathers: the stored weights' dtype, or the
        compute dtype where the runtime gathers in it (``gather_in_compute_dtype``)."""
        if dtype != "fp32" and self.gather_in_compute_dtype:
            return 2
        return self.state_bytes(dtype)[0]


_MEGATRON_2021 = Runtime(
    name="megatron-lm",
    unfused_fp32_loss=True,
    flash_attention=False,
    overlap_grad_reduce=False,
    master_weights=True,
    grad_reduce_fp32=False,
    description="Megatron-LM 2021 (Narayanan et al. SC21): fused softmax, gradient "
    "all-reduce after the pipeline flush, fp16 grads, fp32 master weights",
)

_FSDP1 = Runtime(
    name="fsdp",
    flash_attention=True,
    overlap_grad_reduce=True,
    overlap_param_gather=True,
    grad_bucket_bytes=None,
    master_weights=False,
    grad_reduce_fp32=True,
    gather_in_compute_dtype=True,
    grad_predivide=True,
    layer_kernels="eager",
    adamw_bytes=84,
    recompute_stops_early=True,  # checkpoint_wrapper(NO_REENTRANT) on PyTorch >= 2.1
    description="PyTorch FSDP1 (FullyShardedDataParallel; llm-foundry, IBM's fms-fsdp): "
    "FlashAttention, prefetched all-gathers in the compute dtype, sharded fp32 weights, "
    "fp32 reduce-scatter (Composer's DEFAULT mixed precision) after a division pass, "
    "non-reentrant activation checkpointing that stops early (PyTorch >= 2.1)",
)

PROFILES: dict[str, Runtime] = {
    "plait": Runtime(
        name="plait",
        # PyTorch's SDPA ran cuDNN's Hopper attention (``cudnn_generated_fort_native_sdpa_sm90
        # _flash_*``) in plait's step on an H200: measured 23.2 ms for the 1B step, priced
        # 34.0 at FlashAttention-2's efficiency, 20.4 at the native one (RESULTS.md)
        attention_native=True,
        cp_document_math=True,
        zero1_grad_all_reduce=True,
        zero2_reduce_per_microbatch=True,
        zero3_in_place_alone=True,
        gather_copy_out=True,
        gather_in_compute_dtype=True,
        weight_cast_per_step=True,
        bucket_from_layout=True,
        prefetch_sp_regather=True,
        recompute_stops_early=True,  # Block.forward: checkpoint(use_reentrant=False)
        layer_kernels="plait",
        zb_autograd_split=True,
        zero3_grads_in_flight=2,  # ReduceScatterGrads.in_flight
        description="plait: SDPA attention, fp32 weights/grads under autocast, DDP-style "
        "bucketed reduction overlapped with backward",
    ),
    "megatron-lm": _MEGATRON_2021,
    "megatron-lm-2022": dataclasses.replace(
        _MEGATRON_2021,
        name="megatron-lm-2022",
        overlap_tp_grad=True,
        description="Megatron-LM 2022 (Korthikanti et al.): as 2021, with sequence "
        "parallelism, selective recomputation and the backward's tensor-parallel "
        "collectives beside the GEMMs (async all-reduce / reduce-scatter)",
    ),
    "megatron-deepspeed": Runtime(
        name="megatron-deepspeed",
        unfused_fp32_loss=True,
        flash_attention=False,
        overlap_grad_reduce=False,
        master_weights=True,
        grad_reduce_fp32=True,
        zero1_grad_all_reduce=True,
        deepspeed_optimizer=True,
        description="Megatron-DeepSpeed 2022 (BLOOM): fused softmax, ZeRO-1 BF16Optimizer "
        "with fp32 gradient accumulation all-reduced whole after the pipeline flush",
    ),
    "deepspeed-zero3": Runtime(
        name="deepspeed-zero3",
        flash_attention=False,
        overlap_grad_reduce=False,
        master_weights=True,
        grad_reduce_fp32=False,
        zero3_gather_per_tensor=True,
        gather_list_outputs=True,
        zero3_regather_recompute=True,
        description="DeepSpeed ZeRO-3 (2021, the baseline of Narayanan et al. SC21): one "
        "all-gather per parameter tensor into a list of per-rank outputs, again for the "
        "recomputed forward, fp16 gradients reduce-scattered per micro-batch",
    ),
    "megatron-core": Runtime(
        name="megatron-core",
        unfused_fp32_loss=True,
        flash_attention=True,
        attention_native=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        overlap_tp_comm=True,
        grad_bucket_bytes=40e6 * 4,
        master_weights=True,
        grad_reduce_fp32=True,
        description="Megatron-Core 2024 with Transformer Engine: fused attention, "
        "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap",
    ),
    "fsdp": _FSDP1,
    "fms-fsdp": dataclasses.replace(
        _FSDP1,
        name="fms-fsdp",
        grad_reduce_fp32=False,
        adamw_bytes=56,
        description="IBM's fms-fsdp (2024-02, the code of its 2024-03 blog's table): FSDP1 "
        "under its bfSixteen policy (weights gathered and gradients reduced in bf16), "
        "PyTorch's default foreach AdamW, non-reentrant checkpointing that stops early",
    ),
    "fsdp-torch2.0": dataclasses.replace(
        _FSDP1,
        name="fsdp-torch2.0",
        recompute_stops_early=False,
        description="PyTorch FSDP1 on PyTorch 2.0 or older (llm-foundry's 2023 tables): as "
        "fsdp, with the whole block's forward recomputed (no early stop before 2.1)",
    ),
    "fsdp2": dataclasses.replace(
        _FSDP1,
        name="fsdp2",
        grad_predivide=False,
        gather_copy_out=True,
        adamw_bytes=56,
        description="PyTorch FSDP2 (fully_shard; torchtitan): as FSDP1, with fp32 "
        "gradient averaging left to NCCL (no division pass)",
    ),
}

DEFAULT_RUNTIME = "plait"


def get_runtime(name: str) -> Runtime:
    if name not in PROFILES:
        raise ValueError(f"--runtime {name!r} is unknown; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]
