"""``plait export``: a run's newest checkpoint out to the Hugging Face ecosystem.

    plait export --run R                     # config.json + model.safetensors (+ tokenizer)
    plait export --run R --merge-lora        # a LoRA run: adapters folded into the weights
    plait export --run R --adapter           # a LoRA run: the base model, and the adapter
                                             #   in PEFT's format in OUT/adapter/
    plait export --run R --quantize int8     # weight-only int8 / int4 (model/quant.py), with
                                             #   the validation perplexity before and after

One process. The weights stream: the checkpoint is read one part at a time (the embedding,
each block, the rest: ``hf.export_groups``), whole tensors of that part only, converted
and written as one file of Hugging Face's sharded safetensors, so the process holds one
part beside the adapters (LoRA) -- never the model. ``--quantize`` is the exception: it
evaluates the model before and after, so it holds it whole.
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
        if self.adapter and cfg.lora is not None:
            from plait.model.lora import touches_experts

            if touches_experts(cfg.model, cfg.lora):
                raise ExportError(
                    f"--adapter: --run {run} trained LoRA adapters on stacked MoE experts, "
                    "which PEFT's format does not hold; pass --merge-lora"
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
    from plait.generate import locate
    from plait.model import hf, lora

    cfg, path = locate(run, trust=opts.trust)
    opts.check(cfg, run)
    out = Path(out or run / "hf")
    notes = [f"{cfg.model.arch}, {path.name}"]
    try:
        data = prepare(cfg.data)
    except DataError as e:
        data, notes = None, [*notes, f"no tokenizer ({str(e).splitlines()[0]})"]
    if opts.quantize:
        if data is None:
            raise ExportError("--quantize needs the run's data for the validation perplexity")
        from plait.generate import load_model

        state = {k: v.detach() for k, v in load_model(run, trust=opts.trust)[2].named_parameters()}
        if opts.merge_lora:
            state = lora.merged_state(state, cfg.lora)
            notes.append(f"LoRA r={cfg.lora.rank} merged")
        notes += _quantized(out, cfg, lora.base_state(state), data, opts)
    else:
        adapters = {}

        def parts():
            for part in checkpoint_parts(cfg, path):
                adapters.update({k: v for k, v in part.items() if lora.is_adapter(k)})
                yield (
                    lora.merged_state(part, cfg.lora) if opts.merge_lora else lora.base_state(part)
                )

        hf.save_parts(out, parts(), cfg.model)
        if opts.merge_lora:
            notes.append(f"LoRA r={cfg.lora.rank} merged")
        notes.append("model-*.safetensors")
        if opts.adapter:
            from plait.model import peft

            peft.save_adapter(out / "adapter", adapters, cfg.model, cfg.lora, base=str(out))
            notes.append(f"adapter/ (PEFT LoRA r={cfg.lora.rank}: {', '.join(cfg.lora.targets)})")
    if data is not None:
        from plait.data.instruct import chat_template

        chat = chat_template(cfg.data.tokenizer)  # what the run's conversations were in
        if hf.save_tokenizer(out, data.tokenizer, cfg.model, chat and chat.template):
            notes.append("tokenizer.json" + (" (with its chat template)" if chat else ""))
        else:
            notes.append("no tokenizer file (--tokenizer bytes: ids are UTF-8 bytes)")
    return out, notes


def checkpoint_parts(cfg, path: Path):
    """The checkpoint's parameters, one ``hf.export_groups`` part at a time: {name: whole
    tensor} read from the checkpoint's shards (DCP reads only that part's chunks)."""
    from plait.generate import build_as_trained
    from plait.model import hf
    from plait.parallel.held import Held
    from plait.topology import Topology
    from plait.train import checkpoint

    skeleton = dict(build_as_trained(cfg, device="meta").named_parameters())
    for group in hf.export_groups(list(skeleton)):
        part = {n: torch.empty(skeleton[n].shape, dtype=skeleton[n].dtype) for n in group}
        state = {f"model/{n}": Held.whole(t) for n, t in part.items()}
        checkpoint.load(path, state=state, topo=Topology.single(), verified=True)
        yield part


def _quantized(out: Path, cfg, state: dict, data, opts: ExportOptions) -> list[str]:
    """Quantise a whole model with torchao, write it, and report the perplexity change."""
    from plait.data import val_set
    from plait.model import quant
    from plait.model.transformer import build_model

    group = (
        opts.group_size
        if opts.group_size is not None
        else (cfg.qat.group_size if cfg.qat else None)
    )
    qcfg = quant.QuantConfig(dtype=opts.quantize,
                             **({"group_size": group} if group is not None else {}))  # fmt: skip
    qcfg.check_model(cfg.model)
    model = build_model(cfg.model, seed=cfg.train.seed)
    model.load_state_dict(state)
    model.eval()
    pairs = val_set(  # the run's own validation batches (of every source of a mixture)
        data, seq_len=cfg.model.seq_len, batch=cfg.layout.global_batch_size,
        num_batches=cfg.train.eval_batches,
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
