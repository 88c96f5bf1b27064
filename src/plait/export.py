"""``plait export``: a run's newest checkpoint out to the Hugging Face ecosystem.

    plait export --run R                     # config.json + model.safetensors (+ tokenizer)
    plait export --run R --merge-lora        # a LoRA run: adapters folded into the weights
    plait export --run R --adapter           # a LoRA run: the base model, and the adapter
                                             #   in PEFT's format in OUT/adapter/
    plait export --run R --quantize int8     # weight-only int8 / int4 (model/quant.py), with
                                             #   the validation perplexity before and after

Everything runs in one process on whole tensors (the checkpoint is stored whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch


class ExportError(ValueError):
    """A request that does not fit the run (one line)."""


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    merge_lora: bool = False
    adapter: bool = False
    quantize: str | None = None  # int8 | int4
    group_size: int | None = None  # int4; None: the run's --quant-group-size, else 32
    trust: str | None = None  # --trust-checkpoint: checkpoints under it load unsigned

    def check(self, cfg, run: Path) -> None:
        if self.merge_lora and self.adapter:
            raise ExportError("--merge-lora and --adapter: choose one")
        if (self.merge_lora or self.adapter) and cfg.lora is None:
            flag = "--merge-lora" if self.merge_lora else "--adapter"
            raise ExportError(f"{flag}: --run {run} trained no LoRA adapters (no --lora-rank)")
        if cfg.lora is not None and not (self.merge_lora or self.adapter):
            raise ExportError(
                f"--run {run} trained LoRA adapters: pass --merge-lora (one model with them "
                "folded in) or --adapter (the base model and a PEFT adapter)"
            )
        if self.adapter and self.quantize:
            raise ExportError("--quantize with --adapter: quantise a merged model (--merge-lora)")
        if self.group_size is not None and self.quantize != "int4":
            raise ExportError("--quant-group-size applies to --quantize int4")


def val_loss(model, pairs) -> tuple[float, int]:
    """(mean loss over the targets that take one, their number) of ``pairs``
    (``data.val_pairs``) through a whole model."""
    from plait.data import IGNORE_INDEX

    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in pairs:
            total += model(inputs, targets).double().sum().item()
            count += int((targets != IGNORE_INDEX).sum())
    return total / max(count, 1), count


def export(run: Path, out: Path | None, opts: ExportOptions) -> tuple[Path, list[str]]:
    """Write the export; returns (folder, what was written / measured, for the user)."""
    from plait.data import DataError, prepare
    from plait.generate import load_model
    from plait.model import hf, lora

    cfg, path, model = load_model(run, trust=opts.trust)
    opts.check(cfg, run)
    out = Path(out or run / "hf")
    state = {k: v.detach() for k, v in model.named_parameters()}
    notes = [f"{cfg.model.arch}, {path.name}"]
    if opts.merge_lora:
        state = lora.merged_state(state, cfg.lora)
        notes.append(f"LoRA r={cfg.lora.rank} merged")
    try:
        data = prepare(cfg.data)
    except DataError as e:
        data, notes = None, [*notes, f"no tokenizer ({str(e).splitlines()[0]})"]
    if opts.quantize:
        if data is None:
            raise ExportError("--quantize needs the run's data for the validation perplexity")
        notes += _quantized(out, cfg, lora.base_state(state), data, opts)
    elif opts.adapter:
        from plait.model import peft

        hf.save(out, lora.base_state(state), cfg.model)
        peft.save_adapter(out / "adapter", state, cfg.model, cfg.lora, base=str(out))
        notes.append(f"adapter/ (PEFT LoRA r={cfg.lora.rank}: {', '.join(cfg.lora.targets)})")
    else:
        hf.save(out, state, cfg.model)
        notes.append(hf.WEIGHTS)
    if data is not None:
        if hf.save_tokenizer(out, data.tokenizer, cfg.model):
            notes.append("tokenizer.json")
        else:
            notes.append("no tokenizer file (--tokenizer bytes: ids are UTF-8 bytes)")
    return out, notes


def _quantized(out: Path, cfg, state: dict, data, opts: ExportOptions) -> list[str]:
    """Quantise a whole model with torchao, write it, and report the perplexity change."""
    from plait.data import val_pairs
    from plait.model import quant
    from plait.model.transformer import build_model

    group = opts.group_size or (cfg.qat.group_size if cfg.qat else None)
    qcfg = quant.QuantConfig(dtype=opts.quantize, **({"group_size": group} if group else {}))
    qcfg.check_model(cfg.model)
    model = build_model(cfg.model, seed=cfg.train.seed)
    model.load_state_dict(state)
    model.eval()
    pairs = val_pairs(
        data.val, data.val_mask, seq_len=cfg.model.seq_len, batch=cfg.layout.global_batch_size,
        num_batches=cfg.train.eval_batches, name=data.source,
    )  # fmt: skip
    before, tokens = val_loss(model, pairs)
    layers = quant.quantize_model(model, qcfg)
    after, _ = val_loss(model, pairs)
    report = {
        "val_loss": {"float": before, "quantized": after},
        "val_perplexity": {"float": math.exp(before), "quantized": math.exp(after)},
        "val_tokens": tokens,
        "perplexity_change": math.exp(after - before) - 1.0,
    }
    quant.save_quantized(out, model, cfg.model, qcfg, report)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    scheme = qcfg.dtype + (f" (groups of {qcfg.group_size})" if qcfg.dtype == "int4" else "")
    return [
        f"{quant.WEIGHTS} {size / 2**20:.2f} MiB: {len(layers)} block linears {scheme}",
        f"validation perplexity {math.exp(before):.4g} -> {math.exp(after):.4g} "
        f"({report['perplexity_change']:+.2%}) on {tokens:,} tokens",
    ]
