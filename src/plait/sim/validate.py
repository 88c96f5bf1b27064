"""The performance model on runs it was not fitted on: leave-one-source-out validation.

Every hardware parameter is a physical quantity with a source (``hardware.py``), except
one per GPU type: ``gemm_max``, the fraction of the dense peak that large matrix
multiplies sustain through a whole training step (clocks under the power limit, cache
and memory traffic of real operands); data sheets give the peak, not this. It is fitted
on published runs -- and a fit is only a validation of runs it did not see. So:

    for each source S (a paper or a repository, ``runs.source_key``):
        fit gemm_max of each GPU type on every row of the other sources
        predict S's rows with it
    report the held-out errors, per row and per source

Step times, not TFLOP/s: each row's measured step time comes from its ``iter_s``, else
its ``tok_s_gpu``, else its ``tflops_gpu`` or ``mfu`` turned into time with the
row's FLOP convention (``measured_time``). The error of a row is predicted / measured
step time - 1; its ratio, the larger of predicted / measured and measured / predicted.

The fit: per GPU type, the grid value of ``gemm_max`` (``GRID``) that minimises the mean
over the training sources of each source's mean absolute log error -- sources count
alike, so a source with thirty layouts of one model does not outvote one with three.
Every row is simulated once per grid value (the closed form, ``simulate(exact=False)``,
as the planner ranks layouts), so the folds themselves cost nothing: a few seconds in
all for ~100 rows (the replays below take about 40 s more). A GPU type with no row outside the held-out source keeps its
built-in value.

The prediction: the row at its fold's value with its pipeline replayed
(``simulate(exact=True)``, ``replayed``), the figure ``plait simulate`` prints. The closed
form (``schedules.pipeline_span``) counts the messages the rank that paces the pipeline
waits on and puts each chunk's last backward where a balanced pipeline's cool-down puts
it. Held out, the two agree: 5.81% both (2026-11-27; 5.76% closed, 5.84% replayed while
the closed form put messages in the fill only). Validating the closed form alone reported
an error for a step ``plait simulate`` does not print.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.sim import held_out, runs
from plait.sim.hardware import Hardware
from plait.sim.runs import RowError, RowSpec

GRID = tuple(round(0.40 + 0.01 * i, 2) for i in range(61))  # gemm_max from 0.40 to 1.00


@dataclass(frozen=True)
class Case:
    """One published row, ready to simulate."""

    id: str
    source: str
    family: str  # GPU type whose gemm_max is fitted
    spec: RowSpec
    measured_s: float  # step time
    measured_from: str  # the column it was read from


@dataclass(frozen=True)
class Prediction:
    case: Case
    predicted_s: float  # held out: fitted without the case's source
    gemm_max: float  # the value it was predicted with
    in_sample_s: float  # with the fit on every source

    @property
    def error(self) -> float:
        return self.predicted_s / self.case.measured_s - 1

    @property
    def ratio(self) -> float:
        r = self.predicted_s / self.case.measured_s
        return max(r, 1 / r)


@dataclass(frozen=True)
class Report:
    predictions: tuple[Prediction, ...]
    skipped: dict[str, str]  # row id -> why it was not compared
    fitted: dict[str, float]  # GPU type -> gemm_max fitted on every source

    @property
    def mean_error(self) -> float:
        return mean_and_worst(self.predictions)[0]

    @property
    def worst(self) -> Prediction:
        return mean_and_worst(self.predictions)[1]

    def by_source(self) -> dict[str, list[Prediction]]:
        out: dict[str, list[Prediction]] = {}
        for p in self.predictions:
            out.setdefault(p.case.source, []).append(p)
        return out


def mean_and_worst(preds) -> tuple[float, Prediction]:
    """Mean absolute error of ``preds`` and the one furthest off (by ratio, either way)."""
    return statistics.mean(abs(p.error) for p in preds), max(preds, key=lambda p: p.ratio)


def family(hw: Hardware) -> str:
    """The GPU type whose curve a hardware entry shares: a100, h100 (H200 too), v100."""
    fam = held_out.gpu_type(hw.name)
    return "h100" if fam == "h200" else fam


def measured_time(row: dict, spec: RowSpec) -> tuple[float, str]:
    """(seconds per step, column) of a row: ``iter_s``, else from ``tok_s_gpu``, else from
    ``tflops_gpu`` in the row's convention, else from ``mfu`` (model FLOPs, dense peak).
    Raises RowError when none is given."""
    from plait.sim import costs

    tokens = spec.layout.global_batch_size * spec.model.seq_len
    model_flops, hw_flops = costs.flops_per_step(spec.model, spec.layout)
    n = spec.n_gpus
    value = {c: runs._float(row, c) for c in ("iter_s", "tok_s_gpu", "tflops_gpu", "mfu")}
    if value["iter_s"]:
        return value["iter_s"], "iter_s"
    if value["tok_s_gpu"]:
        return tokens / (value["tok_s_gpu"] * n), "tok_s_gpu"
    if value["tflops_gpu"]:
        flops = hw_flops if spec.convention == "hardware" else model_flops
        return flops / (value["tflops_gpu"] * 1e12 * n), "tflops_gpu"
    if value["mfu"]:
        peak = spec.hardware.peak(spec.layout.dtype)
        return model_flops / (value["mfu"] * peak * n), "mfu"
    raise RowError("no measured step time, throughput, TFLOP/s or MFU")


def load_cases(paths) -> tuple[list[Case], dict[str, str]]:
    """Every row of the CSV files that can be simulated and has a measurement, and the
    ids of the others with the reason."""
    cases, skipped = [], {}
    for path in paths:
        with Path(path).open(newline="") as f:
            for row in csv.DictReader(f):
                rid = row.get("id", "?")
                try:
                    spec = runs.row_spec(row)
                    seconds, column = measured_time(row, spec)
                except ValueError as e:
                    skipped[rid] = str(e)
                    continue
                cases.append(Case(rid, spec.source, family(spec.hardware), spec, seconds, column))
    return cases, skipped


def with_gemm_max(hw: Hardware, value: float) -> Hardware:
    return hw.replace(efficiency=dataclasses.replace(hw.efficiency, gemm_max=value))


def grid_times(cases: list[Case], grid=GRID) -> np.ndarray:
    """Predicted step time of every case (rows) at every grid value (columns)."""
    out = np.empty((len(cases), len(grid)))
    for i, case in enumerate(cases):
        for j, value in enumerate(grid):
            hw = with_gemm_max(case.spec.hardware, value)
            out[i, j] = runs.simulate_row(case.spec, exact=False, hardware=hw).iter_time_s
    return out


def replayed(case: Case, value: float) -> float:
    """The case's step time at ``gemm_max`` = ``value``, its pipeline replayed
    (``simulate(exact=True)``: what ``plait simulate`` prints)."""
    hw = with_gemm_max(case.spec.hardware, value)
    return float(runs.simulate_row(case.spec, exact=True, hardware=hw).iter_time_s)


def fit(cases: list[Case], log_err: np.ndarray, train: np.ndarray) -> dict[str, int]:
    """Grid index per GPU type minimising the mean over training sources of each source's
    mean absolute log error (module docstring); ``train`` masks the cases used."""
    best = {}
    for fam in sorted({c.family for c in cases}):
        by_source: dict[str, list[int]] = {}
        for i, c in enumerate(cases):
            if train[i] and c.family == fam:
                by_source.setdefault(c.source, []).append(i)
        if not by_source:
            continue
        score = np.mean([np.abs(log_err[idx]).mean(axis=0) for idx in by_source.values()], axis=0)
        best[fam] = int(np.argmin(score))
    return best


def cross_validate(paths, grid=GRID) -> Report:
    """Leave-one-source-out predictions of every usable row of ``paths`` (module doc)."""
    cases, skipped = load_cases(paths)
    if not cases:
        raise ValueError("no published row could be simulated")
    times = grid_times(cases, grid)
    measured = np.array([c.measured_s for c in cases])
    log_err = np.log(times / measured[:, None])
    everything = fit(cases, log_err, np.ones(len(cases), bool))
    sources = np.array([c.source for c in cases])
    out = []
    for case in cases:
        chosen = fit(cases, log_err, sources != case.source).get(case.family)
        if chosen is None:  # no other source on this GPU type: the built-in value
            value = case.spec.hardware.efficiency.gemm_max
        else:
            value = grid[chosen]
        held = replayed(case, value)
        out.append(
            Prediction(case, held, float(value), replayed(case, grid[everything[case.family]]))
        )
    return Report(tuple(out), skipped, {f: grid[j] for f, j in everything.items()})


def per_source_fits(paths, grid=GRID) -> tuple[dict[tuple[str, str], tuple[float, float]], float]:
    """Each (GPU type, source)'s own best ``gemm_max`` on ``grid`` and its mean absolute
    step-time error there, and that mean over every row: the floor no shared level can
    beat, since a common value is one of each source's choices. In sample and on the
    formula pipeline (``grid_times``): a diagnostic of where the error sits, not a
    prediction. 2026-11-28: 5.02% over 113 rows, against 5.94% held out."""
    cases, _ = load_cases(paths)
    times = grid_times(cases, grid)
    errors = np.abs(times / np.array([c.measured_s for c in cases])[:, None] - 1)
    out, every = {}, []
    for key in sorted({(c.family, c.source) for c in cases}):
        idx = [i for i, c in enumerate(cases) if (c.family, c.source) == key]
        j = int(np.argmin(errors[idx].mean(axis=0)))
        out[key] = (float(grid[j]), float(errors[idx, j].mean()))
        every.extend(errors[idx, j])
    return out, float(np.mean(every))


def spearman(a, b) -> float:
    """Rank correlation of two sequences (ties broken by order)."""

    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    n = len(a)
    if n < 2:
        return math.nan
    ra, rb = ranks(list(a)), ranks(list(b))
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def table(report: Report) -> str:
    """The per-source and per-row tables the accuracy benchmark prints."""
    lines = [f"{'source':<42}{'rows':>5}{'mean |err|':>12}{'worst':>9}  worst row"]
    for source, preds in sorted(report.by_source().items()):
        mean, worst = mean_and_worst(preds)
        lines.append(f"{source[:41]:<42}{len(preds):>5}{mean:>12.1%}{worst.error:>+9.1%}  "
                     f"{worst.case.id}")  # fmt: skip
    w = report.worst
    lines.append(
        f"all: {len(report.predictions)} rows, mean |error| {report.mean_error:.1%}, worst "
        f"{w.case.id} {w.error:+.1%} (x{w.ratio:.2f}); fitted on everything: "
        + ", ".join(f"{f} gemm_max {v:.2f}" for f, v in sorted(report.fitted.items()))
    )
    return "\n".join(lines)


def rows_table(report: Report) -> str:
    lines = [f"{'row':<46}{'GPU':>5}{'measured':>11}{'held out':>11}{'error':>8}"
             f"{'gemm_max':>9}  layout"]  # fmt: skip
    for p in report.predictions:
        lay = p.case.spec.layout
        desc = runs.describe_layout(lay)
        lines.append(f"{p.case.id[:45]:<46}{p.case.family:>5}{p.case.measured_s:>10.4g}s"
                     f"{p.predicted_s:>10.4g}s{p.error:>+8.1%}{p.gemm_max:>9.2f}  {desc}")  # fmt: skip
    return "\n".join(lines)


def held_out_groups(report: Report) -> dict[tuple[str, str], tuple[int, float, float, str]]:
    """(runtime, GPU type) -> (rows, mean |error|, the worst row's error, its id): the
    table ``sim/held_out.py`` holds."""
    groups: dict[tuple[str, str], list[Prediction]] = {}
    for p in report.predictions:
        key = (p.case.spec.runtime, held_out.gpu_type(p.case.spec.hardware.name))
        groups.setdefault(key, []).append(p)
    out = {}
    for key, preds in sorted(groups.items()):
        mean, w = mean_and_worst(preds)
        out[key] = (len(preds), round(mean, 6), round(w.error, 6), w.case.id)
    return out


def held_out_block(report: Report) -> str:
    """The figures of ``sim/held_out.py`` (the lines between its markers) for this report,
    as ruff formats them."""

    def tup(values) -> str:
        return "(" + ", ".join(json.dumps(x) for x in values) + ")"

    groups = "".join(f"    {tup(k)}: {tup(v)},\n" for k, v in held_out_groups(report).items())
    w = report.worst
    everything = (len(report.predictions), round(report.mean_error, 6), round(w.error, 6),
                  w.case.id)  # fmt: skip
    return f"GROUPS = {{\n{groups}}}\nALL = {tup(everything)}\n"


def write_held_out(report: Report, path: Path) -> None:
    """Replace the figures of ``sim/held_out.py`` at ``path`` (the lines between its
    ``BEGIN`` and ``END`` marker lines) with this report's."""
    lines = Path(path).read_text().split("\n")
    a, b = lines.index(held_out.BEGIN), lines.index(held_out.END)
    lines[a + 1 : b] = held_out_block(report).rstrip("\n").split("\n")
    Path(path).write_text("\n".join(lines))
