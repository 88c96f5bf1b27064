"""``plait train``: check the flags, build the run's config, start dp x tp x pp workers,
and report.

    plait train --model tiny --steps 200           # the embedded corpus, one worker
    plait train --config run.yaml --dp 2 --tp 2    # a config file; flags override it
    plait train ... --dry-run                      # validate, build on meta, say if it fits
    plait train --out runs/x --resume              # from its newest checkpoint
    plait train ... --skip-memory-check            # start even if the estimate does not fit

Communication: none in this process. ``plait.train.launch`` starts the workers, whose
collectives are theirs (``train/loop.py`` and ``parallel/``).

The flags only override config fields (``cli_args`` converts them); ``build_run_config``
makes the ``RunConfig`` the workers read from ``config.yaml``. A run stopped by Ctrl-C
exits 130, by SIGTERM 143; errors a user can cause print one line and return 2.

The memory check (``memory_fit``), before any worker starts and before the data is
prepared: the fullest rank's estimated peak (``plait simulate``'s memory model, exact
for even pipeline stages) against the device's memory -- on a CPU, the host's
MemAvailable over the workers started on it. A layout that does not fit is refused in
one line with the estimate, the limit and the fastest layout of as many workers that fits
(``plan``'s search); ``--dry-run`` says "does not fit" (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from plait.cli_args import model_config, model_layout_parser
from plait.commands.common import TRUST_HELP, UserError, die, merged_values
from plait.commands.prepare import add_data_flags

DATA_FLAGS = {"data": "path", "tokenizer": "tokenizer", "cache_dir": "cache_dir",
              "val_fraction": "val_fraction", "text_column": "text_column"}  # fmt: skip


def add_parser(sub) -> argparse.ArgumentParser:
    p = model_layout_parser(
        sub, "train", config_help="YAML or TOML file of flag values (flags override it)",
        help="train a model", description="Train a model (starts dp x tp x pp workers).",
    )  # fmt: skip
    add_train_arguments(p)
    return p


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``plait train`` beyond the model and layout (``plait rehearse`` takes
    them too)."""
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
    g.add_argument("--profile", metavar="A:B",
                   help="torch.profiler over steps A to B: OUT/profile/rank-K.json (Chrome "
                   "trace) and rank-K.txt (operators and kernels by device time)")  # fmt: skip
    g = p.add_argument_group("data and output")
    add_data_flags(g)
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
    g.add_argument("--skip-memory-check", action="store_true", default=None,
                   help="start even if the estimated peak memory per rank exceeds the "
                   "device's (or, on a CPU, the host's available memory per worker)")  # fmt: skip
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``plait train``; ``parser`` is its subparser (the keys a ``--config`` file may hold)."""
    from plait.errors import CheckpointError, DataError
    from plait.train import launch

    previous = signal.signal(signal.SIGTERM, launch.raise_terminated)
    cfg = lock = None
    try:
        values = merged_values(args, parser, run=True)
        values.setdefault("dtype", None)
        # bad flags, missing data and nothing to resume from refused before torch loads
        _check_inputs(build_run_config({**values, "dtype": values["dtype"] or "fp32"}))
        if values["dtype"] is None:  # bf16 where GPUs want it, fp32 on a CPU
            values["dtype"] = _default_train_dtype()
        cfg = build_run_config(values)
        nnodes = values.get("nnodes") or 1
        fit = None if values.get("skip_memory_check") else memory_fit(cfg, nnodes=nnodes)
        if values.get("dry_run"):
            return _dry_run(cfg, fit)
        if fit is not None and not fit.fits:  # before any worker, and before the data
            raise UserError(fit.refusal())
        _check_gpu_peak(cfg)
        from plait.train import run_folder

        # before anything is read from or written to the folder, and before the data
        lock = run_folder.claim(Path(cfg.out), node_rank=values.get("node_rank") or 0)
        if cfg.train.resume:
            _check_resume(cfg)
        elif not values.get("node_rank"):  # node 0 writes the run's records
            _check_fresh_out(Path(cfg.out))
        _train(cfg, values)
    except (KeyboardInterrupt, launch.Terminated) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        if cfg is None:
            what = "interrupted" if signum == signal.SIGINT else "terminated"
            return die("train", f"{what} ({signal.Signals(signum).name})", code=128 + signum)
        return die("train", launch.stopped_line(signum, Path(cfg.out)), code=128 + signum)
    except (UserError, ValueError, DataError, CheckpointError) as e:
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
    vpp = values.get("vpp", 1)
    if min(g, dp, pp, vpp) < 1:  # Layout names the flag
        return
    want = 1 if pp == 1 else 2 * pp * vpp
    values["micro_batch_size"] = g // (dp * want) if g % (dp * want) == 0 else 1


def build_run_config(values: dict):
    """RunConfig from merged flag values; ValueError (one line) on bad input."""
    from plait.cli_args import dp_algo_config, layout_config
    from plait.data import DataConfig
    from plait.train.config import TRAIN_FIELDS, RunConfig, TrainConfig

    values = dict(values)
    nnodes, node = values.get("nnodes"), values.get("node_rank")
    if nnodes is not None and nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
    if node is not None and not 0 <= node < (nnodes or 1):
        raise ValueError(f"--node-rank {node}: the nodes of --nnodes {nnodes or 1} are "
                         f"numbered 0 to {(nnodes or 1) - 1}")  # fmt: skip
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
        if data_fields.get("tokenizer") == "bytes" and values["vocab_size"] != 256:
            raise ValueError(f"--vocab-size {values['vocab_size']}: --tokenizer bytes has 256 "
                             "ids; leave --vocab-size out (it sizes a bpe tokenizer)")  # fmt: skip
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
    from plait.model.quant_config import QuantConfig

    out = {}
    if (lora := lora_config(values)) is not None:
        out["lora"] = lora
    if values.get("quant_group_size") is not None and values.get("qat") != "int4":
        raise ValueError("--quant-group-size applies to --qat int4")
    if values.get("qat"):
        group = values.get("quant_group_size")
        out["qat"] = QuantConfig(dtype=values["qat"],
                                 **({"group_size": group} if group is not None else {}))  # fmt: skip
    return out


def _hf_model(values: dict):
    """The model of ``--init-hf DIR``; a size flag that disagrees with it is an error. The
    weights' files are opened here too (their headers: every tensor the model needs, of
    its shape), so that a folder that cannot serve is one line before any worker starts."""
    from plait.cli_args import MODEL_FLAGS
    from plait.model import hf
    from plait.model.config import FLAVOURS

    model = hf.HFWeights(values["init_hf"]).cfg
    for flag, name in [*MODEL_FLAGS.items(), ("arch", "arch")]:
        given = values.get(flag)
        if flag == "arch" and given in FLAVOURS:  # --arch llama3 names the llama arch
            given = FLAVOURS[given]["arch"]
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


def _check_inputs(cfg) -> None:
    """What --data names exists and, with --resume, there is a checkpoint of this model to
    resume from: torch-free, so these answer in well under a second."""
    from plait.data.sources import check_exist

    if cfg.data.path is not None:
        check_exist(cfg.data.path)
    if cfg.train.resume:
        _check_resume(cfg)


def _check_fresh_out(out: Path) -> None:
    """Without --resume, --out must not hold a run already: a new run would write its
    metrics and checkpoints over the old one's, leaving a mix of the two."""
    steps = sorted((out / "checkpoints").glob("step-*")) if (out / "checkpoints").is_dir() else []
    metrics = out / "metrics.jsonl"
    if steps or (metrics.is_file() and metrics.stat().st_size):
        held = f"checkpoints up to {steps[-1].name}" if steps else "metrics.jsonl"
        raise UserError(f"--out {out} already holds a run ({held}); --resume continues it, "
                        "or name a new --out")  # fmt: skip


def _check_resume(cfg) -> None:
    """Before anything else: a checkpoint to resume from exists, its files have the sizes
    its manifest lists (the workers check the digests), and it is of this model."""
    from plait.train import checkpoint_files

    root, trust = Path(cfg.out) / "checkpoints", cfg.train.trust_checkpoint
    path, _ = checkpoint_files.pick_resume(
        root, cfg.train.resume_from,
        check=lambda p: checkpoint_files.verify_files(p, hashes=False, trust=trust),
    )  # fmt: skip
    meta = checkpoint_files.read_meta(path)
    if meta.get("model") and meta["model"] != {**cfg.model.to_dict(), **_vocab_of(meta)}:
        raise UserError(
            f"--resume: checkpoint {path} is of a different model; "
            "use the same model flags or another --out"
        )


def _train(cfg, values: dict) -> None:
    """Prepare the data, write config.yaml, run the workers and report."""
    from plait.data import check_held_out, prepare
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
    if cfg.layout.document_mask and data.tokenizer.eot_id is None:
        raise UserError(
            f"--document-mask: the tokenizer ({cfg.data.tokenizer}) has no end-of-text "
            "token to find documents by; use one that has (bpe, bytes) or drop the flag"
        )
    cfg = _with_vocab(cfg, data.tokenizer.vocab_size)
    check_held_out(data, cfg.model.seq_len)  # of each source of a mixture
    cfg.save(out / "config.yaml")
    lay = cfg.layout
    print(
        f"plait: training {values.get('model') or 'tiny'} ({cfg.model.arch}) on "
        f"dp={lay.dp} tp={lay.tp} pp={lay.pp}"
        + (f" cp={lay.cp}" if lay.cp > 1 else "")
        + (f" ep={lay.ep}" if lay.ep > 1 else "")
        + f" for {cfg.train.steps} steps -> {out}",
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


def _dry_run(cfg, fit: MemoryFit | None) -> int:
    """Validate and build on meta; say whether the estimated peak fits (exit 2 if not)."""
    from plait.model.sizes import num_params
    from plait.model.transformer import build_model
    from plait.sim.memory import average_model_state

    build_model(cfg.model, device="meta")
    n = num_params(cfg.model)
    lay = cfg.layout
    # with LoRA the frozen base keeps no gradients or optimizer state (as plait info says)
    per_rank = average_model_state(cfg.model, lay, cfg.lora)["device"]
    verdict = "ok" if fit is None or fit.fits else "does not fit"
    line = (
        f"plait train --dry-run: {verdict}: {n:,} parameters, {lay.world_size} workers "
        f"(dp={lay.dp} tp={lay.tp} pp={lay.pp}), {lay.num_microbatches} micro-batches of "
        f"{lay.micro_batch_size}, ~{per_rank / 2**30:.2f} GiB model state per rank"
    )
    if fit is None:
        print(line)
        return 0
    print(f"{line}; {fit.summary()}" + ("" if fit.fits else f"; {fit.advice()}"))
    return 0 if fit.fits else 2


# -- the memory check ---------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryFit:
    """A run's estimated peak memory per rank against what this machine gives each.

    ``estimate``: ``plait simulate``'s peak (``sim.memory.memory_per_rank``: model
    state, the schedule's activations at the micro-batch size, ZeRO-3's buffers, the
    framework's overhead) of the fullest rank; ``limit``: the device's memory, or on a CPU
    the host's available memory divided among the workers started here; ``nearest``: the
    fastest layout of as many workers that fits (``plan``'s search), as flags, or None."""

    estimate: float
    limit: float
    where: str  # what the limit is
    nearest: str | None = None

    @property
    def fits(self) -> bool:
        return self.estimate <= self.limit

    def summary(self) -> str:
        return f"peak ~{_size(self.estimate)} per rank estimated, {_size(self.limit)} {self.where}"

    def advice(self) -> str:
        if self.nearest is None:
            return "no layout of as many workers fits: use more workers, a smaller model or a shorter --seq-len"
        return f"nearest layout that fits: {self.nearest}"

    def refusal(self) -> str:
        return (
            f"does not fit: {self.summary()}; {self.advice()} "
            "(or --skip-memory-check to start anyway)"
        )


GiB = 2**30


def _size(nbytes: float) -> str:
    """Bytes as GiB, or MiB below one GiB (a host's memory over 1,024 workers is not 0.0)."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.0f} MiB"


def memory_fit(cfg, *, nnodes: int = 1) -> MemoryFit | None:
    """``MemoryFit`` of ``cfg`` on this machine (the nearest layout only when it does not
    fit); None where the limit is unknown (no /proc/meminfo) or the simulator cannot
    model the run."""
    from plait.sim.runtime import get_runtime
    from plait.sim.simulate import simulate

    local = max(1, cfg.layout.world_size // nnodes)
    device = _local_device(local)
    if device is None:
        return None
    hw, where = device
    algo = None if cfg.dp_algo.algo == "allreduce" and cfg.dp_algo.compress is None else cfg.dp_algo
    try:
        rt = dataclasses.replace(get_runtime("plait"), qat=cfg.qat is not None)
        res = simulate(cfg.model, cfg.layout, hw, runtime=rt, exact=False, lora=cfg.lora,
                       dp_algo=algo)  # fmt: skip
    except ValueError:  # a run the model does not cover: no check rather than a wrong one
        return None
    fit = MemoryFit(res.peak_mem_bytes, hw.memory_bytes, where)
    if fit.fits:
        return fit
    return dataclasses.replace(fit, nearest=_nearest_fit(cfg, hw, algo))


def _local_device(workers: int):
    """(hardware entry with this machine's memory per rank, what that memory is), or None.
    A GPU: its total memory (``get_device_properties``: ``mem_get_info`` would keep a
    CUDA context on it in this process for the whole run). A CPU: MemAvailable over the
    ``workers`` started here."""
    import torch

    from plait.sim.hardware import BUILTIN, DEFAULT_GPU, gpu_peak_flops, host_mem_available

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        peaks = gpu_peak_flops(name)
        base = next((h for h in BUILTIN.values() if h.peak_flops == peaks), BUILTIN[DEFAULT_GPU])
        total = torch.cuda.get_device_properties(0).total_memory
        return dataclasses.replace(base, memory_bytes=total), f"on the {name}"
    available = host_mem_available()
    if available is None:
        return None
    each = available / workers
    return dataclasses.replace(BUILTIN["cpu"], memory_bytes=each), (
        f"available (the host's MemAvailable over {workers} worker{'s' * (workers > 1)})"
    )


def _nearest_fit(cfg, hw, algo) -> str | None:
    """The fastest layout of ``cfg``'s workers that fits ``hw`` (``plan``'s search), as
    flags; None if none does."""
    from plait.sim.search import PlanRequest, search, space_for

    lay = cfg.layout
    try:
        plan = search(PlanRequest(
            model=cfg.model, hardware=hw, n_devices=lay.world_size,
            global_batch_size=lay.global_batch_size, dtype=lay.dtype, runtime="plait",
            space=space_for("plait"), top_k=1, exact=False, dp_algo=algo,
        ))  # fmt: skip
    except ValueError:  # nothing fits
        return None
    c = plan.best.candidate
    flags = [f"--dp {c.dp}", f"--tp {c.tp}", f"--pp {c.pp}"]
    if c.pp > 1:
        flags += [f"--vpp {c.vpp}"] * (c.vpp > 1) + [f"--schedule {c.schedule}"]
    flags += [f"--zero {c.zero}"] + [f"--zero-shard-group {c.shard}"] * (c.shard > 0)
    flags += [f"--micro-batch-size {c.micro_batch_size}"]
    flags += ["--sequence-parallel"] * c.sequence_parallel + [f"--recompute {c.recompute}"]
    flags += [f"--recompute-layers {c.recompute_layers}"] * (c.recompute_layers > 0)
    return f"{' '.join(flags)} (~{plan.best.result.peak_mem_bytes / GiB:.1f} GiB)"


SAMPLE_PROMPT, SAMPLE_TOKENS = "def ", 80
SAMPLE_BUDGET_S = 10.0  # the end-of-run sample shows the weights load and speak; no more


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
    why_not = _sample_too_big(cfg)
    if why_not:
        print(f"plait: (no sample: {why_not}; `plait generate --run {out}` samples it)")
    else:
        try:
            text = generate_text(out, SAMPLE_PROMPT, max_new_tokens=SAMPLE_TOKENS)
            print("plait: sample:\n" + text)
        except Exception as e:  # noqa: BLE001 - the run itself succeeded; a sample is a bonus
            print(f"plait: (no sample: {e})")
    print(f"plait: run folder {out}")


def _sample_too_big(cfg, available: float | None = None) -> str | None:
    """Why the end-of-run sample is skipped, or None. It loads the whole model into this
    (the launcher's) process and runs it on the CPU, so it is taken only where that is
    cheap: the weights in fp32 within half the host's MemAvailable, and the sampling's
    FLOPs -- ``SAMPLE_TOKENS`` forward passes without a KV cache, 2 per weight per token
    of a context that grows to the prompt plus the new tokens -- within ``SAMPLE_BUDGET_S``
    at the ``cpu`` preset's peak per thread. A 175B run never gathers its model here."""
    import torch

    from plait.model.sizes import num_params
    from plait.sim import hardware

    n = num_params(cfg.model)
    available = hardware.host_mem_available() if available is None else available
    if available is not None and 4 * n > available / 2:
        return f"{n / 1e9:.1f}B parameters are more than half this host's available memory"
    context = sum(min(len(SAMPLE_PROMPT) + i, cfg.model.seq_len) for i in range(SAMPLE_TOKENS))
    rate = hardware.BUILTIN["cpu"].peak_flops.fp32 * torch.get_num_threads()
    seconds = 2 * n * context / rate
    if seconds > SAMPLE_BUDGET_S:
        return f"{n / 1e9:.1f}B parameters would take ~{seconds:.0f} s on this host's CPU"
    return None
