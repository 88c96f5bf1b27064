"""``plait`` command line: a thin shell over the library.

    plait train [flags]         train (starts dp x tp x pp workers)
    plait generate --run DIR    sample text from a trained run
    plait export --run DIR      the newest checkpoint as a Hugging Face model folder
    plait checkpoint verify DIR check a run's checkpoints against their manifests
    plait report RUN            one self-contained HTML page (and a PNG) about a run
    plait info [flags]          parameters, FLOPs per token and memory of a model and layout
    plait simulate [flags]      predict step time, MFU and memory of a layout on a cluster
    plait plan [flags]          rank every layout of a model on a cluster; write the best
    plait calibrate             measure this machine into a hardware file for simulate / plan
    plait viz schedule ...      draw a pipeline schedule

Errors a user can cause end with one line on stderr and exit code 2; a run stopped by
Ctrl-C exits 130, by SIGTERM 143.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import tomllib
from pathlib import Path

import yaml

from plait.cli_args import (
    dp_algo_parent,
    layout_parent,
    lora_parent,
    model_config,
    model_parent,
)

DATA_FLAGS = {"data": "path", "tokenizer": "tokenizer", "cache_dir": "cache_dir",
              "val_fraction": "val_fraction"}  # fmt: skip


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def _die(prog: str, msg: str, code: int = 2) -> int:
    label = "" if code in (130, 143) else "error: "  # a signal is the user's choice
    print(f"plait {prog}: {label}{msg}", file=sys.stderr)
    return code


# --- config files ---------------------------------------------------------------------------


def read_config_file(path: str, *, run: bool = True) -> dict:
    """Flag values from a YAML or TOML file: flat keys named like the flags (``tp: 2``,
    ``global-batch-size: 16``), or a ``config.yaml`` written by ``plait train`` (whose
    data section and run folder only ``train`` reads: left out unless ``run``)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        text = p.read_text()
        raw = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"--config {path}: not valid {'TOML' if p.suffix == '.toml' else 'YAML'} "
                        f"({str(e).splitlines()[0]})")  # fmt: skip
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values")
    flat = {}
    if isinstance(raw.get("model"), dict):  # a resolved config.yaml
        m = raw["model"]
        flat.update(
            layers=m.get("n_layers"), hidden=m.get("hidden"), heads=m.get("n_heads"),
            kv_heads=m.get("n_kv_heads"), ffn_hidden=m.get("ffn_hidden"),
            vocab_size=m.get("vocab_size"), seq_len=m.get("seq_len"), arch=m.get("arch"),
            dropout=m.get("dropout"),
        )  # fmt: skip
        for section in ("layout", "train"):
            flat.update(raw.get(section) or {})
        lora, qat = raw.get("lora") or {}, raw.get("qat") or {}
        flat.update(lora_rank=lora.get("rank"), lora_alpha=lora.get("alpha"),
                    lora_targets=",".join(lora.get("targets") or []) or None,
                    qat=qat.get("dtype"),
                    quant_group_size=qat.get("group_size") if qat.get("dtype") == "int4" else None)  # fmt: skip
        algo = dict(raw.get("dp_algo") or {})
        if "algo" in algo:
            algo["dp_algo"] = algo.pop("algo")
        flat.update(algo)
        if run:
            d = raw.get("data") or {}
            flat.update(data=d.get("path"), tokenizer=d.get("tokenizer"),
                        cache_dir=d.get("cache_dir"), val_fraction=d.get("val_fraction"))  # fmt: skip
            if "out" in raw:
                flat["out"] = raw["out"]
            res = dict(raw.get("resilience") or {})  # a run's, like its data and folder
            if "respawn" in res:
                res["no_respawn"] = not res.pop("respawn")
            flat.update(res)
        flat.pop("resume", None)
        flat.pop("resume_from", None)
        return {k: v for k, v in flat.items() if v is not None}
    return {str(k).replace("-", "_"): v for k, v in raw.items()}


def merged_values(
    args: argparse.Namespace, parser: argparse.ArgumentParser, *, run: bool = False
) -> dict:
    """Config file values overridden by the flags given on the command line (``run``: the
    command trains, and takes a run config's data and folder too)."""
    values = {}
    if getattr(args, "config", None):
        values = read_config_file(args.config, run=run)
        from plait.train.config import TRAIN_FIELDS

        known = {a.dest for a in parser._actions} | TRAIN_FIELDS
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"--config {args.config}: unknown key {unknown[0]!r}")
    for k, v in vars(args).items():
        if v is not None and k != "config":
            values[k] = v
    return values


# --- train ----------------------------------------------------------------------------------


def _add_train(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", parents=[model_parent(), layout_parent(), lora_parent(),
                 dp_algo_parent()], allow_abbrev=False,
        help="train a model", description="Train a model (starts dp x tp x pp workers).",
    )  # fmt: skip
    p.add_argument("--config", help="YAML or TOML file of flag values (flags override it)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int)
    g.add_argument("--min-lr-ratio", type=float, metavar="R",
                   help="the cosine decays to lr * R at the last step (default 0.1; 1: constant)")  # fmt: skip
    g.add_argument("--seed", type=int)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--optimizer", choices=("adamw", "sgd"), help="default adamw")
    g.add_argument("--momentum", type=float, help="sgd's momentum (default 0.9)")
    g.add_argument("--grad-clip", type=float)
    g.add_argument("--eval-every", type=int)
    g.add_argument("--eval-batches", type=int)
    g.add_argument("--save-every", type=int)
    g.add_argument("--keep-checkpoints", type=int)
    g.add_argument("--log-every", type=int)
    g.add_argument("--peak-tflops", type=float, help="per-device peak for MFU")
    g.add_argument("--collective-timeout", type=float, help="seconds")
    g.add_argument("--trace", action="store_true", default=None)
    g.add_argument("--tensorboard", action="store_true", default=None,
                   help="TensorBoard event files beside metrics.jsonl")  # fmt: skip
    g.add_argument("--threads", type=int, help="torch threads per worker")
    g.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile each transformer block (first steps pay the compile)")  # fmt: skip
    g.add_argument("--no-progress", action="store_true", default=None)
    g = p.add_argument_group("data and output")
    g.add_argument("--data", help="text file, folder of text, or JSONL; default: embedded corpus")
    g.add_argument("--tokenizer", help="bpe | bytes | path/to/tokenizer.json")
    g.add_argument("--cache-dir")
    g.add_argument("--val-fraction", type=float)
    g.add_argument("--out", help="run folder (default runs/<time>)")
    g.add_argument("--resume", action="store_true", default=None,
                   help="continue from the newest checkpoint in --out that verifies")  # fmt: skip
    g.add_argument("--resume-from", type=int, metavar="STEP",
                   help="continue from the checkpoint of this step")  # fmt: skip
    g.add_argument("--init-hf", metavar="DIR",
                   help="start from a Hugging Face GPT-2 / LLaMA folder (config.json + "
                   "safetensors); the model's sizes come from it")  # fmt: skip
    g.add_argument("--dry-run", action="store_true", default=None,
                   help="validate, build the model on the meta device, and stop")  # fmt: skip
    g = p.add_argument_group("quantisation-aware training")
    g.add_argument("--qat", choices=("int8", "int4"),
                   help="quantisation-aware training of the block linear layers")  # fmt: skip
    g.add_argument("--quant-group-size", type=int, metavar="G",
                   help="int4: input features per scale (default 32)")  # fmt: skip
    g = p.add_argument_group("resilience (docs/resilience.md)")
    g.add_argument("--fault-tolerance", type=int, metavar="F",
                   help="keep F+1 copies of every layer and survive F dead workers in place")  # fmt: skip
    g.add_argument("--heartbeat-timeout", type=float, metavar="S",
                   help="seconds without a heartbeat before a worker counts as hung")  # fmt: skip
    g.add_argument("--inject-failure", metavar="STEP:WORKER[:stop],...",
                   help="kill (or SIGSTOP) these workers during these steps")  # fmt: skip
    g.add_argument(
        "--chaos-every", type=int, metavar="K", help="kill a random worker every K steps"
    )
    g.add_argument("--chaos-signal", choices=("kill", "stop"), help="what --chaos-every sends")
    g.add_argument("--chaos-seed", type=int)
    g.add_argument("--no-respawn", action="store_true", default=None,
                   help="do not start a new worker in place of a dead one")  # fmt: skip
    g.add_argument("--verify-replicas", action="store_true", default=None,
                   help="at the end, check that every replica of every tensor is equal")  # fmt: skip
    g.add_argument("--async-checkpoint", action="store_true", default=None,
                   help="write checkpoints from a side thread, atomically")  # fmt: skip
    g = p.add_argument_group("multi-node (torchrun rendezvous)")
    g.add_argument("--nnodes", type=int)
    g.add_argument("--node-rank", type=int)
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0")
    return p


def _default_micro_batch(values: dict) -> None:
    """Without --micro-batch-size: one micro-batch per step when there is no pipeline, else
    2 x pp micro-batches (when the batch divides that way)."""
    if values.get("micro_batch_size") is not None:
        return
    g, dp, pp = values.get("global_batch_size", 16), values.get("dp", 1), values.get("pp", 1)
    want = 1 if pp == 1 else 2 * pp * values.get("vpp", 1)
    values["micro_batch_size"] = g // (dp * want) if g % (dp * want) == 0 else 1


def build_run_config(values: dict):
    """RunConfig from merged flag values; ValueError (one line) on bad input."""
    from plait.cli_args import dp_algo_config, layout_config
    from plait.data import DataConfig
    from plait.train.config import TRAIN_FIELDS, RunConfig, TrainConfig

    values = dict(values)
    values.setdefault("global_batch_size", 16)
    _default_micro_batch(values)
    model = _hf_model(values) if values.get("init_hf") else model_config(values)
    layout = layout_config(values)
    layout.check_model(model)
    if layout.pp > 1:  # the partition and a static deadlock check of the schedule, up front
        from plait.parallel.pipeline.stage import check_pipeline

        check_pipeline(model, layout, method=layout.pp_partition)
    train_fields = {k: values[k] for k in TRAIN_FIELDS if values.get(k) is not None}
    if values.get("no_progress"):
        train_fields["progress"] = False
    train_fields["resume"] = bool(values.get("resume") or values.get("resume_from"))
    dp_algo = dp_algo_config(values)
    dp_algo.check_layout(layout)
    if train_fields.get("optimizer", "adamw") != "adamw" and layout.zero:
        raise ValueError("--optimizer sgd runs with --zero 0 (ZeRO shards AdamW's state)")
    data_fields = {f: values[k] for k, f in DATA_FLAGS.items() if values.get(k) is not None}
    if values.get("vocab_size") is not None:
        data_fields["vocab_size"] = values["vocab_size"]
    elif data_fields.get("tokenizer", "bpe") == "bpe":
        data_fields["vocab_size"] = model.vocab_size
    try:
        data = DataConfig(**data_fields)
    except ValueError as e:
        if not values.get("init_hf"):
            raise
        raise UserError(f"--init-hf {values['init_hf']}: its {model.vocab_size}-token vocabulary "
                        f"does not suit the tokenizer: {e}") from None  # fmt: skip
    out = values.get("out") or f"runs/{datetime.datetime.now():%Y%m%d-%H%M%S}"
    from plait.resilience.config import check_layout, from_values

    resilience = from_values(values)
    check_layout(resilience, layout, nnodes=values.get("nnodes") or 1)
    return RunConfig(
        model=model, layout=layout, data=data, train=TrainConfig(**train_fields), out=str(out),
        resilience=resilience, dp_algo=dp_algo, **finetune_configs(values),
    )  # fmt: skip


def finetune_configs(values: dict) -> dict:
    """``lora`` and ``qat`` of a RunConfig from the flags (ValueError on bad ones)."""
    from plait.cli_args import lora_config
    from plait.model.quant import QuantConfig

    out = {}
    if (lora := lora_config(values)) is not None:
        out["lora"] = lora
    if values.get("quant_group_size") is not None and values.get("qat") != "int4":
        raise ValueError("--quant-group-size applies to --qat int4")
    if values.get("qat"):
        group = values.get("quant_group_size")
        out["qat"] = QuantConfig(dtype=values["qat"], **({"group_size": group} if group else {}))
    return out


def _hf_model(values: dict):
    """The model of ``--init-hf DIR``; a size flag that disagrees with it is an error."""
    from plait.cli_args import MODEL_FLAGS
    from plait.model import hf

    model = hf.read_config(values["init_hf"])
    for flag, name in [*MODEL_FLAGS.items(), ("arch", "arch")]:
        given = values.get(flag)
        if given is not None and given != getattr(model, name) and flag != "vocab_size":
            raise UserError(
                f"--{flag.replace('_', '-')} {given} disagrees with --init-hf "
                f"{values['init_hf']} ({name} {getattr(model, name)}); drop the flag"
            )
    return model


def cmd_train(args, parser) -> int:
    from plait.data import DataError
    from plait.train import checkpoint, launch

    previous = signal.signal(signal.SIGTERM, launch.raise_terminated)
    cfg = lock = None
    try:
        values = merged_values(args, parser, run=True)
        values.setdefault("dtype", None)
        if values["dtype"] is None:  # bf16 where GPUs want it, fp32 on a CPU
            values["dtype"] = _default_train_dtype()
        cfg = build_run_config(values)
        if values.get("dry_run"):
            if cfg.train.resume:
                _check_resume(cfg)
            return _dry_run(cfg)
        _check_gpu_peak(cfg)
        from plait.train import run_folder

        # before anything is read from or written to the folder, and before the data
        lock = run_folder.claim(Path(cfg.out), node_rank=values.get("node_rank") or 0)
        if cfg.train.resume:
            _check_resume(cfg)
        _train(cfg, values)
    except (KeyboardInterrupt, launch.Terminated) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        if cfg is None:
            what = "interrupted" if signum == signal.SIGINT else "terminated"
            return _die("train", f"{what} ({signal.Signals(signum).name})", code=128 + signum)
        return _die("train", launch.stopped_line(signum, Path(cfg.out)), code=128 + signum)
    except (UserError, ValueError, DataError, checkpoint.CheckpointError) as e:
        return _die("train", str(e).strip().splitlines()[0])
    except launch.LaunchError as e:
        if e.detail:  # the worker could not write its log: the detail once, here
            print(e.detail.rstrip(), file=sys.stderr)
        return _die("train", str(e), code=e.code)
    finally:
        if lock is not None:
            lock.release(remove_if_unused=True)
        signal.signal(signal.SIGTERM, previous)
    return 0


def _default_train_dtype() -> str:
    import torch

    return "bf16" if torch.cuda.is_available() else "fp32"


def _check_gpu_peak(cfg) -> None:
    """On a GPU plait has no peak for, ask for --peak-tflops now (MFU needs it), not from
    every worker after the data is prepared."""
    import torch

    if torch.cuda.is_available() and not cfg.train.peak_tflops:
        from plait.train.metrics import gpu_peak

        gpu_peak(torch.cuda.get_device_name(0), cfg.layout.dtype)


def _check_resume(cfg) -> None:
    """Before anything else: a checkpoint to resume from exists, its files have the sizes
    its manifest lists (the workers check the digests), and it is of this model."""
    from plait.train import checkpoint

    root = Path(cfg.out) / "checkpoints"
    path, _ = checkpoint.pick_resume(root, cfg.train.resume_from, hashes=False)
    meta = checkpoint.read_meta(path)
    if meta.get("model") and meta["model"] != {**cfg.model.to_dict(), **_vocab_of(meta)}:
        raise UserError(
            f"--resume: checkpoint {path} is of a different model; "
            "use the same model flags or another --out"
        )


def _train(cfg, values: dict) -> None:
    """Prepare the data, write config.yaml, run the workers and report."""
    from plait.data import prepare
    from plait.train.launch import launch

    out = Path(cfg.out)
    print(f"plait: preparing data ({cfg.data.path or 'embedded corpus'}) ...", flush=True)
    data = prepare(cfg.data, log=lambda m: print(f"  {m}", flush=True))
    if cfg.train.init_hf and data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise UserError(
            f"--init-hf {cfg.train.init_hf}: the model has {cfg.model.vocab_size} tokens "
            f"but the tokenizer ({cfg.data.tokenizer}) has {data.tokenizer.vocab_size}; "
            "use the data and tokenizer it was trained with"
        )
    cfg = _with_vocab(cfg, data.tokenizer.vocab_size)
    seq_need = cfg.model.seq_len + 1
    if len(data.val) < seq_need:
        raise UserError(
            f"--data: the held-out split has {len(data.val)} tokens but a sequence needs "
            f"{seq_need}; give more text or a larger --val-fraction"
        )
    cfg.save(out / "config.yaml")
    lay = cfg.layout
    print(
        f"plait: training {values.get('model') or 'tiny'} ({cfg.model.arch}) on "
        f"dp={lay.dp} tp={lay.tp} pp={lay.pp} for {cfg.train.steps} steps -> {out}",
        flush=True,
    )
    launch(
        cfg,
        nnodes=values.get("nnodes") or 1,
        node_rank=values.get("node_rank") or 0,
        rdzv_endpoint=values.get("rdzv_endpoint"),
    )
    if (values.get("node_rank") or 0) == 0:
        _report(cfg)


def _vocab_of(meta: dict) -> dict:
    # The model's vocabulary comes from the tokenizer; compare everything else.
    return {"vocab_size": meta["model"].get("vocab_size")}


def _with_vocab(cfg, vocab: int):
    import dataclasses

    return dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=vocab))


def _dry_run(cfg) -> int:
    from plait.model.sizes import num_params
    from plait.model.transformer import build_model

    build_model(cfg.model, device="meta")
    n = num_params(cfg.model)
    lay = cfg.layout
    per_rank = _state_bytes(n, lay)
    print(
        f"plait train --dry-run: ok: {n:,} parameters, {lay.world_size} workers "
        f"(dp={lay.dp} tp={lay.tp} pp={lay.pp}), {lay.num_microbatches} micro-batches of "
        f"{lay.micro_batch_size}, ~{per_rank / 2**30:.2f} GiB model state per rank"
    )
    return 0


def _state_bytes(n_params: int, lay, model=None, lora=None) -> float:
    """Model-state bytes on one device: ZeRO stage, hybrid sharding and offload included."""
    return _state(n_params, lay, model, lora)["device"]


def _state(n_params: int, lay, model=None, lora=None) -> dict:
    """``sizes.model_state_breakdown`` for one rank; with LoRA the base counts as frozen."""
    from plait.model.sizes import model_state_breakdown

    per_rank = n_params / (lay.tp * lay.pp)
    trainable, frozen = per_rank, 0.0
    if lora is not None:
        from plait.model.lora import adapter_params_per_layer

        trainable = model.n_layers / lay.pp * adapter_params_per_layer(model, lora, lay.tp)
        frozen = per_rank
    return model_state_breakdown(
        round(trainable),
        dp=lay.zero_shard_group or lay.dp,
        zero=lay.zero,
        offload_optimizer=lay.offload_optimizer,
        frozen_params=round(frozen),
    )


def _report(cfg) -> None:
    import json

    from plait.generate import generate_text

    out = Path(cfg.out)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    last = records[-1] if records else {}
    # speed from the last step that measured it (a resilient run's step completed during
    # a failure is recorded from the survivors' statistics, without timings)
    timed = next((r for r in reversed(records) if "tokens_per_s" in r), None)
    if last:
        print(
            f"plait: done: step {last['step']}, train loss {last['loss']:.4f}"
            + (f", validation loss {val[-1]:.4f}" if val else "")
            + (f", {timed['tokens_per_s']:,.0f} tokens/s, MFU {timed['mfu']:.1%}" if timed else "")
        )
    try:
        text = generate_text(out, "def ", max_new_tokens=80)
        print("plait: sample:\n" + text)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded; a sample is a bonus
        print(f"plait: (no sample: {e})")
    print(f"plait: run folder {out}")


# --- other commands -------------------------------------------------------------------------


def cmd_export(args) -> int:
    """``plait export --run DIR``: the newest checkpoint as a Hugging Face model folder
    (``plait.export``: merged LoRA, PEFT adapter, quantised)."""
    from plait.export import ExportOptions, export
    from plait.train import checkpoint

    try:
        opts = ExportOptions(merge_lora=bool(args.merge_lora), adapter=bool(args.adapter),
                             quantize=args.quantize, group_size=args.quant_group_size)  # fmt: skip
        out, notes = export(Path(args.run), Path(args.out) if args.out else None, opts)
    except (UserError, ValueError, OSError, checkpoint.CheckpointError) as e:
        return _die("export", str(e).strip().splitlines()[0])
    print(f"wrote {out} ({notes[0]}): " + ", ".join(notes[1:]))
    return 0


def cmd_checkpoint_verify(args) -> int:
    """``plait checkpoint verify DIR``: every checkpoint of a run (or one checkpoint folder)
    against its manifest; one line per checkpoint, exit code 1 when one is damaged."""
    import time

    from plait.train import checkpoint, manifest

    target = Path(args.dir)
    if (target / manifest.NAME).exists() or target.name.startswith("step-"):
        folders = [target]
    else:
        root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
        folders = checkpoint.checkpoint_dirs(root)
    if not folders:
        return _die("checkpoint verify", f"{target}: no checkpoint there; give a run folder, "
                    "its checkpoints/ folder or one step-N folder")  # fmt: skip
    damaged = 0
    for folder in folders:
        t0 = time.perf_counter()
        problem = checkpoint.verify(folder)
        if problem is None:
            files = manifest.read(folder)
            size = sum(e["size"] for e in files.values())
            print(f"{folder}: ok ({len(files)} files, {size / 2**20:.1f} MiB, "
                  f"{manifest.HASH} checked in {time.perf_counter() - t0:.2f} s)")  # fmt: skip
        else:
            damaged += 1
            print(f"{folder}: damaged: {problem}")
    return 1 if damaged else 0


def cmd_report(args) -> int:
    from plait.viz.report import write_report

    try:
        page, png = write_report(Path(args.run), args.out)
    except (ValueError, OSError) as e:
        return _die("report", str(e).strip().splitlines()[0])
    print(f"wrote {page} and {png}")
    return 0


def cmd_generate(args) -> int:
    from plait.generate import generate_text

    try:
        text = generate_text(
            Path(args.run), args.prompt, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, seed=args.seed,
        )  # fmt: skip
    except (ValueError, OSError) as e:
        return _die("generate", str(e).strip().splitlines()[0])
    print(text)
    return 0


def cmd_info(args, parser) -> int:
    from plait.cli_args import layout_config, lora_config
    from plait.model.sizes import activation_bytes_per_layer, model_flops_per_token, num_params

    try:
        values = merged_values(args, parser)
        model = model_config(values)
        layout = layout_config(values)
        layout.check_model(model)
        lora = lora_config(values)
        if lora is not None:
            lora.check_model(model)
    except (UserError, ValueError) as e:
        return _die("info", str(e).strip().splitlines()[0])
    n = num_params(model)
    print(f"model {values.get('model') or 'tiny'} ({model.arch})")
    for k, v in model.to_dict().items():
        print(f"  {k:<12} {v}")
    print(f"parameters           {n:,} ({n / 1e9:.3f} B)")
    flops = model_flops_per_token(model)
    if lora is not None:
        from plait.model.lora import model_flops_per_token as lora_flops
        from plait.model.lora import num_adapter_params

        flops = lora_flops(model, lora)
        t = num_adapter_params(model, lora)
        print(f"trainable            {t:,} ({t / n:.2%}): LoRA r={lora.rank} on "
              f"{','.join(lora.targets)}, base frozen")  # fmt: skip
    print(f"FLOPs per token      {flops:.4g} (training, model FLOPs)")
    st = _state(n, layout, model, lora)
    gib = 2**30
    print(
        f"model state per rank {st['device'] / gib:.3f} GiB on the device: weights "
        f"{st['params'] / gib:.3f}, gradients {st['grads'] / gib:.3f}, optimizer "
        f"{st['optim'] / gib:.3f} (fp32 weights+grads, AdamW; tp={layout.tp} pp={layout.pp} "
        f"dp={layout.dp} zero={layout.zero}"
        + (", LoRA" if lora else "")
        + ")"
        + (f"; host {st['host'] / gib:.3f}" if st["host"] else "")
    )
    act = activation_bytes_per_layer(
        model, micro_batch_size=layout.micro_batch_size, tp=layout.tp,
        sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
        act_bytes=4 if layout.dtype == "fp32" else 2,
    ) * model.n_layers / layout.pp  # fmt: skip
    print(
        f"activations per rank {act / gib:.3f} GiB per micro-batch in flight "
        f"({layout.micro_batch_size} x {model.seq_len} tokens, {layout.dtype}, "
        f"recompute={layout.recompute}; blocks only, Korthikanti et al. 2022)"
    )
    return 0


def _add_simulate(sub):
    p = sub.add_parser("simulate", parents=[model_parent(), layout_parent(), lora_parent(),
                                                     dp_algo_parent()],
                       allow_abbrev=False,
                       help="predict step time, MFU and memory of a layout")  # fmt: skip
    p.add_argument("--config", help="YAML or TOML file of flag values")
    from plait.commands import simulate as sim_cli

    sim_cli.add_arguments(p)
    return p, sim_cli


def _add_viz(sub):
    p = sub.add_parser("viz", allow_abbrev=False, help="draw schedules, timelines and curves")
    from plait.viz import cli as viz_cli

    viz_cli.add_arguments(p)
    return p, viz_cli


def _add_plan(sub):
    p = sub.add_parser("plan", parents=[model_parent(), layout_parent(), dp_algo_parent()],
                       allow_abbrev=False,
                       help="rank every layout of a model on a cluster; write the best")  # fmt: skip
    p.add_argument("--config", help="YAML or TOML file of flag values")
    from plait.commands import plan

    plan.add_arguments(p)
    return p


def _add_calibrate(sub):
    p = sub.add_parser("calibrate", allow_abbrev=False,
                       help="measure this machine; write a hardware file for simulate and plan")  # fmt: skip
    from plait.commands import calibrate

    calibrate.add_arguments(p)
    return p


def make_parser():
    parser = argparse.ArgumentParser(prog="plait", allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = _add_train(sub)
    gen = sub.add_parser("generate", allow_abbrev=False, help="sample from a trained run")
    gen.add_argument("--run", required=True, help="run folder written by plait train")
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--seed", type=int, default=0)
    exp = sub.add_parser("export", allow_abbrev=False,
                         help="write a run's newest checkpoint as a Hugging Face model folder")  # fmt: skip
    exp.add_argument("--run", required=True, help="run folder written by plait train")
    exp.add_argument("--out", help="folder to write (default RUN/hf)")
    exp.add_argument("--merge-lora", action="store_true",
                     help="a LoRA run: fold the adapters into the weights")  # fmt: skip
    exp.add_argument("--adapter", action="store_true",
                     help="a LoRA run: the base model, and the adapter in PEFT's format in "
                     "OUT/adapter")  # fmt: skip
    exp.add_argument("--quantize", choices=("int8", "int4"),
                     help="weight-only quantisation of the block linears (torchao); reports "
                     "the validation perplexity change")  # fmt: skip
    exp.add_argument("--quant-group-size", type=int, metavar="G",
                     help="int4: input features per scale (default: the run's, else 32)")  # fmt: skip
    ckpt = sub.add_parser("checkpoint", allow_abbrev=False, help="check a run's checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = ckpt_sub.add_parser("verify", allow_abbrev=False,
                                 help="check every file of each checkpoint against its manifest")  # fmt: skip
    verify.add_argument(
        "dir", metavar="DIR", help="a run folder, its checkpoints/ or a step-N folder"
    )
    rep = sub.add_parser("report", allow_abbrev=False,
                         help="one self-contained HTML page (and a PNG) about a run")  # fmt: skip
    rep.add_argument("run", metavar="RUN", help="run folder written by plait train")
    rep.add_argument("--out", help="HTML file to write (default RUN/report.html)")
    info = sub.add_parser("info", parents=[model_parent(), layout_parent(), lora_parent(),
                                                  dp_algo_parent()],
                          allow_abbrev=False,
                          help="sizes, FLOPs and memory of a model")  # fmt: skip
    info.add_argument("--config", help="YAML or TOML file of flag values")
    simulate, sim_cli = _add_simulate(sub)
    viz, viz_cli = _add_viz(sub)
    plan, calibrate = _add_plan(sub), _add_calibrate(sub)
    return (
        parser,
        {
            "train": train,
            "info": info,
            "simulate": simulate,
            "viz": viz,
            "plan": plan,
            "calibrate": calibrate,
        },  # fmt: skip
        sim_cli,
        viz_cli,
    )


def main(argv=None) -> int:
    parser, subs, sim_cli, viz_cli = make_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        return cmd_train(args, subs["train"])
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "export":
        return cmd_export(args)
    if args.command == "checkpoint":
        return cmd_checkpoint_verify(args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "info":
        return cmd_info(args, subs["info"])
    if args.command == "simulate":
        try:  # a config file's values where no flag is given
            args = argparse.Namespace(**{**vars(args), **merged_values(args, subs["simulate"])})
        except UserError as e:
            return _die("simulate", str(e))
        return sim_cli.run(args)
    if args.command == "plan":
        from plait.commands import plan

        try:
            return plan.run(args, merged_values(args, subs["plan"]))
        except UserError as e:
            return _die("plan", str(e))
    if args.command == "calibrate":
        from plait.commands import calibrate

        return calibrate.run(args)
    if args.command == "viz":
        return viz_cli.run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
