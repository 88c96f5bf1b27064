"""``plait simulate``: predict one layout's step, or a whole CSV of runs.

    plait simulate --model gpt3-175b --gpu a100-80gb --gpus 1024 --tp 8 --pp 8 \\
        --global-batch-size 1536 --dtype bf16 --sequence-parallel --recompute selective
    plait simulate ... --json                 # one JSON object
    plait simulate ... --timeline step.png    # per-rank timeline of the simulated step
    plait simulate --runs runs.csv --out pred.csv
    plait simulate --gpu h100-sxm --write-hardware my-cluster.yaml   # start a spec

The parser is ``cli_args``' model, layout, LoRA and data-parallel flags plus
``add_arguments`` below (``add_parser``); ``run`` reads a ``--config`` file under the flags.
Errors a user can cause print one line, ``plait simulate: error: ...``, to stderr and
return 2.
"""

from __future__ import annotations

import argparse
import json

from plait.cli_args import model_layout_parser
from plait.commands.common import die, merged_values
from plait.sim.hardware import BUILTIN, DEFAULT_GPU
from plait.sim.runtime import DEFAULT_RUNTIME, PROFILES

GiB = 2**30
MiB = 2**20


def add_parser(sub) -> argparse.ArgumentParser:
    p = model_layout_parser(sub, "simulate", help="predict step time, MFU and memory of a layout")
    add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("simulate")
    g.add_argument(
        "--gpu",
        choices=list(BUILTIN),
        default=None,
        help=f"built-in hardware (default {DEFAULT_GPU})",
    )
    g.add_argument(
        "--gpus", type=int, default=None, help="devices in all; sets --dp when --dp is not given"
    )
    g.add_argument("--hardware", metavar="FILE", default=None, help="hardware spec (YAML)")
    g.add_argument(
        "--runtime",
        choices=list(PROFILES),
        default=None,
        help=f"software whose behaviour is modelled (default {DEFAULT_RUNTIME})",
    )
    g.add_argument("--moe-imbalance", type=float, metavar="G", default=None,
                   help="MoE: most-loaded expert's tokens over the mean (default 1.0: balanced; "
                   "plait train logs moe_imbalance)")  # fmt: skip
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--timeline", metavar="PNG", default=None, help="draw the simulated step")
    g.add_argument("--runs", metavar="FILE.csv", default=None, help="simulate every row")
    # dest is not "out": a train config merged into these args may carry out: DIR
    g.add_argument(
        "--out", dest="pred_out", metavar="PRED.csv", default=None, help="with --runs: write rows"
    )
    g.add_argument(
        "--write-hardware", metavar="FILE", default=None, help="write the hardware spec as YAML"
    )


def fail(message: str) -> int:
    return die("simulate", message)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """``plait simulate``; given its ``parser``, a ``--config`` file's values stand where
    no flag is given (``UserError`` on a bad file)."""
    if parser is not None:
        args = argparse.Namespace(**{**vars(args), **merged_values(args, parser)})
    try:
        if getattr(args, "runs", None):
            return _run_csv(args)
        if getattr(args, "pred_out", None):
            return fail("--out needs --runs FILE.csv (for one layout use --json or --timeline)")
        return _run_one(args)
    except ValueError as e:
        return fail(str(e))


def _hardware(args):
    from plait.sim.hardware import load_hardware

    return load_hardware(getattr(args, "gpu", None), getattr(args, "hardware", None))


def _run_one(args: argparse.Namespace) -> int:
    from plait.cli_args import dp_algo_config, layout_config, model_config
    from plait.sim.simulate import simulate

    hw = _hardware(args)
    if args.write_hardware:
        try:
            hw.to_yaml(args.write_hardware)
        except OSError as e:
            return fail(f"--write-hardware {args.write_hardware}: cannot write it ({e.strerror})")
        print(f"wrote {args.write_hardware} ({hw.name})")
        return 0
    values = dict(vars(args))
    gpus = values.get("gpus")
    if gpus is not None:
        if gpus < 1:
            return fail(f"--gpus must be at least 1, got {gpus}")
        if values.get("dp") is None:
            per_replica = (
                (values.get("tp") or 1) * (values.get("pp") or 1) * (values.get("cp") or 1)
            )
            if gpus % per_replica:
                cp = " x --cp" if (values.get("cp") or 1) > 1 else ""
                return fail(
                    f"--gpus {gpus} is not divisible by --tp x --pp{cp} = {per_replica}; "
                    f"use a multiple of {per_replica}"
                )
            values["dp"] = gpus // per_replica
    model = model_config(values)
    if values.get("dtype") is None:  # GPUs train in bf16 (fp16 on a V100), CPUs in fp32
        from plait.sim.devices import default_dtype

        values["dtype"] = default_dtype(hw.peak_flops)
    layout = layout_config(values)
    algo = dp_algo_config(values)
    algo = None if algo.plain else algo
    runtime = args.runtime or DEFAULT_RUNTIME
    from plait.cli_args import lora_config

    lora = lora_config(values)  # a frozen base: its weights held, adapters trained
    if lora is not None:
        lora.check_model(model)
    imbalance = values.get("moe_imbalance")
    if imbalance is not None and not model.moe:
        return fail("--moe-imbalance needs a mixture of experts (--moe-experts)")
    res = simulate(model, layout, hw, gpus, runtime=runtime, keep_timeline=bool(args.timeline),
                   lora=lora, dp_algo=algo, moe_imbalance=imbalance)  # fmt: skip
    if args.timeline:
        from plait.viz.timeline import draw_timeline

        title = (
            f"{values.get('model') or 'tiny'} on {res.n_devices} x {hw.name}: "
            f"{_layout_line(layout)} - {res.iter_time_s:.3g} s/step"
        )
        unit = "ms" if res.iter_time_s < 1 else "s"
        try:
            draw_timeline(res.timeline, args.timeline, title=title, extras=res.extras, unit=unit)
        except ValueError as e:
            return fail(f"--timeline {e}")
    if args.json:
        out = res.to_dict()
        out["model"] = model.to_dict()
        out["layout"] = layout.to_dict()
        from plait.sim import held_out

        out["accuracy"] = held_out.describe(res.runtime, res.hardware)
        print(json.dumps(out, indent=2))
    else:
        print(report(res, model, layout, values.get("model") or "tiny", imbalance, hw))
        if args.timeline:
            print(f"timeline  {args.timeline}")
    return 0


def _layout_line(layout) -> str:
    cp = f" cp={layout.cp} {layout.cp_mode}" if layout.cp > 1 else ""
    ep = f" ep={layout.ep}" if layout.ep > 1 else ""
    return (
        f"dp={layout.dp}{ep}{cp} tp={layout.tp} pp={layout.pp} vpp={layout.vpp} "
        f"{layout.schedule} mbs={layout.micro_batch_size}"
    )


def report(res, model, layout, name: str = "model", moe_imbalance: float | None = None,
           hw=None) -> str:  # fmt: skip
    """The human-readable summary ``plait simulate`` prints (``moe_imbalance``, ``hw``: a
    MoE run's, for its expert lines)."""
    from plait.sim import held_out

    moe_imbalance = 1.0 if moe_imbalance is None else moe_imbalance
    tokens = layout.global_batch_size * model.seq_len
    mem = res.memory
    flags = [f"zero={layout.zero}", f"recompute={layout.recompute}", f"dtype={layout.dtype}"]
    if layout.recompute_layers is not None:
        flags.insert(2, f"recompute-layers={layout.recompute_layers}")
    if layout.sequence_parallel:
        flags.append("sequence-parallel")
    if layout.dtype != "fp32":  # the residual stream: the compute dtype, or --fp32-residual
        flags.append(f"residual={'fp32' if layout.fp32_residual else layout.dtype}")
    lines = [
        f"plait simulate: {name} ({model.n_layers} x {model.hidden}, seq {model.seq_len}) on "
        f"{res.n_devices} x {res.hardware}, runtime {res.runtime}",
        f"layout     {_layout_line(layout)}, {layout.num_microbatches} micro-batches, "
        f"global batch {layout.global_batch_size} seqs ({tokens:,} tokens)",
        f"           {' '.join(flags)}",
        f"step       {res.iter_time_s:.4g} s   {res.tokens_per_s:,.0f} tokens/s   "
        f"{res.tokens_per_s / res.n_devices:,.0f} tokens/s/device",
        f"TFLOP/s    {res.tflops_per_device:.1f} per device in model FLOPs (MFU {res.mfu:.1%}); "
        f"{res.hw_tflops_per_device:.1f} in hardware FLOPs with recomputation (HFU {res.hfu:.1%})",
        f"memory     {res.peak_mem_bytes / GiB:.1f} GiB peak per device of "
        f"{res.mem_capacity_bytes / GiB:.1f} GiB: " + ("fits" if res.fits else "DOES NOT FIT"),
        f"           weights {mem.weights / GiB:.1f}, grads {mem.grads / GiB:.1f}, optimizer "
        f"{mem.optimizer / GiB:.1f}, activations {mem.activations / GiB:.1f}, "
        + (f"weight casts {mem.weight_casts / GiB:.1f}, " if mem.weight_casts else "")
        + f"buffers {mem.buffers / GiB:.1f}, overhead {mem.overhead / GiB:.1f} GiB "
        f"(pipeline rank {mem.rank})",
        *_dp_algo_lines(res),
        *_cp_lines(res, model, layout),
        *_moe_lines(res, model, layout, moe_imbalance, hw),
        "breakdown  "
        + ", ".join(
            f"{k.replace('_', ' ')} {v:.3g} s ({v / res.iter_time_s:.1%})"
            for k, v in res.breakdown.items()
        ),
        "convention model FLOPs = 6 per weight per token + attention (no recomputation); "
        "hardware FLOPs add what recomputation repeats",
        f"accuracy   {held_out.describe(res.runtime, res.hardware)}",
    ]
    return "\n".join(lines)


def _cp_lines(res, model, layout) -> list[str]:
    """``--cp``: the ring's traffic per layer and step, and what it holds (sim/context.py)."""
    if layout.cp == 1:
        return []
    from plait.sim import context as cp_sim

    nb = cp_sim.layer_bytes(model, layout)
    held = cp_sim.buffer_bytes(
        model, layout, not cp_sim.math_attention(layout, PROFILES[res.runtime])
    )
    steps = layout.num_microbatches * model.n_layers / layout.pp  # layers a rank runs, per step
    exposed = res.breakdown.get("cp_comm", 0.0)
    return [
        f"cp traffic {layout.cp_mode} over {layout.cp} ranks: {nb.fwd_sent / MiB:,.1f} MiB sent "
        f"forward + {nb.bwd_sent / MiB:,.1f} MiB backward per layer and micro-batch, "
        f"{nb.sent * steps / GiB:,.2f} GiB per step per rank; {exposed:.3g} s exposed",
        f"cp memory  activations of {model.seq_len // layout.cp:,} of {model.seq_len:,} tokens "
        f"per sequence; +{held / GiB:.2f} GiB held by one layer's exchange while it runs",
    ]


def _moe_lines(res, model, layout, imbalance, hw) -> list[str]:
    """A mixture of experts: total and active parameters, what a rank holds of the experts,
    and with ``--ep`` the dispatch's traffic per layer and step (sim/expert.py)."""
    if not model.moe:
        return []
    from plait.model.sizes import active_params, num_params
    from plait.sim import expert as ep_sim

    n, a = num_params(model), active_params(model)
    held = model.n_moe_layers * ep_sim.expert_params(model, layout) / layout.pp
    lines = [
        f"experts    {n / 1e9:,.3f} B parameters in all, {a / 1e9:,.3f} B active per token "
        f"({a / n:.1%}: top-{model.moe_top_k} of {model.moe_experts} in {model.n_moe_layers} "
        f"of {model.n_layers} blocks; MFU counts these); {held / 1e9:,.3f} B of expert "
        f"weights per device at ep={layout.ep}, their state sharded over "
        f"{layout.dp // layout.ep} edp ranks"
    ]
    if layout.ep > 1:
        nb = ep_sim.layer_bytes(model, layout, imbalance)
        steps = layout.num_microbatches * model.n_moe_layers / layout.pp  # per rank and step
        if layout.recompute == "full":  # the forward's dispatch again, where it recomputes
            steps *= 1 + layout.recomputed_share(model.n_layers) * nb.fwd_sent / nb.sent
        where = ""
        if hw is not None:
            inside = ep_sim.link(hw, layout) is hw.intra_node
            where = " inside a node" if inside else " across nodes"
        lines.append(
            f"ep traffic all-to-all over {layout.ep} ranks{where}: {nb.fwd_sent / MiB:,.1f} MiB "
            f"sent forward + {nb.bwd_sent / MiB:,.1f} MiB backward per MoE layer and "
            f"micro-batch (busiest rank, imbalance {imbalance:g}), "
            f"{nb.sent * steps / GiB:,.2f} GiB per step; {res.breakdown.get('ep_comm', 0.0):.3g} s "
            "exposed"
        )
    return lines


def _dp_algo_lines(res) -> list[str]:
    """``--dp-algo`` / ``--compress``: what the algorithm sends (sim/dp_algos.py)."""
    a = res.dp_algo
    if not a:
        return []
    msgs = f", {a['messages']:.3g} messages" if a["messages"] else ""
    return [
        f"dp algo    {a['label']}: {a['bytes_sent'] / 2**20:,.1f} MiB sent per rank per step"
        f"{msgs}, {a['latency'] * 1e6:,.0f} us of latency, {a['sync_s']:.3g} s exposed after "
        f"the step; +{a['state_bytes'] / GiB:.1f} GiB of its state per device"
    ]


def _run_csv(args: argparse.Namespace) -> int:
    from plait.sim.runs import accuracy, predict_file

    rows = predict_file(args.runs, args.pred_out)
    acc = accuracy(rows)
    if args.json:
        print(json.dumps({"rows": len(rows), "out": args.pred_out, "tflops_gpu": acc}, indent=2))
        return 0
    print(f"{'id':30s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  convention  note")
    for row in rows:
        print(
            f"{row.get('id', ''):30s} {row.get('tflops_gpu', ''):>9s} "
            f"{row.get('pred_tflops_gpu', ''):>9s} {row.get('err_tflops_gpu', ''):>7s}  "
            f"{row.get('flops_convention', ''):10s}  {row.get('pred_note', '')}"
        )
    if acc["n"]:
        print(
            f"TFLOP/s per GPU: mean absolute error {acc['mape']:.1%} over {acc['n']} rows, "
            f"worst {acc['worst']:.1%} ({acc['worst_id']}); {len(acc['excluded'])} rows not compared"
        )
    if args.pred_out:
        print(f"wrote {args.pred_out}")
    return 0
