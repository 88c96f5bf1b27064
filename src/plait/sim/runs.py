"""Simulate many runs from a CSV in the schema of ``../shared/data/published_runs.csv``.

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
      (dp may be left out when n_gpus = tp x pp x dp gives it); cp must be 1.
    - kv_heads empty: = heads. ffn empty: 4 x hidden. Architecture: GELU MLP (``gpt2``)
      when ffn = 4 x hidden and there is no grouped-query attention, else SwiGLU
      (``llama``).
    - vpp, sp, zero empty: 1, off, 0. recompute empty: none. precision: bf16 / fp16 / fp32
      as named (default bf16).
    - zero: a leading digit is the stage; "FSDP"/"FULL_SHARD"/"HSDP" is 3,
      "SHARD_GRAD_OP" is 2.
    - Unknown ("?") knobs are set as the published runs were tuned: ``zero ?`` is 1 (a
      sharded optimizer costs no time and saves memory); ``mbs``, ``vpp``, ``recompute``
      and ``sp`` take, among mbs in {1, 2, 4, 8}, vpp in {1} and the divisors of the
      layers per stage, recompute in {none, selective, full} and sp in {off, on}
      (tp > 1), the combination this model predicts fastest among those that fit in
      memory (the least memory if none fits). ``pred_layout`` records the choice.

    gpu -> hardware: "H200" h200, "H100" h100-sxm, "A100" with "40" a100-40gb, other
    "A100" a100-80gb, "V100" v100 (a ``hardware`` column naming a built-in or a YAML
    file wins).

    source -> runtime profile (``runtime.py``; a ``runtime`` column wins): Megatron-Core
    or the Megatron-LM README's H100 tables -> megatron-core; Narayanan et al. SC21
    (Megatron-LM PTD-P) -> megatron-lm; BigScience / Megatron-DeepSpeed ->
    megatron-deepspeed; llm-foundry / FSDP -> fsdp; anything else -> plait.

FLOP conventions
    ``tflops_gpu`` is compared in the source's own convention: hardware FLOPs (with
    recomputation) when the row's notes say the figure counts recomputation / hardware
    FLOPs, else model FLOPs (a ``flops_convention`` column, "model" or "hardware",
    wins). ``pred_tflops_gpu`` is in that convention; ``pred_mfu`` is always model FLOPs
    and ``pred_hfu`` always hardware FLOPs, both as ``plait.model.sizes`` counts them.
"""

from __future__ import annotations

import csv
import itertools
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
MBS_CHOICES = (1, 2, 4, 8)
RECOMPUTE_CHOICES = ("none", "selective", "full")

_SOURCE_RUNTIME = (  # (regex on the source column, runtime profile)
    (r"megatron-core|megatron-lm readme", "megatron-core"),
    (r"sc21|ptd-p", "megatron-lm"),
    (r"bigscience|megatron-deepspeed", "megatron-deepspeed"),
    (r"llm-foundry|mosaic|fsdp", "fsdp"),
)


class RowError(ValueError):
    """This row cannot be simulated; the message goes to ``pred_note``."""


@dataclass(frozen=True)
class RowSpec:
    model: ModelConfig
    layouts: tuple[Layout, ...]  # candidates (one unless some knob was "?")
    hardware: Hardware
    runtime: str
    convention: str  # "model" or "hardware"
    n_gpus: int


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
    if "FSDP" in upper or "FULL_SHARD" in upper or "HSDP" in upper:
        return 3
    raise RowError(f"zero {text!r} is not a ZeRO stage")


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


def row_spec(row: dict) -> RowSpec:
    """Model, candidate layouts, hardware and runtime of one row (module doc)."""
    missing = [c for c in REQUIRED if not _raw(row, c) or _unknown(row, c)]
    if missing:
        raise RowError(f"incomplete configuration: no {', '.join(missing)}")
    cp = _int(row, "cp", 1)
    if cp not in (None, 1):
        raise RowError(f"context parallelism (cp={cp}) is not modelled")
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
    dp = _int(row, "dp", n_gpus // (tp * pp))
    if dp is None:
        dp = n_gpus // (tp * pp)
    if tp * pp * dp != n_gpus:
        raise RowError(f"tp {tp} x pp {pp} x dp {dp} != n_gpus {n_gpus}")
    gbs = _int(row, "gbs_seqs")
    base = dict(dp=dp, tp=tp, pp=pp, global_batch_size=gbs, dtype=_dtype(row))

    mbs = _int(row, "mbs", 1)
    vpp = _int(row, "vpp", 1)
    sp = _int(row, "sp", 0)
    zero = _zero(row)
    recompute = _recompute(row)
    per_dp = gbs // dp
    mbs_opts = [mbs] if mbs else [b for b in MBS_CHOICES if per_dp % b == 0] or [1]
    per_stage = layers // pp if layers % pp == 0 else 1
    vpp_opts = [vpp] if vpp else [1] + [v for v in range(2, per_stage + 1) if per_stage % v == 0]
    sp_opts = [bool(sp)] if sp is not None else ([False, True] if tp > 1 else [False])
    rc_opts = [recompute] if recompute else list(RECOMPUTE_CHOICES)
    layouts = []
    for b, v, s, rc in itertools.product(mbs_opts, vpp_opts, sp_opts, rc_opts):
        if (v > 1 and pp == 1) or gbs % (b * dp):
            continue
        if v > 1 and (gbs // (b * dp)) % pp:
            continue
        try:
            layout = Layout(
                **base,
                micro_batch_size=b,
                vpp=v,
                schedule="interleaved-1f1b" if v > 1 else "1f1b",
                sequence_parallel=s,
                recompute=rc,
                zero=1 if zero is None else zero,
            )
            layout.check_model(model)
        except ValueError:
            continue
        layouts.append(layout)
    if not layouts:
        raise RowError("no layout of this row is valid (check tp, pp, dp and the batch)")
    return RowSpec(
        model, tuple(layouts), hardware_for(row), runtime_for(row), convention_for(row), n_gpus
    )


def best_result(spec: RowSpec, margin: float = 0.03) -> tuple[Layout, Result]:
    """The candidate predicted fastest among those that fit (else the least memory).

    All candidates are first ranked with the closed-form pipeline (``exact=False``);
    those within ``margin`` of the best (at most three) are then simulated by replaying
    their schedules, and the fastest that fits wins."""

    def run(layout: Layout, exact: bool) -> tuple[Layout, Result]:
        res = simulate(spec.model, layout, spec.hardware, runtime=spec.runtime, exact=exact)
        return layout, res

    if len(spec.layouts) == 1:
        return run(spec.layouts[0], True)
    quick = [run(layout, False) for layout in spec.layouts]
    fitting = sorted((lr for lr in quick if lr[1].fits), key=lambda lr: lr[1].iter_time_s)
    if not fitting:
        return run(min(quick, key=lambda lr: lr[1].peak_mem_bytes)[0], True)
    cutoff = fitting[0][1].iter_time_s * (1 + margin)
    exact = [run(layout, True) for layout, r in fitting[:3] if r.iter_time_s <= cutoff]
    fit_exact = [lr for lr in exact if lr[1].fits] or exact
    return min(fit_exact, key=lambda lr: lr[1].iter_time_s)


def describe_layout(layout: Layout) -> str:
    return (
        f"tp={layout.tp} pp={layout.pp} dp={layout.dp} vpp={layout.vpp} "
        f"mbs={layout.micro_batch_size} recompute={layout.recompute} "
        f"sp={int(layout.sequence_parallel)} zero={layout.zero}"
    )


def predict_row(row: dict) -> dict:
    """``row`` with the prediction and error columns added (module doc)."""
    out = dict(row)
    for col in PRED_COLUMNS:
        out[col] = ""
    try:
        spec = row_spec(row)
        layout, res = best_result(spec)
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
        pred_note="" if res.fits else "does not fit in device memory",
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


__all__ = ["PROFILES", "accuracy", "predict_file", "predict_row", "row_spec"]
