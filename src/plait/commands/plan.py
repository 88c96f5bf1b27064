"""``plait plan``: search every parallel layout of a model on a cluster, rank them by
predicted step time, and write the winner as a ``plait train --config`` file.

    plait plan --model llama-65b --gpu a100-80gb --gpus 2048 --global-batch-size 2048 \\
        --tokens 1.4T
    plait plan --model gpt3-175b --gpu a100-80gb --gpus 1024 --global-batch-size 1536 \\
        --tokens 300B --runtime megatron-lm --recompute full --dtype fp16
    plait plan ... --json              # the ranked list, each with plait simulate --json figures
    plait plan --gpus 4096 --gpu h100-sxm --global-batch-size 1024 --budget-gpu-days 200000
    plait plan --hardware calibrated.yaml --gpus 4 --model tiny --global-batch-size 16

The search space and the method (exhaustive best-first branch and bound over the
simulator's closed form, winners replayed exactly) are described in ``sim/search.py``.
Every layout flag (``--tp 8``, ``--schedule 1f1b``, ``--zero 1``) pins that axis;
``--runtime`` narrows the space to what that software can run. The parser is
``cli_args``' model, layout and data-parallel flags plus ``add_arguments`` below
(``add_parser``); ``run`` reads a ``--config`` file under the flags. Errors a user can
cause print one line and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from plait.cli_args import model_layout_parser
from plait.commands.common import die, merged_values
from plait.sim.devices import default_dtype
from plait.sim.hardware import BUILTIN, DEFAULT_GPU
from plait.sim.runtime import DEFAULT_RUNTIME, PROFILES

GiB = 2**30

# -- the config file -------------------------------------------------------------------------

SIZE_KEYS = {  # ModelConfig field -> plait train flag
    "arch": "arch",
    "n_layers": "layers",
    "hidden": "hidden",
    "n_heads": "heads",
    "n_kv_heads": "kv-heads",
    "ffn_hidden": "ffn-hidden",
    "vocab_size": "vocab-size",
    "seq_len": "seq-len",
}


def config_text(entry, model, preset_name: str | None, header: str, dp_algo=None) -> str:
    """The ``plait train --config`` YAML of ``entry`` (a ``sim.search.Entry``) for ``model``:
    flat keys named like the flags; the model as its preset name plus the sizes that
    differ from it (every size when there is no preset)."""
    import yaml

    from plait.model.config import preset

    out: dict = {}
    if preset_name:
        out["model"] = preset_name
        base = preset(preset_name, arch=model.arch).to_dict()
    else:
        base = {}
    if preset_name:  # the flavour is the preset's own unless it differs
        base["arch"] = preset(preset_name).arch
    for fieldname, key in SIZE_KEYS.items():
        value = getattr(model, fieldname)
        if base.get(fieldname) != value:
            out[key] = value
    lay = entry.layout
    out.update({
        "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "schedule": lay.schedule,
        "micro-batch-size": lay.micro_batch_size, "global-batch-size": lay.global_batch_size,
        "zero": lay.zero, "sequence-parallel": lay.sequence_parallel,
        "recompute": lay.recompute,
    })  # fmt: skip
    if lay.recompute_layers is not None:
        out["recompute-layers"] = lay.recompute_layers
    out["dtype"] = lay.dtype
    if lay.zero_shard_group is not None:
        out["zero-shard-group"] = lay.zero_shard_group
    if lay.cp > 1:
        out.update({"cp": lay.cp, "cp-mode": lay.cp_mode})
    if lay.ep > 1:
        out["ep"] = lay.ep
    if dp_algo is not None:  # --dp-algo / --compress as planned: the fields set
        default = type(dp_algo)().to_dict()
        for k, v in dp_algo.to_dict().items():
            if v != default[k]:
                out["dp-algo" if k == "algo" else k.replace("_", "-")] = v
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(out, sort_keys=False)


# -- command line ----------------------------------------------------------------------------


def add_parser(sub) -> argparse.ArgumentParser:
    p = model_layout_parser(sub, "plan", lora=False,
                            help="rank every layout of a model on a cluster; write the best")  # fmt: skip
    add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster and goal")
    g.add_argument("--gpu", choices=list(BUILTIN), default=None,
                   help=f"built-in hardware (default {DEFAULT_GPU})")  # fmt: skip
    g.add_argument("--hardware", metavar="FILE", default=None,
                   help="hardware spec (YAML, e.g. from plait calibrate)")  # fmt: skip
    g.add_argument("--gpus", type=int, default=None, help="devices in all")
    g.add_argument("--runtime", choices=list(PROFILES), default=None,
                   help=f"software modelled; narrows the search (default {DEFAULT_RUNTIME})")  # fmt: skip
    g.add_argument("--global-batch-tokens", metavar="T", default=None,
                   help="global batch in tokens (instead of --global-batch-size sequences)")  # fmt: skip
    g.add_argument("--tokens", metavar="T", default=None,
                   help="train on T tokens (300B, 1.4T): adds days and device-hours")  # fmt: skip
    g.add_argument("--budget-gpu-days", metavar="D", type=float, default=None,
                   help="propose a Chinchilla-optimal model and tokens for D device-days")  # fmt: skip
    g = parser.add_argument_group("search")
    g.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    g.add_argument("--max-tp", type=int, default=None, help="default: devices per node")
    g.add_argument("--max-vpp", type=int, default=8, help="model chunks per rank (default 8)")
    g.add_argument("--max-cp", type=int, default=16,
                   help="context-parallel ranks, searched from --seq-len 8192 (default 16)")  # fmt: skip
    g.add_argument("--max-micro-batch-size", type=int, default=None)
    g.add_argument("--moe-imbalance", type=float, metavar="G", default=None,
                   help="MoE: most-loaded expert's tokens over the mean the layouts are priced "
                   "at (default 1.0: balanced)")  # fmt: skip
    g.add_argument("--no-replay", action="store_true",
                   help="report the closed-form figures without replaying the winners")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print the ranked list as JSON")
    g.add_argument("--out", metavar="FILE", default="plan.yaml",
                   help="the winner as a plait train --config file (default plan.yaml; - for none)")  # fmt: skip


def parse_count(text: str, flag: str) -> float:
    """``300B`` / ``1.4T`` / ``4M`` / ``3e11`` -> a number (K, M, B or G, T: powers of 1000)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    s = str(text).strip().upper()
    try:
        if s and s[-1] in scale:
            return float(s[:-1]) * scale[s[-1]]
        return float(s)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a number such as 300B, 1.4T or 3e11")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """``plait plan``; given its ``parser``, a ``--config`` file's values stand where no
    flag is given (``UserError`` on a bad file)."""
    values = merged_values(args, parser) if parser is not None else dict(vars(args))
    try:
        return _run(args, values)
    except ValueError as e:
        return die("plan", str(e).strip().splitlines()[0])


def _request(values: dict, model, hw, tokens: float | None):
    """The ``sim.search.PlanRequest`` the flag values describe."""
    from plait.cli_args import LAYOUT_FLAGS
    from plait.layout import DEFAULT_BUCKET_MB, Layout
    from plait.sim.search import PlanRequest, space_for

    # not searched: fine at their defaults (as a run's config.yaml holds them)
    fixed = {"pp_layout": None, "offload_optimizer": False,
             "bucket_mb": DEFAULT_BUCKET_MB}  # fmt: skip
    for key, default in fixed.items():
        if values.get(key) not in (None, default):
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{flag} is not searched by plait plan; plan, then add {flag} to train"
            )
    pins = {k: values.get(k) for k in LAYOUT_FLAGS if k not in fixed}
    if pins.get("tp"):  # a pinned --tp that cannot split the model: say so, not "no layout"
        from plait.layout import check_tp_split

        check_tp_split(model, pins["tp"])
    n = values.get("gpus")
    if n is None:
        if not all(pins.get(k) for k in ("dp", "tp", "pp")):
            raise ValueError("--gpus is required (or pin all of --dp, --tp and --pp)")
        n = pins["dp"] * pins["tp"] * pins["pp"] * (pins.get("cp") or 1)
    G = values.get("global_batch_size")
    if values.get("global_batch_tokens") is not None:
        t = parse_count(values["global_batch_tokens"], "--global-batch-tokens")
        if G is not None:
            raise ValueError("give --global-batch-size or --global-batch-tokens, not both")
        G, rest = divmod(round(t), model.seq_len)
        if rest or G < 1:
            near = max(1, round(t / model.seq_len))
            raise ValueError(
                f"--global-batch-tokens {t:.0f} is not a multiple of --seq-len {model.seq_len}; "
                f"use {near * model.seq_len} ({near} sequences)"
            )
    if G is None:
        raise ValueError("--global-batch-size (sequences) or --global-batch-tokens is required")
    dtype = values.get("dtype") or default_dtype(hw.peak_flops)
    runtime = values.get("runtime") or DEFAULT_RUNTIME
    space_pins = {k: pins.get(k) for k in ("tp", "pp", "dp", "vpp", "schedule", "micro_batch_size",
                                           "zero", "recompute", "cp", "cp_mode", "ep")}  # fmt: skip
    if pins.get("sequence_parallel"):
        space_pins["sequence_parallel"] = True
    if pins.get("recompute_layers") is not None:  # train's checks: with full, at least 1
        Layout(recompute=pins.get("recompute") or "none", recompute_layers=pins["recompute_layers"])
        space_pins["recompute_layers"] = pins["recompute_layers"]
    elif pins.get("recompute") == "full":  # as plait train reads it: every block
        space_pins["recompute_layers"] = 0
    group = pins.get("zero_shard_group")
    if group is not None:  # train's checks (with ZeRO, at least 1); 0 here: no HSDP
        if group < 0:
            raise ValueError(
                f"--zero-shard-group must be at least 1, got {group} (plait plan also takes 0: "
                "shard over every data-parallel rank, no HSDP)"
            )
        if pins.get("zero") == 0 and group:
            Layout(dp=group, zero=0, zero_shard_group=group)
        space_pins["zero_shard_group"] = group

    def given(key, default):  # 0 is a value to refuse, not "the default"
        return default if values.get(key) is None else values[key]

    mbs = values.get("max_micro_batch_size")
    if mbs is not None and mbs < 1:
        raise ValueError(f"--max-micro-batch-size must be at least 1, got {mbs}")
    space = space_for(
        runtime, space_pins, max_tp=values.get("max_tp"), max_vpp=given("max_vpp", 8),
        max_micro_batch_size=mbs, max_cp=given("max_cp", 16),
    )  # fmt: skip
    from plait.cli_args import dp_algo_config

    algo = dp_algo_config(values)  # --dp-algo / --compress: every layout priced with it
    return PlanRequest(
        model=model, hardware=hw, n_devices=n, global_batch_size=G, dtype=dtype,
        runtime=runtime, space=space, top_k=given("top", 10),
        exact=not values.get("no_replay"), tokens=tokens,
        dp_algo=None if algo.algo == "allreduce" and algo.compress is None else algo,
        moe_imbalance=_moe_imbalance(values),
    )  # fmt: skip


def _moe_imbalance(values: dict) -> float:
    """``--moe-imbalance`` (default 1.0: a balanced router; ``sim/expert.py``)."""
    g = values.get("moe_imbalance")
    if g is not None and not values.get("moe_experts"):
        raise ValueError("--moe-imbalance needs a mixture of experts (--moe-experts)")
    return 1.0 if g is None else g


def _run(args: argparse.Namespace, values: dict) -> int:
    from plait.cli_args import model_config
    from plait.sim.hardware import load_hardware
    from plait.sim.search import search

    hw = load_hardware(values.get("gpu"), values.get("hardware"))
    tokens = parse_count(values["tokens"], "--tokens") if values.get("tokens") else None
    preset_name = values.get("model") or "tiny"
    budget = values.get("budget_gpu_days")
    if budget is not None:
        if values.get("model") is None:  # sizes of a modern vocabulary and context
            values = {**values, "model": "llama-7b"}
        model, tokens = _budget(values, model_config(values), hw)
        preset_name = None
    else:
        model = model_config(values)
    req = _request(values, model, hw, tokens)
    plan = search(req)
    out = values.get("out") or "plan.yaml"
    if out != "-":
        try:
            with open(out, "w") as f:
                f.write(config_text(plan.best, model, preset_name, _header(plan, preset_name),
                                    plan.request.dp_algo))  # fmt: skip
        except OSError as e:
            raise ValueError(f"--out {out}: cannot write it ({e.strerror})")
    if values.get("json"):
        print(json.dumps([e.to_dict(model) for e in plan.entries], indent=2))
        if out != "-":
            print(f"wrote {out}", file=sys.stderr)
        return 0
    lines = _budget_lines(plan, budget) if budget is not None else []
    print("\n".join(lines + [report(plan, preset_name or "Chinchilla-optimal")]))
    if out != "-":
        print(f"wrote      {out}   (plait train --config {out})")
    return 0


def _budget(values: dict, model, hw):
    """The compute-optimal (Chinchilla) model and tokens for ``--budget-gpu-days`` at the
    utilisation its own best plan reaches: size -> plan -> utilisation -> size, a few
    rounds until they agree (sizes come in steps, so they may settle a step apart)."""
    from plait.model import sizes
    from plait.sim.search import chinchilla_model, search

    budget = values["budget_gpu_days"]
    if budget <= 0:
        raise ValueError(f"--budget-gpu-days must be positive, got {budget:g}")
    if values.get("gpus") is None:
        raise ValueError("--budget-gpu-days needs --gpus (the devices the budget runs on)")
    dtype = values.get("dtype") or default_dtype(hw.peak_flops)
    peak, n = hw.peak(dtype), values["gpus"]
    util, seen = 0.4, set()  # first guess of 6 N D / (devices x peak x time)
    for _ in range(6):
        cfg, tokens = chinchilla_model(
            budget * 86400 * peak * util, arch=model.arch,  # --arch llama3: the llama arch
            vocab_size=model.vocab_size, seq_len=model.seq_len,
        )  # fmt: skip
        if cfg in seen:
            break
        seen.add(cfg)
        best = search(_request({**values, "top": 1, "no_replay": True}, cfg, hw, tokens)).best
        util = 6 * sizes.num_params(cfg) * best.result.tokens_per_s / (n * peak)
    return cfg, tokens


def _budget_lines(plan, budget: float) -> list[str]:
    from plait.model import sizes
    from plait.sim.search import TOKENS_PER_PARAM

    req, cfg = plan.request, plan.request.model
    n_params, best = sizes.num_params(cfg), plan.best
    util = 6 * n_params * best.result.tokens_per_s / (req.n_devices * req.hardware.peak(req.dtype))
    return [
        f"budget     {budget:,.0f} device-days = {budget / req.n_devices:.1f} days on "
        f"{req.n_devices:,} x {req.hardware.name}; compute-optimal (Chinchilla, "
        f"{TOKENS_PER_PARAM} tokens per parameter, C = 6 N D) at the {util:.1%} of the dense "
        f"{req.dtype} peak its plan reaches:",
        f"model      {n_params / 1e9:.3g}B parameters (--arch {cfg.arch} --layers {cfg.n_layers} "
        f"--hidden {cfg.hidden} --heads {cfg.n_heads}) on {req.tokens / 1e9:,.0f}B tokens: "
        f"{best.train_days:.1f} days, {best.device_hours / 24:,.0f} device-days",
    ]


def _header(plan, name: str | None) -> str:
    e, req = plan.best, plan.request
    r = e.result
    text = (
        f"plait plan: {name or 'custom model'} on {req.n_devices} x {req.hardware.name}, "
        f"runtime {req.runtime}\n"
        f"predicted {r.iter_time_s:.4g} s/step, {r.tflops_per_device:.3g} TFLOP/s per device "
        f"(MFU {r.mfu:.1%} of the dense {req.dtype} peak), {r.peak_mem_bytes / GiB:.1f} GiB "
        f"per device"
    )
    if e.train_days is not None:
        text += f"\n{req.tokens:.4g} tokens in {e.train_days:.1f} days"
    return text


def report(plan, name: str | None = None) -> str:
    """The table and summary lines ``plait plan`` prints for a ``sim.search.Plan``."""
    from plait.model import sizes
    from plait.sim.search import simple_estimate

    req, cfg, hw = plan.request, plan.request.model, plan.request.hardware
    peak = hw.peak(req.dtype)
    n_params = sizes.num_params(cfg)
    tokens_step = req.global_batch_size * cfg.seq_len
    n_replayed = sum(e.replayed for e in plan.entries)
    lines = [
        f"plait plan: {name or 'model'} ({cfg.arch}, {cfg.n_layers} x {cfg.hidden}, "
        f"{n_params / 1e9:.3g}B parameters, seq {cfg.seq_len}) on {req.n_devices:,} x {hw.name}, "
        f"runtime {req.runtime}, {req.dtype}",
        f"searched   {plan.n_layouts:,} layouts for a global batch of {req.global_batch_size:,} "
        f"sequences ({tokens_step:,} tokens) in {plan.seconds:.2f} s: {plan.n_simulated} "
        f"simulated in closed form, {n_replayed} of the best replayed exactly",
    ]
    if req.dp_algo is not None:
        lines.append(
            f"dp algo    {req.dp_algo.label()} across replicas: layouts it runs on, priced with "
            "it (docs/comm-efficient.md)"
        )
    has_days = plan.best.train_days is not None
    head = (
        f"{'#':>3}  {'layout':<44} {'mem/dev':>9} {'step':>9} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'bubble':>7} {'comm':>6}" + (f" {'days':>7}" if has_days else "")
    )
    lines.append(head)
    for i, e in enumerate(plan.entries, 1):
        r = e.result
        b = r.breakdown
        comm = (b["tp_comm"] + b["pp_comm"] + b["dp_comm"] + b.get("cp_comm", 0.0)
                + b.get("ep_comm", 0.0)) / r.iter_time_s  # fmt: skip
        row = (
            f"{i:>3}  {e.candidate.label():<44} {r.peak_mem_bytes / GiB:>5.1f} GiB "
            f"{('' if e.replayed else '~') + _secs(r.iter_time_s):>9} "
            f"{r.tflops_per_device:>8.4g} {r.mfu:>6.1%} "
            f"{b['bubble'] / r.iter_time_s:>7.1%} {comm:>6.1%}"
        )
        if has_days:
            row += f" {e.train_days:>7.1f}"
        lines.append(row)
    if any(e.candidate.recompute_layers for e in plan.entries):
        lines.append(
            "           full xN: --recompute full --recompute-layers N, the first N blocks of "
            "each model chunk recompute (the fewest that fit)"
        )
    if n_replayed < len(plan.entries):
        lines.append(
            "           ~ closed form (schedule not replayed: --no-replay, or past the replay "
            "budget; plait simulate replays it)"
        )
    lines.append(_rejected_line(plan))
    best = plan.best
    if has_days:
        steps = req.tokens / tokens_step
        est = simple_estimate(cfg, req.tokens, req.n_devices, peak, best.train_days)
        lines += [
            f"train      {req.tokens:.4g} tokens = {steps:,.0f} steps of the best layout: "
            f"{best.train_days:.1f} days, {best.device_hours:,.0f} device-hours "
            f"({best.result.tokens_per_s / req.n_devices:,.0f} tokens/s per device)",
            f"estimate   8 x tokens x params / (devices x peak x utilisation) = 8 x "
            f"{req.tokens:.3g} x {est['params']:.4g} / ({req.n_devices:,} x "
            f"{peak / 1e12:.4g} TFLOP/s x {est['utilisation']:.1%}) = {best.train_days:.1f} days: "
            f"the plan implies {est['tflops']:.0f} TFLOP/s per device, {est['utilisation']:.1%} "
            f"of the dense {req.dtype} peak",
        ]
    lines.append(
        f"peaks      MFU and utilisation are against {hw.name}'s dense {req.dtype} peak, "
        f"{peak / 1e12:.4g} TFLOP/s (a sparse peak would halve them); TFLOP/s and MFU count "
        "model FLOPs, the estimate counts 8 per parameter per token (recomputation included)"
    )
    from plait.sim import held_out

    lines.append(f"accuracy   {held_out.describe(req.runtime, hw.name)}")
    return "\n".join(lines)


def _rejected_line(plan) -> str:
    gib = plan.request.hardware.memory_bytes / GiB
    n = plan.n_rejected_memory
    text = f"rejected   {n:,} of {plan.n_layouts:,} layouts do not fit in {gib:.1f} GiB per device"
    if plan.best_rejected:
        r = plan.best_rejected[0]
        text += (
            f"; the fastest of them, {r.candidate.label()}, would take {_secs(r.iter_time_s)} "
            f"a step but needs {r.peak_mem_bytes / GiB:.1f} GiB"
        )
    elif n:
        text += "; none of them would have been faster than the winner"
    return text


def _secs(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
