"""Simulate many runs from a CSV in the schema of ``benchmarks/data/published_runs.csv``.

Each row is turned into (model, layout, hardware, runtime), simulated, and given the
columns ``pred_iter_s``, ``pred_tflops_gpu``, ``pred_mfu``, ``pred_hfu``, ``pred_mem_gb``
(peak device memory, 1e9 bytes), ``pred_tok_s_gpu``, ``pred_fits``, ``pred_layout`` (the
layout actually simulated), ``pred_runtime``, ``pred_hardware``, ``flops_convention``
and ``pred_note``; plus ``err_<col>`` = predicted / measured - 1 for every measured
column present (``tflops_gpu``, ``mfu``, ``hfu``, ``tok_s_gpu``, ``iter_s``). A row that
cannot be simulated keeps the prediction columns empty and says why in ``pred_note``.

Reading a row
    Numbers may carry a comment: "1 (BF16Optimizer)" is 1. "?" (unknown) and empty (not
    applicable / not reported) differ:

    - layers, hidden, heads, seq, vocab, gpu, n_gpus, tp, pp, gbs_seqs are required
      (dp may be left out when n_gpus = tp x pp x cp x dp gives it). cp empty: 1;
      cp_mode empty: ring (Megatron-Core's p2p default); allgather or a2a (Ulysses).
    - kv_heads empty: = heads. ffn empty: 4 x hidden. Architecture: GELU MLP (``gpt2``)
      when ffn = 4 x hidden and there is no grouped-query attention, else SwiGLU
      (``llama``).
    - vpp, sp, zero empty: 1, off, 0. recompute empty: none. precision: bf16 / fp16 / fp32
      as named (default bf16). ``recompute_layers`` (a column of its own): with full
      recomputation, the blocks of each pipeline chunk that recompute
      (``Layout.recompute_layers``; torchtitan's every-other-layer checkpointing is half).
    - zero: a leading digit is the stage; "FSDP"/"FULL_SHARD"/"HSDP" is 3,
      "SHARD_GRAD_OP" is 2. "HSDP" / "HYBRID_SHARD" shards within a node and replicates
      across nodes (PyTorch FSDP's ``HYBRID_SHARD``): ``--zero-shard-group`` = the node's
      devices.
    - Unknown ("?") fields take what the source's framework does when it is not told
      (``UNKNOWN_DEFAULTS``: its default, or for a flag without one the value its own
      published runs and example scripts use), then what the row's notes imply
      (``IMPLIED``: Megatron's ``--tp-comm-overlap`` needs sequence parallelism,
      ``--overlap-param-gather`` the distributed optimizer). Never the fastest choice:
      a validation must not tune the run it predicts. ``pred_layout`` records the
      layout simulated, ``pred_note`` what was assumed.
    - pp may carry the partition as its comment: "12 (partition type:transformer|embedding)"
      is Megatron-DeepSpeed's ``--pp-partition-method``, which counts each embedding copy
      as one layer slot (BLOOM), so the first and last stages get a layer fewer; without
      it stages hold the framework's uniform split (``partition.py``'s ``uniform``).

    gpu -> hardware: "H200" h200, "H100" h100-sxm, "A100" with "40" a100-40gb, other
    "A100" a100-80gb, "V100" v100 (a ``hardware`` column naming a built-in or a YAML
    file wins). A fabric other than the DGX one named in the gpu text replaces the
    network: "Omni-Path, 4 links/node" is 4 x 100 Gb/s per node shared by its devices,
    "400Gbps" a node's network of 400 Gb/s in all (``fabric_for``).

    source -> runtime profile (``runtime.py``; a ``runtime`` column wins): Megatron-Core
    or the Megatron-LM README's H100 tables -> megatron-core; a DeepSpeed ZeRO-3
    baseline -> deepspeed-zero3; Narayanan et al. SC21 (Megatron-LM PTD-P) ->
    megatron-lm; Korthikanti et al. 2022 -> megatron-lm-2022; BigScience /
    Megatron-DeepSpeed -> megatron-deepspeed; torchtitan -> fsdp2; IBM's FSDP blog
    (fms-fsdp) -> fms-fsdp; llm-foundry / FSDP -> fsdp; anything else -> plait.

Sources
    ``source_key`` names a row's source for validation (the ``source`` column up to its
    first parenthesis): rows of one paper or repository share it, whatever table they
    come from; ``sim/validate.py`` leaves one source out at a time.

FLOP conventions
    ``tflops_gpu`` is compared in the source's own convention: hardware FLOPs (with
    recomputation) when the row's notes say the figure counts recomputation / hardware
    FLOPs, else model FLOPs (a ``flops_convention`` column, "model" or "hardware",
    wins). ``pred_tflops_gpu`` is in that convention; ``pred_mfu`` is always model FLOPs
    and ``pred_hfu`` always hardware FLOPs, both as ``plait.model.sizes`` counts them.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.sim.hardware import Hardware, get_hardware, load_hardware
from plait.sim.runtime import PROFILES, get_runtime
from plait.sim.simulate import Result, simulate

PRED_COLUMNS = (
    "pred_iter_s",
    "pred_tflops_gpu",
    "pred_mfu",
    "pred_hfu",
    "pred_mem_gb",
    "pred_tok_s_gpu",
    "pred_fits",
    "pred_layout",
    "pred_runtime",
    "pred_hardware",
    "flops_convention",
    "pred_note",
)
MEASURED = {  # measured column -> prediction it is compared with
    "tflops_gpu": "pred_tflops_gpu",
    "mfu": "pred_mfu",
    "hfu": "pred_hfu",
    "tok_s_gpu": "pred_tok_s_gpu",
    "iter_s": "pred_iter_s",
}
REQUIRED = ("layers", "hidden", "heads", "seq", "vocab", "gpu", "n_gpus", "tp", "pp", "gbs_seqs")
RECOMPUTE_CHOICES = ("none", "selective", "full")

_SOURCE_RUNTIME = (  # (regex on the source column, runtime profile), first match wins
    (r"megatron-core|megatron-lm readme", "megatron-core"),
    (r"deepspeed zero-3", "deepspeed-zero3"),
    (r"korthikanti", "megatron-lm-2022"),
    (r"sc21|ptd-p", "megatron-lm"),
    (r"bigscience|megatron-deepspeed", "megatron-deepspeed"),
    (r"torchtitan", "fsdp2"),
    (r"maximizing.training|fms-fsdp", "fms-fsdp"),
    (r"llm-foundry|mosaic|fsdp", "fsdp"),
)

# What each framework does with a field its user did not set, for the fields a source may
# leave unknown. Megatron's --micro-batch-size has no default: 1 is what the sources'
# own reported runs use (SC21 Table 2's PTD-P rows, Korthikanti et al. Table 3's large
# models) and Megatron's GPT-3 175B example script passes. Interleaving needs
# --num-layers-per-virtual-pipeline-stage (off by default); activation recomputation
# (--recompute-granularity, --checkpoint-activations), --sequence-parallel and the
# distributed optimizer are off by default in Megatron-LM, Megatron-Core and
# Megatron-DeepSpeed; FSDP shards fully by default; plait's defaults are Layout's.
UNKNOWN_DEFAULTS: dict[str, dict] = {
    "megatron-lm": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=0),
    "megatron-lm-2022": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=0),
    "megatron-core": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=0),
    "megatron-deepspeed": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=0),
    "deepspeed-zero3": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=3),
    "fsdp": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=3),
    "fms-fsdp": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=3),
    "fsdp2": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=3),
    "plait": dict(mbs=1, vpp=1, recompute="none", sp=False, zero=0),
}
INTERLEAVED = "the least interleaving"  # the smallest vpp > 1 the layout allows (``_least_vpp``)
# Flags named in a row's notes that force an unknown field (Megatron-Core refuses the
# first without --sequence-parallel, the second without --use-distributed-optimizer, and
# overlaps pipeline-parallel communication only in the interleaved schedule: its
# arguments.py turns overlap_p2p_comm off otherwise).
IMPLIED = (
    (r"tp-comm-overlap", "sp", True),
    (r"overlap-param-gather", "zero", 1),
    (r"pipeline-parallel communication overlapped", "vpp", INTERLEAVED),
)


class RowError(ValueError):
    """This row cannot be simulated; the message goes to ``pred_note``."""


@dataclass(frozen=True)
class RowSpec:
    model: ModelConfig
    layout: Layout
    hardware: Hardware
    runtime: str
    convention: str  # "model" or "hardware"
    n_gpus: int
    source: str  # source_key
    assumed: tuple[str, ...] = ()  # unknown fields and what they were taken as


# -- reading fields -----------------------------------------------------------------------


def _raw(row: dict, col: str) -> str:
    return (row.get(col) or "").strip()


def _unknown(row: dict, col: str) -> bool:
    return _raw(row, col).startswith("?")


def _int(row: dict, col: str, default: int | None = None) -> int | None:
    """Leading integer of the field; ``default`` when empty; None when unknown ("?")."""
    text = _raw(row, col)
    if not text:
        if default is None:
            raise RowError(f"missing {col}")
        return default
    if text.startswith("?"):
        return None
    m = re.match(r"\d+(\.\d+)?", text)
    if not m:
        raise RowError(f"{col} {text!r} is not a number")
    return int(float(m.group()))


def _float(row: dict, col: str) -> float | None:
    text = _raw(row, col)
    try:
        return float(text)
    except ValueError:
        return None


def _zero(row: dict) -> int | None:
    text = _raw(row, "zero")
    if not text:
        return 0
    if text.startswith("?"):
        return None
    if text[0].isdigit():
        return int(text[0])
    upper = text.upper()
    if "SHARD_GRAD_OP" in upper:
        return 2
    if "FSDP" in upper or "FULL_SHARD" in upper or _hybrid(row):
        return 3
    raise RowError(f"zero {text!r} is not a ZeRO stage")


def _hybrid(row: dict) -> bool:
    """Whether the zero column names hybrid sharding (PyTorch FSDP's ``HYBRID_SHARD``:
    shard within a node, replicate across nodes)."""
    upper = _raw(row, "zero").upper()
    return "HSDP" in upper or "HYBRID_SHARD" in upper


def _recompute(row: dict) -> str | None:
    text = _raw(row, "recompute").lower()
    if not text:
        return "none"
    if text.startswith("?"):
        return None
    for name in RECOMPUTE_CHOICES:
        if text.startswith(name):
            return name
    raise RowError(f"recompute {text!r} is not none, selective or full")


def _dtype(row: dict) -> str:
    text = _raw(row, "precision").lower()
    for name in ("bf16", "fp16", "fp32"):
        if name in text:
            return name
    return "bf16"


def hardware_for(row: dict) -> Hardware:
    named = _raw(row, "hardware")
    if named:
        if named.endswith((".yaml", ".yml")):
            return load_hardware(path=named)
        return get_hardware(named)
    gpu = _raw(row, "gpu").upper()
    if "H200" in gpu:
        return get_hardware("h200")
    if "H100" in gpu:
        return get_hardware("h100-sxm")
    if "A100" in gpu:
        return get_hardware("a100-40gb" if re.search(r"\b40\s?GB", gpu) else "a100-80gb")
    if "V100" in gpu:
        return get_hardware("v100")
    raise RowError(f"gpu {_raw(row, 'gpu')!r} has no hardware entry; add a hardware column")


def runtime_for(row: dict) -> str:
    named = _raw(row, "runtime")
    if named:
        get_runtime(named)
        return named
    source = _raw(row, "source").lower()
    for pattern, name in _SOURCE_RUNTIME:
        if re.search(pattern, source):
            return name
    return "plait"


def convention_for(row: dict) -> str:
    named = _raw(row, "flops_convention").lower()
    if named in ("model", "hardware"):
        return named
    notes = _raw(row, "notes")
    if re.search(r"hardware flops|counts? recompute", notes, re.I):
        return "hardware"
    return "model"


def source_key(row: dict) -> str:
    """The source a row comes from, for leaving it out (module docstring)."""
    return _raw(row, "source").split("(")[0].strip() or _raw(row, "id")


def fabric_for(row: dict, hw: Hardware) -> Hardware:
    """``hw`` with the network the gpu text names, if not a DGX rail per device:
    "Omni-Path, N links/node" is N x 100 Gb/s per node (Intel OPA 100 series), "N Gbps"
    a node's network of N Gb/s in all; either shared by the node's devices, at the 95% of
    line rate the built-in networks assume."""
    gpu = _raw(row, "gpu")
    measured = re.search(r"busbw (\d+(?:\.\d+)?) gb/s a gpu measured", gpu, re.I)
    if m := re.search(r"omni-?path\D*(\d+) links?/node", gpu, re.I):
        n = int(m.group(1))
        gbps, name, what = 100 * n, f"opa{n}", f"{n} x 100 Gb/s Omni-Path"
    elif m := re.search(r"(\d+)\s*gbps", gpu, re.I):
        n = int(m.group(1))
        gbps, name, what = n, f"net{n}", f"{n} Gb/s"
    else:
        return hw
    per_device = 0.95 * gbps * 1e9 / 8 / hw.devices_per_node
    if measured:  # a bus bandwidth measured on that machine replaces the line rate
        per_device, what = float(measured.group(1)) * 1e9 / 8, f"{what}, {measured.group(0)}"
    inter = dataclasses.replace(hw.inter_node, bandwidth=per_device)
    return hw.replace(
        name=f"{hw.name}-{name}", inter_node=inter,
        description=f"{hw.description}; network: {what} per node",
    )  # fmt: skip


def _partition(row: dict, layers: int, pp: int) -> tuple[int, ...] | None:
    """Layers per stage from the pp column's comment (module docstring), else None."""
    if "transformer|embedding" not in _raw(row, "pp"):
        return None
    slots = layers + 2  # each embedding copy takes one layer's slot
    base, extra = divmod(slots, pp)
    counts = [base + (s < extra) for s in range(pp)]
    counts[0] -= 1
    counts[-1] -= 1
    if min(counts) < 1:
        raise RowError(f"pp {pp}: the embedding-slot partition leaves a stage without layers")
    return tuple(counts)


def _least_vpp(row: dict, layers: int, pp: int, dp: int, mbs: int) -> int:
    """The smallest number of model chunks > 1 that an interleaved schedule of this row can
    run (Megatron: an equal whole number of layers per chunk, micro-batches a multiple of
    pp); 1 where none can."""
    gbs = _int(row, "gbs_seqs")
    if pp < 2 or layers % pp or not gbs or (gbs // (dp * mbs)) % pp:
        return 1
    per_stage = layers // pp
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 1)


def _filled(row: dict, runtime: str, tp: int, least_vpp=lambda mbs: 1) -> tuple[dict, list[str]]:
    """mbs, vpp, sp, zero and recompute of the row, unknowns filled (module docstring),
    and a note per filled field (``least_vpp(mbs)``: what ``INTERLEAVED`` means here)."""
    given = {"mbs": _int(row, "mbs", 1), "vpp": _int(row, "vpp", 1), "zero": _zero(row),
             "recompute": _recompute(row)}  # fmt: skip
    sp = _int(row, "sp", 0)
    given["sp"] = None if sp is None else bool(sp)
    defaults = UNKNOWN_DEFAULTS.get(runtime, UNKNOWN_DEFAULTS["plait"])
    notes, out = [], dict(given)
    for key, value in given.items():
        if value is not None:
            continue
        out[key] = defaults[key]
        for pattern, field, implied in IMPLIED:
            if field == key and re.search(pattern, _raw(row, "notes"), re.I):
                out[key] = least_vpp(out["mbs"]) if implied == INTERLEAVED else implied
        if key == "sp" and tp == 1:
            out[key] = False
        notes.append(f"{key} ?={out[key]}")
    return out, notes


def row_spec(row: dict) -> RowSpec:
    """Model, layout, hardware and runtime of one row (module doc)."""
    missing = [c for c in REQUIRED if not _raw(row, c) or _unknown(row, c)]
    if missing:
        raise RowError(f"incomplete configuration: no {', '.join(missing)}")
    cp = _int(row, "cp", 1) or 1
    cp_mode = (_raw(row, "cp_mode") or "ring").strip().lower()
    cp_mode = {"p2p": "ring", "all_gather": "allgather", "ulysses": "a2a"}.get(cp_mode, cp_mode)
    layers, hidden, heads = _int(row, "layers"), _int(row, "hidden"), _int(row, "heads")
    kv = _int(row, "kv_heads", heads) or heads
    ffn = _int(row, "ffn", 4 * hidden) or 4 * hidden
    arch = "gpt2" if ffn == 4 * hidden and kv == heads else "llama"
    try:
        model = ModelConfig(
            arch=arch,
            n_layers=layers,
            hidden=hidden,
            n_heads=heads,
            n_kv_heads=kv,
            ffn_hidden=ffn,
            vocab_size=_int(row, "vocab"),
            seq_len=_int(row, "seq"),
        )
    except ValueError as e:
        raise RowError(str(e)) from None
    n_gpus, tp, pp = _int(row, "n_gpus"), _int(row, "tp"), _int(row, "pp")
    dp = _int(row, "dp", n_gpus // (tp * pp * cp))
    if dp is None:
        dp = n_gpus // (tp * pp * cp)
    if tp * pp * cp * dp != n_gpus:
        raise RowError(f"tp {tp} x pp {pp} x cp {cp} x dp {dp} != n_gpus {n_gpus}")
    runtime = runtime_for(row)
    knobs, assumed = _filled(row, runtime, tp,
                             lambda mbs: _least_vpp(row, layers, pp, dp, mbs))  # fmt: skip
    vpp = knobs["vpp"]
    try:
        hw = fabric_for(row, hardware_for(row))
        layout = Layout(
            dp=dp, tp=tp, pp=pp, cp=cp, cp_mode=cp_mode, vpp=vpp, global_batch_size=_int(row, "gbs_seqs"),
            micro_batch_size=knobs["mbs"], dtype=_dtype(row),
            schedule="interleaved-1f1b" if vpp > 1 else "1f1b",
            sequence_parallel=knobs["sp"], recompute=knobs["recompute"], zero=knobs["zero"],
            recompute_layers=_int(row, "recompute_layers") if _raw(row, "recompute_layers") else None,
            zero_shard_group=min(hw.devices_per_node, dp) if _hybrid(row) and knobs["zero"] else None,
            pp_layout=_partition(row, layers, pp) if vpp == 1 else None,
        )  # fmt: skip
        layout.check_model(model)
    except ValueError as e:
        raise RowError(str(e)) from None
    return RowSpec(
        model, layout, hw, runtime, convention_for(row),
        n_gpus, source_key(row), tuple(assumed),
    )  # fmt: skip


def simulate_row(spec: RowSpec, *, exact: bool = True, hardware: Hardware | None = None) -> Result:
    """``simulate`` of the row's layout (on ``hardware`` instead of the row's, if given)."""
    hw = spec.hardware if hardware is None else hardware
    return simulate(spec.model, spec.layout, hw, runtime=spec.runtime, exact=exact)


def describe_layout(layout: Layout) -> str:
    cp = f"cp={layout.cp} {layout.cp_mode} " if layout.cp > 1 else ""
    part = f"x{layout.recompute_layers}" if layout.recompute_layers is not None else ""
    return (
        f"tp={layout.tp} pp={layout.pp} {cp}dp={layout.dp} vpp={layout.vpp} "
        f"mbs={layout.micro_batch_size} recompute={layout.recompute}{part} "
        f"sp={int(layout.sequence_parallel)} zero={layout.zero}"
    )


def predict_row(row: dict) -> dict:
    """``row`` with the prediction and error columns added (module doc)."""
    out = dict(row)
    for col in PRED_COLUMNS:
        out[col] = ""
    try:
        spec = row_spec(row)
        layout, res = spec.layout, simulate_row(spec)
    except ValueError as e:  # RowError, or a layout / hardware the simulator refuses
        out["pred_note"] = str(e)
        return out
    tflops = res.hw_tflops_per_device if spec.convention == "hardware" else res.tflops_per_device
    out.update(
        pred_iter_s=f"{res.iter_time_s:.4g}",
        pred_tflops_gpu=f"{tflops:.4g}",
        pred_mfu=f"{res.mfu:.4f}",
        pred_hfu=f"{res.hfu:.4f}",
        pred_mem_gb=f"{res.peak_mem_bytes / 1e9:.4g}",
        pred_tok_s_gpu=f"{res.tokens_per_s / spec.n_gpus:.5g}",
        pred_fits=str(res.fits).lower(),
        pred_layout=describe_layout(layout),
        pred_runtime=spec.runtime,
        pred_hardware=spec.hardware.name,
        flops_convention=spec.convention,
        pred_note="; ".join(
            ([] if res.fits else ["does not fit in device memory"]) + list(spec.assumed)
        ),
    )
    for measured, pred in MEASURED.items():
        meas = _float(row, measured)
        if meas:
            out[f"err_{measured}"] = f"{float(out[pred]) / meas - 1:+.4f}"
    return out


def predict_file(path: str | Path, out_path: str | Path | None = None) -> list[dict]:
    """Predict every row of ``path``; write ``out_path`` (CSV) if given."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ValueError(f"--runs {path}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"--runs {path}: not a CSV text file ({str(e).splitlines()[0]})") from None
    if not rows:
        raise ValueError(f"--runs {path}: no rows (expected a header and one run per line)")
    out = [predict_row(row) for row in rows]
    if out_path is not None:
        columns = list(rows[0].keys())
        for row in out:
            columns += [c for c in row if c not in columns]
        try:
            with Path(out_path).open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns, restval="")
                writer.writeheader()
                writer.writerows(out)
        except OSError as e:
            raise ValueError(f"--out {out_path}: cannot write it ({e.strerror})") from None
    return out


def accuracy(rows: list[dict], column: str = "tflops_gpu") -> dict:
    """Mean absolute percentage error of ``column`` over rows that were simulated and
    have the measurement: {"mape", "worst_id", "worst", "n", "excluded": {id: why}}."""
    errs, excluded = {}, {}
    for row in rows:
        rid = row.get("id", "?")
        err = row.get(f"err_{column}", "")
        if err:
            errs[rid] = abs(float(err))
        else:
            excluded[rid] = row.get("pred_note") or f"no measured {column}"
    if not errs:
        return {"mape": math.nan, "worst_id": None, "worst": math.nan, "n": 0, "excluded": excluded}
    worst = max(errs, key=errs.get)
    return {
        "mape": sum(errs.values()) / len(errs),
        "worst_id": worst,
        "worst": errs[worst],
        "n": len(errs),
        "excluded": excluded,
    }


__all__ = ["PROFILES", "accuracy", "predict_file", "predict_row", "row_spec", "simulate_row"]
