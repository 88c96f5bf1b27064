"""``plait train``: check the flags, build the run's config, start dp x tp x pp workers,
and report.

    plait train --model tiny --steps 200           # the embedded corpus, one worker
    plait train --config run.yaml --dp 2 --tp 2    # a config file; flags override it
    plait train ... --dry-run                      # validate, build on meta, stop
    plait train --out runs/x --resume              # from its newest checkpoint

Communication: none in this process. ``plait.train.launch`` starts the workers, whose
collectives are theirs (``train/loop.py`` and ``parallel/``).

The flags only override config fields (``cli_args`` converts them); ``build_run_config``
makes the ``RunConfig`` the workers read from ``config.yaml``. A run stopped by Ctrl-C
exits 130, by SIGTERM 143; errors a user can cause print one line and return 2.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
from pathlib import Path

from plait.cli_args import model_config, model_layout_parser
from plait.commands.common import TRUST_HELP, UserError, die, merged_values

DATA_FLAGS = {"data": "path", "tokenizer": "tokenizer", "cache_dir": "cache_dir",
              "val_fraction": "val_fraction"}  # fmt: skip


def add_parser(sub) -> argparse.ArgumentParser:
    p = model_layout_parser(
        sub, "train", config_help="YAML or TOML file of flag values (flags override it)",
        help="train a model", description="Train a model (starts dp x tp x pp workers).",
    )  # fmt: skip
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
    g.add_argument("--trust-checkpoint", metavar="PATH", help=TRUST_HELP)
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``plait train``; ``parser`` is its subparser (the keys a ``--config`` file may hold)."""
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
            return die("train", f"{what} ({signal.Signals(signum).name})", code=128 + signum)
        return die("train", launch.stopped_line(signum, Path(cfg.out)), code=128 + signum)
    except (UserError, ValueError, DataError, checkpoint.CheckpointError) as e:
        return die("train", str(e).strip().splitlines()[0])
    except launch.LaunchError as e:
        if e.detail:  # the worker could not write its log: the detail once, here
            from plait.errors import printable

            print(printable(e.detail.rstrip(), lines=True), file=sys.stderr)
        return die("train", str(e), code=e.code)
    finally:
        if lock is not None:
            lock.release(remove_if_unused=True)
        signal.signal(signal.SIGTERM, previous)
    return 0


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
    path, _ = checkpoint.pick_resume(root, cfg.train.resume_from, hashes=False,
                                     trust=cfg.train.trust_checkpoint)  # fmt: skip
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
    from plait.sim.memory import average_model_state

    build_model(cfg.model, device="meta")
    n = num_params(cfg.model)
    lay = cfg.layout
    # with LoRA the frozen base keeps no gradients or optimizer state (as plait info says)
    per_rank = average_model_state(cfg.model, lay, cfg.lora)["device"]
    print(
        f"plait train --dry-run: ok: {n:,} parameters, {lay.world_size} workers "
        f"(dp={lay.dp} tp={lay.tp} pp={lay.pp}), {lay.num_microbatches} micro-batches of "
        f"{lay.micro_batch_size}, ~{per_rank / 2**30:.2f} GiB model state per rank"
    )
    return 0


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
