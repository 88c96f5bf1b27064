"""The training loop: a ``Trainer`` that is built, restored and stepped, and ``train``,
which drives it from the first step to the last.

``Trainer.build``: topology -> data -> model -> parallelize -> optimizer -> runner.
``Trainer.restore``: the newest checkpoint, when resuming. ``Trainer.step``: one optimizer
step, top to bottom (forward/backward over micro-batches, gradient sync, global norm,
then ``update``: clip and step), returning its metrics record. ``evaluate`` and ``save``
are the other two things a run does. Keeping the parallel state in one object means a
failure handler can build it again on a new ``Topology`` instead of ending the process
(``plait.resilience``): given a ``Part`` -- the layout of this rank's own pipeline, the
rows of each global batch it takes, and the engine that synchronises pipelines that
differ -- ``build`` places the rank in such a run; without one it reads ``cfg.layout``.

Runs inside every worker process (``plait.train.worker``); the launcher has already
validated the config and prepared the data, so errors here are unexpected ones.

GPU notes. Every tensor the step hands to a collective lives on ``topo.device``: the
micro-batch losses are summed on the device and read, with the squared gradient norm, the
bubble and every rank's peak memory, in one all-reduce per step (``_reduce_stats``), which
is the step's only host synchronisation (nothing calls ``torch.cuda.synchronize``: the
pipeline's bubble is read from CUDA events that sync has completed, a step late, and
ZeRO-Offload waits on one event for the gradients it copies to the host). The collectives of a step come in the same order
on every rank: the runner's (tensor- and pipeline-parallel, MoE dispatch's all-to-alls over
the ep group and, under cp, each MoE layer's routing-statistics all-reduce over the ring, and the
data-parallel hooks -- ZeRO-3's gathers in forward and backward, the gradient reductions in
backward order: under --ep, the dense engine's over dp before the experts' over edp,
``parallel/expert_engine.py``), then ``TPGradSync``, the engine's ``finish``, the statistics all-reduce,
the engine's step, and (MoE with ``moe_bias_rate``) the expert-load all-reduce over dp. On CUDA, fp32 matmuls use TF32 and AdamW is fused.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from plait import comm, dp_algos
from plait.data import IGNORE_INDEX, inputs_targets, model_kwargs, prepare, train_sampler, val_set
from plait.dp_algos.algorithm import ResumeError
from plait.layout import Layout
from plait.model import lora, moe, quant
from plait.model.sizes import model_flops_per_token
from plait.model.transformer import build_model, compile_blocks, hollow
from plait.parallel import expert_engine as expert
from plait.parallel.context import document_ids, shard
from plait.parallel.engine import DataParallelConfig, build_data_parallel
from plait.parallel.held import Held
from plait.parallel.pipeline.executor import PipelineRunner
from plait.parallel.pipeline.stage import build_stage
from plait.parallel.tensor import TPGradSync, weight_casts
from plait.topology import Axis, Topology
from plait.train import checkpoint, optim
from plait.train.config import RunConfig
from plait.train.metrics import (
    MetricsWriter,
    Progress,
    alloc_retries,
    peak_memory_bytes,
    peak_tflops,
    source_tokens,
    write_rank_summary,
)

log = logging.getLogger("plait.train")


class LocalRunner:
    """Runs the micro-batches of one step on a model held whole by this rank (pp == 1)."""

    def __init__(self, model, *, autocast):
        self.model, self.autocast = model, autocast

    def train_step(self, micro_batches, *, loss_scale: float, tokens_global: int):
        """Forward and backward over the micro-batches; gradients accumulate in ``.grad``.
        Returns this rank's share of the global mean loss, a float64 scalar on the device
        (summed there: reading it per micro-batch would stall the host)."""
        device = inputs_targets(micro_batches[0])[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        with weight_casts():  # one compute-dtype copy of each weight for the step
            for mb in micro_batches:  # (B, T+1) windows, or (inputs, targets) (B, T) each
                with self.autocast():
                    token_loss = self.model(*inputs_targets(mb), **model_kwargs(mb))  # (B*T,)
                loss = token_loss.sum() / tokens_global
                (loss * loss_scale).backward()
                total += loss.detach()
        return total

    @torch.no_grad()
    def eval_step(self, micro_batches, *, tokens_global: int):
        device = inputs_targets(micro_batches[0])[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for mb in micro_batches:
            with self.autocast():
                total += self.model(*inputs_targets(mb), **model_kwargs(mb)).sum() / tokens_global
        return total


def autocast_factory(dtype: str, device: torch.device):
    """A context-manager factory: autocast to ``dtype`` (bf16 / fp16), or nothing (fp32)."""
    if dtype == "fp32":
        return contextlib.nullcontext
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=torch_dtype)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on ``device``. To a GPU through pinned host memory and a copy that
    does not wait for the kernels queued before it: a copy from pageable memory makes the
    host wait for the GPU to drain (the previous step's update), one host sync per tensor
    (measured on an H200: five syncs a step before, ``tests/test_cuda.py``)."""
    from torch._subclasses.fake_tensor import is_fake

    if device.type != "cuda" or t.device.type != "cpu" or is_fake(t):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _split(batch, micro_batch_size: int) -> list:
    """Micro-batches of rows (B, T+1), or of an (inputs, targets) pair."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(micro_batch_size))
    return list(zip(*(t.split(micro_batch_size) for t in batch)))


def context_shard(micro_batches: list, *, cp: int, cp_rank: int, eot: int | None) -> list:
    """What one cp rank feeds the model (``parallel/context.py``): each micro-batch as
    (inputs, targets) of its two head-tail chunks of every sequence, and with ``eot`` (not
    None: --document-mask) the document ids (B, s) of the whole sequences, which every cp
    rank computes from the same rows. Unchanged when neither applies."""
    if cp == 1 and eot is None:
        return micro_batches
    out = []
    for mb in micro_batches:
        inputs, targets = inputs_targets(mb)
        docs = () if eot is None else (document_ids(inputs, eot),)
        if cp > 1:
            inputs, targets = (shard(t, cp=cp, index=cp_rank, dim=1) for t in (inputs, targets))
        out.append((inputs, targets, *docs))
    return out


@dataclass(frozen=True, kw_only=True)
class Part:
    """This rank's part of a run whose pipelines differ (``plait.resilience``): its own
    pipeline's ``layout`` (stages, micro-batches; dp 1), the rows [lo, hi) of every
    global batch that pipeline takes, and ``make_engine``, called as
    ``build_data_parallel`` is. The run's global batch (``cfg.layout``) still sets the
    sampler and the loss's denominator, so any split of the rows gives the same step."""

    layout: Layout
    rows: tuple[int, int]
    make_engine: Callable


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """A step's statistics once reduced over every rank: what its update needs, what its
    record reports, and what a worker that leaves a generation hands the coordinator
    (``plait.resilience`` rolls a step forward when they came back)."""

    step: int  # the optimizer step they belong to, from 0
    grad_sq_sum: float  # |g|^2 of the (loss-scaled) gradient; each replica's own if they differ
    loss: float  # mean token loss over the global batch
    bubble_fraction: float = 0.0  # measured pipeline bubble, averaged over ranks
    peak_mem_bytes: int = 0  # the largest rank's peak memory up to these statistics
    alloc_retries: int = 0  # CUDA allocator cache flushes this step, summed over ranks

    def to_json(self) -> dict:
        return {"step": self.step, "grad_sq_sum": self.grad_sq_sum, "loss": self.loss}

    @classmethod
    def from_json(cls, d: dict) -> StepStats:
        return cls(step=int(d["step"]), grad_sq_sum=float(d["grad_sq_sum"]), loss=float(d["loss"]))


def record_of(stats: StepStats, *, lr: float, tokens: int, grad_norm: float | None = None) -> dict:
    """The fields every ``metrics.jsonl`` record of step ``stats.step`` starts with (the
    README lists them all); ``grad_norm`` defaults to the statistics' own (no loss scale)."""
    if grad_norm is None:
        grad_norm = math.sqrt(stats.grad_sq_sum)
    return {
        "step": stats.step + 1,
        "loss": stats.loss,
        "lr": lr,
        "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
        "tokens": tokens,
    }


class Trainer:
    """One worker's share of a run (module docstring)."""

    def __init__(self, cfg: RunConfig, *, topo: Topology, part: Part | None = None):
        self.cfg = cfg
        self.build(topo, part=part)

    # -- build ---------------------------------------------------------------------------

    def placed(self) -> None:
        """Called by ``build`` once the model is on the rank's device: what the build made
        before (the parameters' initialisation on the CPU) was host memory. A hook for
        ``plait rehearse``, whose fake tensors all live on one device."""

    def build(self, topo: Topology, *, part: Part | None = None) -> None:
        """Data, model, parallel engines and runner for this worker's place in ``topo``
        (and in ``part``, when the run's pipelines differ: module docstring)."""
        cfg, model_cfg, tcfg = self.cfg, self.cfg.model, self.cfg.train
        layout = part.layout if part is not None else cfg.layout
        self.topo, self.layout, self.part = topo, layout, part
        self._reduced: StepStats | None = None  # the newest step's, once reduced
        self._alloc_retries_seen = 0  # the allocator's count at the last statistics
        self._told_alloc_retries = False
        self.out = Path(cfg.out)
        torch.manual_seed(tcfg.seed)
        if topo.device.type == "cuda":  # fp32 matmuls on tensor cores (TF32)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        self.sampler, self.val_set = self.open_data()
        # --document-mask: attention stops at the tokenizer's end-of-text id
        self.eot = getattr(self, "eot_id", None) if layout.document_mask else None

        # model and its parallel wrapping. ZeRO-3 builds it on meta: the engine makes each
        # parameter's shard from its initial value, one parameter at a time (a 70B model at
        # dp 64 never holds 280 GB on a rank; MoE too: its routing state is built on the
        # CPU, moved by ``hollow``) -- a seeded one, or --init-hf's tensor read when asked
        # for (``hf.defer_into``), LoRA's factors alike; QAT's fake quantisation holds no
        # weight of its own, whatever the build.
        meta = layout.zero == 3
        device = "meta" if meta else "cpu"
        # --ep: the MoE layers' experts split over ep groups carved out of dp, their
        # gradients reduced over the expert-data-parallel group (parallel/expert_engine.py)
        ep, edp_topo = None, None
        if layout.ep > 1:  # collective over the world: every rank, before any other group
            # carved out of dp x cp (grad_view): the cp ranks of a replica hold the same
            # experts' share as its dp ranks would, and their gradients reduce together
            ep_topo, edp_topo = expert.ep_groups(topo.grad_view(), layout.ep)
            ep = (ep_topo, Axis.DP)
        if layout.pp > 1:  # this rank's pipeline chunks, parameters under their global names
            model = build_stage(
                model_cfg, layout, topo=topo, seed=tcfg.seed, method=layout.pp_partition,
                device=device, ep=ep,
            )  # fmt: skip
        else:
            model = build_model(
                model_cfg,
                seed=tcfg.seed,
                device=device,
                topo=topo,
                recompute=layout.recompute,
                recompute_layers=layout.recompute_layers,
                sequence_parallel=layout.sequence_parallel,
                fp32_residual=layout.fp32_residual,
                cp_mode=layout.cp_mode,
                ep=ep,
            )
        # moved only when it is elsewhere: a no-op move still swaps every tensor, which
        # the fake tensors of a rehearsal (plait.rehearse) refuse
        held = itertools.chain(model.parameters(), model.buffers())
        weights = None
        if tcfg.init_hf:  # read one tensor at a time, as each parameter is filled
            from plait.model import hf

            weights = hf.HFWeights(tcfg.init_hf)
        if meta:  # parameters on the device without storage, filled by the ZeRO-3 engine
            if weights is not None:
                hf.defer_into(model, weights, topo)
            if cfg.lora:  # the adapters on meta too, their values deferred alike
                lora.apply_lora(model, cfg.lora, arch=model_cfg.arch, seed=tcfg.seed)
            hollow(model, topo.device)
        elif any(t.device != topo.device for t in held):
            model.to(topo.device)
        self.placed()
        if weights is not None and not meta:  # before the engine wraps the parameters
            hf.load_into(model, weights, topo)
        if cfg.lora and not meta:  # base frozen, adapters beside the targeted layers
            lora.apply_lora(model, cfg.lora, arch=model_cfg.arch, seed=tcfg.seed)
        if cfg.qat:  # fake-quantised block linears (model/quant.py)
            quant.apply_qat(model, cfg.qat)
        if tcfg.compile:
            compile_blocks(model)
        self.model = model
        self.tp_grad_sync = TPGradSync(list(model.parameters()), topo=topo)
        # gradients completed after the backward (over tp; the pipeline's tied embedding
        # copies, summed by the runner): their dp reduction waits for finish(). At tp 1
        # nothing completes them: they go with the rest (LoRA's factors beside split
        # weights were held back to the step's end, reduced once where the model, and
        # every other gradient, reduce each micro-batch under ZeRO-2/3)
        sync = self.tp_grad_sync
        deferred = sync.partial + sync.replicated_kv if sync.active else []
        if getattr(model, "tied_copy", None) is not None:
            deferred.append(model.tied_copy)
        # across replicas: plain or compressed all-reduce, local SGD / DiLoCo, gossip; the
        # engine then runs inside one replica when replicas differ (dp_algos/algorithm.py).
        # A resilient run (Part) is plain all-reduce on its own engine across pipelines
        # (RunConfig refuses --fault-tolerance with another --dp-algo or --compress).
        # With cp, the gradients are reduced over dp x cp: the engines see that merged axis
        # as their dp (Topology.grad_view); the cp ranks of a replica hold the same weights.
        self.dp_algo = dp_algos.build(
            cfg.dp_algo, topo=topo.grad_view(), layout=layout, seed=tcfg.seed
        )
        if part is not None:
            make_engine = part.make_engine
        elif ep is not None:  # dense parameters over dp, experts over edp
            make_engine = functools.partial(expert.ExpertDataParallel, edp_topo=edp_topo)
        else:
            make_engine = functools.partial(
                build_data_parallel, compression=self.dp_algo.compression
            )
        self.engine = make_engine(  # dp gradient sync, ZeRO sharding, the optimizer
            model,
            topo=self.dp_algo.engine_topo,
            cfg=DataParallelConfig.from_layout(layout),
            make_optimizer=functools.partial(optim.build_optimizer, cfg=tcfg),
            owns_grad=functools.partial(optim.owns_grad, topo=topo),
            defer=deferred,
        )
        self.dp_algo.attach(self.engine, model)
        autocast = autocast_factory(layout.dtype, topo.device)
        if layout.pp > 1:
            self.runner = PipelineRunner(
                model,
                topo=topo,
                layout=layout,
                seq_len=model_cfg.seq_len // layout.cp,  # the tokens this rank holds
                autocast=autocast,
                trace_dir=self.out / "traces" if tcfg.trace else None,
            )
        else:
            self.runner = LocalRunner(model, autocast=autocast)
        self.scaler = optim.LossScaler(enabled=layout.dtype == "fp16")
        # Ranks that report the loss: the last pipeline stage, one per tp group.
        self.reports_loss = topo.is_last_stage and topo.tp_rank == 0
        self.tokens_per_step = cfg.layout.global_batch_size * model_cfg.seq_len
        self.flops_per_token = (
            lora.model_flops_per_token(model_cfg, cfg.lora)
            if cfg.lora
            else model_flops_per_token(model_cfg, model_cfg.seq_len)
        )
        self.peak_flops = peak_tflops(topo.device, layout.dtype, tcfg.peak_tflops) * 1e12
        self._model_state: dict[str, int] | None = None  # engine.model_state_bytes()

    def open_data(self) -> tuple:
        """The training batches' sampler and the validation pairs. Prepared by the
        launcher already, so this only opens the cache; instruction data's targets are
        masked to the answers, a mixture's rows drawn by weight. ``plait rehearse`` gives
        synthetic batches of the same shapes instead (``plait.rehearse``)."""
        cfg, tcfg = self.cfg, self.cfg.train
        data = prepare(cfg.data)
        self.eot_id = data.tokenizer.eot_id
        sampler = train_sampler(
            data, seq_len=cfg.model.seq_len, global_batch=cfg.layout.global_batch_size,
            seed=tcfg.seed,
        )  # fmt: skip
        val = val_set(
            data, seq_len=cfg.model.seq_len, batch=cfg.layout.global_batch_size,
            num_batches=tcfg.eval_batches,
        )  # fmt: skip
        return sampler, val

    # -- restore and save --------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest checkpoint that verifies (or --resume-from's) when resuming;
        return the step to continue from."""
        tcfg = self.cfg.train
        if not tcfg.resume:
            return 0
        root = self.out / "checkpoints"
        path, note = checkpoint.pick_resume(root, tcfg.resume_from, topo=self.topo,
                                            trust=tcfg.trust_checkpoint)  # verified  # fmt: skip
        if self.topo.rank == 0:
            print(f"plait: {note}", flush=True)
        engine = self.engine
        try:  # this replica's entries and the algorithm's state (dp_algos/algorithm.py)
            entries = self.dp_algo.resume(checkpoint.read_meta(path))
        except ResumeError as e:
            raise checkpoint.CheckpointError(f"--resume: {path}: {e}") from None
        meta = checkpoint.load(path, state=self.checkpoint_state(**entries), topo=self.topo,
                               verified=True)  # fmt: skip
        engine.state_loaded()  # ZeRO 1-2: the parameters re-gathered from the loaded shards
        self.dp_algo.loaded(meta["step"], meta)
        if meta.get("loss_scale"):
            self.scaler.load_state_dict(meta["loss_scale"])
        return meta["step"]

    def save(self, step: int) -> None:
        checkpoint.save(
            self.out / "checkpoints",
            step,
            state=self.checkpoint_state(**self.dp_algo.checkpoint_state()),
            meta={
                "model": self.cfg.model.to_dict(),
                "loss_scale": self.scaler.state_dict(),
                **self.dp_algo.meta(),
            },
            topo=self.topo,
            keep=self.cfg.train.keep_checkpoints,
        )

    def checkpoint_state(self, *, prefix: str = "", extra: dict | None = None) -> dict[str, Held]:
        """What this rank saves or loads (``checkpoint.py``): what the engine holds, its
        keys under ``prefix`` (a replica of ``--dp-algo`` local SGD keeps its own), and the
        dp algorithm's ``extra`` entries (``DPAlgorithm.checkpoint_state``)."""
        state = {f"{prefix}{key}": held for key, held in self.engine.held_state().items()}
        # the MoE expert bias (aux-loss-free balancing): state, not a parameter, and the
        # same on every rank that holds its layer (updated from the load over dp)
        bias = {f"buffers/{name}": Held.whole(b) for name, b in self.model.named_buffers()
                if name.endswith("expert_bias")}  # fmt: skip
        return {**state, **bias, **(extra or {})}

    # -- one step ----------------------------------------------------------------------

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch: its dp share, or its pipeline's (``Part``)."""
        if self.part is not None:
            return batch[self.part.rows[0] : self.part.rows[1]]
        return batch.chunk(self.layout.dp)[self.topo.dp_rank]

    def _micro_batches(self, rows) -> list:
        """This rank's rows on the device, cut into micro-batches, each sequence split over
        the cp ring and carrying its document ids (``context_shard``)."""
        mbs = _split([_to_device(t, self.topo.device) for t in rows], self.layout.micro_batch_size)
        return context_shard(mbs, cp=self.topo.cp, cp_rank=self.topo.cp_rank, eot=self.eot)

    def step(self, step: int) -> dict:
        """Optimizer step ``step`` (from 0); returns its metrics record."""
        topo, layout = self.topo, self.layout
        engine, runner, scaler, algo = self.engine, self.runner, self.scaler, self.dp_algo
        t0 = time.perf_counter()
        sent0 = topo.stats.sent_bytes("dp")
        lr = optim.lr_at(step, self.cfg.train)
        if self.part is not None:
            batch = self.sampler.rows(step, *self.part.rows)
        else:
            batch = self.sampler.local_batch(step, dp_rank=topo.dp_rank, dp=layout.dp)
        # the global mean over the targets that take a loss (all, unless masked; a batch
        # without any answer token trains nothing)
        loss_tokens = self.sampler.target_count(step)
        # MoE aux losses: coef x their mean over the step's micro-batches (model/moe.py)
        aux_scale = scaler.scale * layout.micro_batch_size / self.cfg.layout.global_batch_size
        with moe.aux_loss_scale(aux_scale):
            loss_share = runner.train_step(
                self._micro_batches(batch),
                loss_scale=scaler.scale,
                # the replica's own mean when replicas differ (dp_algos/algorithm.py)
                tokens_global=max(algo.loss_tokens(self.sampler, step, loss_tokens), 1),
            )
        self.tp_grad_sync.finish()
        engine.finish()
        algo.finish_grads(step)  # post-local SGD's warm-up: the gradients across replicas
        if hasattr(engine, "gather_deferred"):  # the algorithm gathers after rewriting
            engine.gather_deferred = algo.rewrites_shards(step)
        stats = self._reduce_stats(step, loss_share)
        grad_norm, found_inf = self.update(stats, lr=lr)
        moe.update_expert_bias(self.model, topo)  # aux-loss-free balancing (one all-reduce)
        algo.after_step(step)  # average (local SGD, DiLoCo's outer step) or mix (gossip)
        step_time = time.perf_counter() - t0

        tokens_per_s = self.tokens_per_step / step_time
        flops_per_s = tokens_per_s * self.flops_per_token / topo.world_size
        # fixed from the first applied step on (the optimizer's state exists by then):
        # asked until then, not walked every step
        model_state = self._model_state or engine.model_state_bytes()
        if not found_inf:
            self._model_state = model_state
        rec = record_of(stats, lr=lr, tokens=self.tokens_per_step, grad_norm=grad_norm)
        rec.update(source_tokens(self.sampler, step))  # a mixture's tokens seen per source
        rec.update({
            **({"loss_tokens": loss_tokens} if loss_tokens != self.tokens_per_step else {}),
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": flops_per_s / 1e12,
            "mfu": flops_per_s / self.peak_flops,
            "peak_mem_bytes": stats.peak_mem_bytes,
            # this rank's parameters + gradients + optimizer state on the device
            "model_state_bytes": model_state["total"],
            # what this rank put on the wire over the dp axis (comm.py's ring convention)
            "dp_bytes_sent": topo.stats.sent_bytes("dp") - sent0,
        })  # fmt: skip
        if stats.alloc_retries:  # the allocator flushed its cache: the GPU waited each time
            rec["alloc_retries"] = stats.alloc_retries
            if topo.rank == 0 and not self._told_alloc_retries:
                self._told_alloc_retries = True
                print(f"plait: step {stats.step + 1}: the CUDA allocator ran out of free "
                      f"blocks and flushed its cache {stats.alloc_retries} time(s) over the "
                      f"ranks; each flush leaves the GPU idle while it waits (14% of a step "
                      f"measured on an H100): a smaller --micro-batch-size or --recompute "
                      f"frees the memory", flush=True)  # fmt: skip
        rec.update(self.moe_stats)  # tokens per expert, dropped fraction, aux losses
        if model_state["host"]:
            rec["host_state_bytes"] = model_state["host"]  # --offload-optimizer
        if layout.pp > 1 or self.part is not None:
            rec["bubble_fraction"] = stats.bubble_fraction
        if scaler.enabled:
            rec["loss_scale"] = scaler.scale
            rec["skipped"] = found_inf
        return rec

    def _reduce_stats(self, step: int, loss_share) -> StepStats:
        """The step's statistics over every rank in one all-reduce (a sum, float64, on the
        device) -- the step's one host synchronisation -- of

            [loss, bubble, |g|^2 of replica 0 .. R-1, peak memory of rank 0 .. W-1,
             allocator retries]

        to which each rank adds its share: of the loss (the last pipeline stage's), of the
        bubble (its own over the world size), of its replica's |g|^2 (its shard, or 0 for
        a copy; R = 1 unless replicas differ, each then clipped on its own norm:
        ``dp_algos``' ``norm_slot``), and its peak memory so far in its own slot (the
        record takes the largest), and its CUDA allocator's cache flushes since the last
        statistics (``metrics.alloc_retries``; summed). 3 + R + W numbers: 8 KiB at 1,024
        ranks.
        A MoE model appends its routing statistics (``moe.stats_table``: L (E + 4) numbers,
        the rows of the layers this rank holds), so that every layout reports the whole
        step's (``self.moe_stats``)."""
        topo, algo = self.topo, self.dp_algo
        norms = 2 + algo.norm_slots  # where the peaks start
        retries_at = norms + topo.world_size
        moe_at = retries_at + 1
        # one count per micro-batch: tp and cp ranks hold the same whole-micro-batch rows
        routing = moe.stats_table(self.model, self.cfg.model,
                                  count=topo.tp_rank == 0 and topo.cp_rank == 0,
                                  device=topo.device)  # fmt: skip
        # numbers the host knows go up in one copy that does not wait (writing a Python
        # number into a GPU tensor is a synchronous copy: one host sync each, measured
        # on an H200); the device's own values are written on the device
        shares = {1: getattr(self.runner, "bubble_fraction", 0.0) / topo.world_size,
                  2 + algo.norm_slot: self.engine.grad_sq_local(),
                  norms + topo.rank: peak_memory_bytes(topo.device),
                  retries_at: self._alloc_retries_since_last()}  # fmt: skip
        if self.reports_loss:
            shares[0] = loss_share
        host = torch.zeros(moe_at + routing.numel(), dtype=torch.float64)
        on_device = {}
        for i, v in shares.items():
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                on_device[i] = v
            else:
                host[i] = v
        stats = _to_device(host, topo.device)
        for i, v in on_device.items():
            stats[i] = v
        stats[moe_at:] = routing
        comm.world_all_reduce(stats, topo=topo)
        values = comm.host_values(stats)  # (a rehearsal's fake tensors read as zeros)
        self.moe_stats = moe.summary_of(values[moe_at:], self.cfg.model)
        values = values[:moe_at]
        loss = values[0] / (algo.num_replicas if algo.replicas_differ else 1)  # their mean
        self._reduced = StepStats(step=step, grad_sq_sum=values[2 + algo.norm_slot], loss=loss,
                                  bubble_fraction=values[1],
                                  peak_mem_bytes=int(max(values[norms:retries_at])),
                                  alloc_retries=int(values[retries_at]))  # fmt: skip
        return self._reduced

    def _alloc_retries_since_last(self) -> int:
        now = alloc_retries(self.topo.device)
        delta, self._alloc_retries_seen = now - self._alloc_retries_seen, now
        return delta

    def last_reduced(self) -> StepStats | None:
        """The newest step whose statistics came back from their all-reduce (its update
        is then applied, or can be: ``update``); None before the first."""
        return self._reduced

    def update(self, stats: StepStats, *, lr: float) -> tuple[float, bool]:
        """The update of step ``stats.step`` once its statistics are reduced: unscale
        (fp16), clip to the global norm, step at ``lr`` (skipped on an fp16 overflow), free
        the gradients. Returns (grad norm, overflowed). No communication of its own (the
        engine's step gathers under ZeRO 1-2); recovery calls it on a rank whose gradients
        were reduced when it lost the statistics' all-reduce (``plait.resilience``)."""
        engine, scaler, tcfg = self.engine, self.scaler, self.cfg.train
        sq = stats.grad_sq_sum
        grad_norm = math.sqrt(sq) / scaler.scale if math.isfinite(sq) else math.inf
        found_inf = not math.isfinite(grad_norm)
        if found_inf and not scaler.enabled:
            raise FloatingPointError(
                f"step {stats.step + 1}: gradients are not finite (loss {stats.loss:.4g}); "
                "lower --lr or use --dtype fp32"
            )
        if not found_inf:
            if scaler.scale != 1.0:
                engine.scale_grads_(1 / scaler.scale)
            if tcfg.grad_clip:
                engine.scale_grads_(optim.clip_coef(grad_norm, tcfg.grad_clip))
            engine.step(lr)
        scaler.update(found_inf)
        engine.zero_grad()
        return grad_norm, found_inf

    def evaluate(self) -> float:
        """Mean loss over the validation batches (every rank calls it)."""
        topo = self.topo
        total = 0.0
        self.model.eval()
        for inputs, targets in self.val_set:
            share = self.runner.eval_step(
                self._micro_batches([self._rows(t) for t in (inputs, targets)]),
                tokens_global=max(int((targets != IGNORE_INDEX).sum()), 1),
            )
            if self.reports_loss:
                total = total + share
        self.model.train()
        return optim.global_stats([total], topo)[0] / len(self.val_set)

    def close(self) -> None:
        self.engine.close()


def train(cfg: RunConfig, *, topo: Topology) -> dict:
    """Train according to ``cfg`` on this worker's place in ``topo``; returns the last
    step's metrics record."""
    tcfg = cfg.train
    trainer = Trainer(cfg, topo=topo)
    start_step = trainer.restore()
    is_logger = topo.rank == 0
    metrics = MetricsWriter(
        trainer.out / "metrics.jsonl",
        enabled=is_logger,
        truncate_after=start_step if tcfg.resume else None,
        tensorboard=tcfg.tensorboard,
    )
    progress = Progress(
        tcfg.steps, start_step, enabled=is_logger and tcfg.progress, log_every=tcfg.log_every
    )
    trainer.model.train()
    last = {}
    prof = None
    if tcfg.profile:
        from plait.train.profiling import StepProfiler

        prof = StepProfiler(tcfg.profile_steps, out=trainer.out, rank=topo.rank,
                            device=topo.device)  # fmt: skip
    for step in range(start_step, tcfg.steps):
        if prof is not None:
            prof.before(step + 1)
        rec = trainer.step(step)
        done = rec["step"]
        if prof is not None:
            prof.after(done)
        if done == tcfg.steps or (tcfg.eval_every and done % tcfg.eval_every == 0):
            rec["val_loss"] = trainer.evaluate()
            progress.note(f"step {done}: val loss {rec['val_loss']:.4f}")
            if trainer.dp_algo.replicas_differ:  # spread of the replicas around their mean
                rec["consensus_distance"] = trainer.dp_algo.consensus_distance()
        metrics.write(rec)
        progress.update(rec)
        last = rec
        if done == tcfg.steps or (tcfg.save_every and done % tcfg.save_every == 0):
            trainer.save(done)
    if prof is not None:
        prof.close()
    progress.close()
    metrics.close()
    write_rank_summary(trainer.out, topo=topo, model_state=trainer.engine.model_state_bytes(),
                       steps=tcfg.steps - start_step)  # fmt: skip
    trainer.close()
    return last
