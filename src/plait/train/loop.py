"""The training loop, top to bottom: topology -> data -> model -> parallelize -> optimizer ->
resume -> steps (forward/backward over micro-batches, gradient sync, clip, step) ->
metrics, evaluation, checkpoints.

Runs inside every worker process (``plait.train.worker``); the launcher has already
validated the config and prepared the data, so errors here are unexpected ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from pathlib import Path

import torch

from plait.data import GlobalBatchSampler, prepare, val_batches
from plait.model.sizes import model_flops_per_token
from plait.model.transformer import build_model
from plait.parallel.data_parallel import DataParallelConfig, build_data_parallel
from plait.parallel.pipeline.executor import PipelineRunner
from plait.parallel.pipeline.stage import build_stage
from plait.parallel.tensor import TPGradSync
from plait.topology import Topology
from plait.train import checkpoint, optim
from plait.train.config import RunConfig
from plait.train.metrics import MetricsWriter, Progress, peak_memory_bytes, peak_tflops

log = logging.getLogger("plait.train")


class LocalRunner:
    """Runs the micro-batches of one step on a model held whole by this rank (pp == 1)."""

    def __init__(self, model, *, autocast):
        self.model, self.autocast = model, autocast

    def train_step(self, micro_batches, *, loss_scale: float, tokens_global: int) -> float:
        """Forward and backward over the micro-batches; gradients accumulate in ``.grad``.
        Returns this rank's share of the global mean loss."""
        total = 0.0
        for mb in micro_batches:  # (B, T+1)
            with self.autocast():
                token_loss = self.model(mb[:, :-1], mb[:, 1:])  # (B*T,)
            loss = token_loss.sum() / tokens_global
            (loss * loss_scale).backward()
            total += loss.item()
        return total

    @torch.no_grad()
    def eval_step(self, micro_batches, *, tokens_global: int) -> float:
        total = 0.0
        for mb in micro_batches:
            with self.autocast():
                total += self.model(mb[:, :-1], mb[:, 1:]).sum().item() / tokens_global
        return total


def _autocast_factory(dtype: str, device: torch.device):
    if dtype == "fp32":
        return contextlib.nullcontext
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=torch_dtype)


def _split(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    return list(rows.split(micro_batch_size))


def train(cfg: RunConfig, *, topo: Topology) -> dict:
    """Train according to ``cfg`` on this worker's place in ``topo``; returns a summary."""
    model_cfg, layout, tcfg = cfg.model, cfg.layout, cfg.train
    out = Path(cfg.out)
    is_logger = topo.rank == 0
    torch.manual_seed(tcfg.seed)

    # data: prepared by the launcher already, so this only opens the cache
    data = prepare(cfg.data)
    seq_len = model_cfg.seq_len
    sampler = GlobalBatchSampler(
        data.train,
        seq_len=seq_len,
        global_batch=layout.global_batch_size,
        seed=tcfg.seed,
        name=data.source,
    )
    val_set = val_batches(
        data.val,
        seq_len=seq_len,
        batch=layout.global_batch_size,
        num_batches=tcfg.eval_batches,
        name=data.source,
    )

    # model and its parallel wrapping
    if layout.pp > 1:  # this rank's pipeline chunks, parameters under their global names
        model = build_stage(
            model_cfg, layout, topo=topo, seed=tcfg.seed, method=layout.pp_partition
        )
    else:
        model = build_model(
            model_cfg,
            seed=tcfg.seed,
            topo=topo,
            recompute=layout.recompute,
            sequence_parallel=layout.sequence_parallel,
        )
    model.to(topo.device)
    if tcfg.init_hf:  # before the engine: ZeRO-3 moves parameters into its own buffers
        from plait.model import hf

        hf.load_into(model, hf.load(tcfg.init_hf)[1], topo)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    tp_grad_sync = TPGradSync(params, topo=topo)  # sequence-parallel / replicated-kv grads
    # gradients completed after the backward (over tp; the pipeline's tied embedding copies,
    # summed by the runner): their dp reduction waits for finish()
    deferred = tp_grad_sync.partial + tp_grad_sync.replicated_kv
    if getattr(model, "tied_copy", None) is not None:
        deferred.append(model.tied_copy)
    dp_engine = build_data_parallel(  # dp gradient sync, ZeRO sharding, and the optimizer
        model,
        topo=topo,
        cfg=DataParallelConfig.from_layout(layout),
        make_optimizer=functools.partial(optim.build_adamw, cfg=tcfg),
        owns_grad=functools.partial(optim.owns_grad, topo=topo),
        defer=deferred,
    )
    autocast = _autocast_factory(layout.dtype, topo.device)
    if layout.pp > 1:
        trace_dir = out / "traces" if tcfg.trace else None
        runner = PipelineRunner(
            model, topo=topo, layout=layout, seq_len=seq_len, autocast=autocast, trace_dir=trace_dir
        )
    else:
        runner = LocalRunner(model, autocast=autocast)
    scaler = optim.LossScaler(enabled=layout.dtype == "fp16")

    # resume
    start_step = 0
    ckpt_root = out / "checkpoints"
    if tcfg.resume:
        path = checkpoint.latest(ckpt_root)
        with dp_engine.full_params(writeback=True):  # ZeRO-3: whole while loading
            optim_state = dp_engine.optim_state(template=True)
            meta = checkpoint.load(path, model=model, optim_state=optim_state, topo=topo)
        dp_engine.load_optim_state(optim_state)  # keeps this rank's ZeRO shard
        start_step = meta["step"]
        if meta.get("loss_scale"):
            scaler.load_state_dict(meta["loss_scale"])

    tokens_per_step = layout.global_batch_size * seq_len
    flops_per_token = model_flops_per_token(model_cfg, seq_len)
    peak = peak_tflops(topo.device, layout.dtype, tcfg.peak_tflops) * 1e12
    metrics = MetricsWriter(
        out / "metrics.jsonl",
        enabled=is_logger,
        truncate_after=start_step if tcfg.resume else None,
    )
    progress = Progress(
        tcfg.steps, start_step, enabled=is_logger and tcfg.progress, log_every=tcfg.log_every
    )
    # Ranks that report the loss: the last pipeline stage, one per tp group.
    reports_loss = topo.is_last_stage and topo.tp_rank == 0

    def evaluate() -> float:
        total = 0.0
        model.eval()
        for batch in val_set:
            rows = batch.chunk(layout.dp)[topo.dp_rank].to(topo.device)
            share = runner.eval_step(
                _split(rows, layout.micro_batch_size), tokens_global=batch.numel() - len(batch)
            )
            total += share if reports_loss else 0.0
        model.train()
        return optim.global_stats([total], topo)[0] / len(val_set)

    def save(step: int) -> None:
        with dp_engine.full_params():  # full tensors, whatever the ZeRO stage
            checkpoint.save(
                ckpt_root,
                step,
                model=model,
                optim_state=dp_engine.optim_state(),
                meta={"model": model_cfg.to_dict(), "loss_scale": scaler.state_dict()},
                topo=topo,
                keep=tcfg.keep_checkpoints,
            )

    model.train()
    last = {}
    for step in range(start_step, tcfg.steps):
        t0 = time.perf_counter()
        lr = optim.lr_at(step, tcfg)
        rows = sampler.local(step, dp_rank=topo.dp_rank, dp=layout.dp).to(topo.device)
        loss_share = runner.train_step(
            _split(rows, layout.micro_batch_size),
            loss_scale=scaler.scale,
            tokens_global=tokens_per_step,
        )
        tp_grad_sync.finish()
        dp_engine.finish()
        grad_sq = dp_engine.grad_sq_local()  # this rank's share (its shard, or 0 if a replica)
        stats = [grad_sq, loss_share if reports_loss else 0.0]
        if layout.pp > 1:  # measured bubble fraction, averaged over ranks (executor.py)
            stats.append(runner.bubble_fraction / topo.world_size)
        grad_sq_sum, loss, *bubble = optim.global_stats(stats, topo)
        grad_norm = (
            math.sqrt(grad_sq_sum) / scaler.scale if math.isfinite(grad_sq_sum) else math.inf
        )
        found_inf = not math.isfinite(grad_norm)
        if found_inf and not scaler.enabled:
            raise FloatingPointError(
                f"step {step + 1}: gradients are not finite (loss {loss:.4g}); "
                "lower --lr or use --dtype fp32"
            )
        if not found_inf:
            if scaler.scale != 1.0:
                dp_engine.scale_grads_(1 / scaler.scale)
            if tcfg.grad_clip:
                dp_engine.scale_grads_(optim.clip_coef(grad_norm, tcfg.grad_clip))
            dp_engine.step(lr)
        scaler.update(found_inf)
        dp_engine.zero_grad()
        step_time = time.perf_counter() - t0
        model_state = dp_engine.model_state_bytes()

        done = step + 1
        tokens_per_s = tokens_per_step / step_time
        rec = {
            "step": done,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
            "tokens": tokens_per_step,
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tokens_per_s * flops_per_token / topo.world_size / 1e12,
            "mfu": tokens_per_s * flops_per_token / topo.world_size / peak,
            "peak_mem_bytes": peak_memory_bytes(topo.device),
            # this rank's parameters + gradients + optimizer state on the device
            "model_state_bytes": model_state["total"],
        }
        if model_state["host"]:
            rec["host_state_bytes"] = model_state["host"]  # --offload-optimizer
        if bubble:
            rec["bubble_fraction"] = bubble[0]
        if scaler.enabled:
            rec["loss_scale"] = scaler.scale
            rec["skipped"] = found_inf
        if done == tcfg.steps or (tcfg.eval_every and done % tcfg.eval_every == 0):
            rec["val_loss"] = evaluate()
            progress.note(f"step {done}: val loss {rec['val_loss']:.4f}")
        metrics.write(rec)
        progress.update(rec)
        last = rec
        if done == tcfg.steps or (tcfg.save_every and done % tcfg.save_every == 0):
            save(done)
    progress.close()
    dp_engine.close()
    return last
