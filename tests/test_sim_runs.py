"""The performance model against published runs it was not fitted on, and the
``plait simulate --runs`` round trip.

The rows: benchmarks/data/published_runs.csv and benchmarks/data/published_runs_more.csv.
The validation (``sim/validate.py``) leaves one source out at a time: the fitted
parameter (``gemm_max`` per GPU type) comes from the other sources, the held-out rows are
predicted with it. Thresholds (issue 16, tightened under issue 25 to what the model now
holds with some margin: 8.1%, x1.40, Spearman 0.51): mean absolute step-time error <= 9%
over every usable row, no row off by more than 1.45x either way, and BLOOM's sweep of one
181B model ranked with Spearman >= 0.45. Pure computation: about a minute (the held-out
rows are replayed, ``validate.replayed``).
"""

import argparse
import csv
from pathlib import Path

import numpy as np
import pytest

from plait.cli_args import layout_parent, model_parent
from plait.commands import simulate as sim_cli
from plait.sim import runs, validate

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "published_runs.csv"
MORE = REPO / "benchmarks" / "data" / "published_runs_more.csv"
INCOMPLETE = {"mlm_readme_h100_strong_96", "mlm_readme_h100_strong_4608"}  # no tp, pp


def published_rows() -> list[dict]:
    with DATA.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def predictions():
    return runs.predict_file(DATA)


@pytest.fixture(scope="module")
def held_out():
    return validate.cross_validate([DATA, MORE])


@pytest.fixture(scope="module")
def grid():
    """Every usable row, and its log error at every grid value of ``gemm_max``."""
    cases, _ = validate.load_cases([DATA, MORE])
    times = validate.grid_times(cases)
    return cases, np.log(times / [[c.measured_s] for c in cases])


def test_bloom_layouts_are_ranked_as_measured(held_out):
    """The 21 layouts of BLOOM's one 181B model on 384 A100s (the same model, data and
    machine: only the layout differs), ranked by held-out predicted step time against the
    measured ranking. Catches a Megatron-DeepSpeed profile that prices its data-parallel
    reduction as a reduce-scatter instead of the BF16 optimizer's fp32 all-reduce (the
    rank correlation falls to 0.31), or one that loses the tp / dp trade-off."""
    bloom = [p for p in held_out.predictions if p.case.id.startswith("bloom_jz_181b")]
    assert len(bloom) == 21
    rho = validate.spearman([p.predicted_s for p in bloom], [p.case.measured_s for p in bloom])
    assert rho >= 0.45, f"Spearman {rho:.2f}\n" + validate.rows_table(held_out)


def test_held_out_error_of_published_runs(held_out, grid):
    """The thresholds, on predictions fitted without their source. Catches a fold that
    sees its own source (the in-sample fit used for the held-out prediction): wherever
    leaving a source out moves the fitted ``gemm_max``, the held-out prediction must use
    the moved value and differ from the in-sample one, and some sources must move."""
    table = validate.table(held_out) + "\n" + validate.rows_table(held_out)
    assert set(held_out.skipped) == INCOMPLETE, table
    assert len(held_out.predictions) >= 100, table
    assert len(held_out.by_source()) >= 6, table
    assert held_out.mean_error <= 0.09, table
    assert held_out.worst.ratio <= 1.45, table
    cases, log_err = grid
    assert [p.case.id for p in held_out.predictions] == [c.id for c in cases]
    sources = np.array([c.source for c in cases])
    everything = validate.fit(cases, log_err, np.ones(len(cases), bool))
    moved = set()
    for p in held_out.predictions:
        fam = p.case.family
        assert held_out.fitted[fam] == validate.GRID[everything[fam]]
        fold = validate.fit(cases, log_err, sources != p.case.source).get(fam)
        if fold is None:  # no other source on this GPU type: the built-in value
            continue
        assert p.gemm_max == validate.GRID[fold], p.case.id
        if fold != everything[fam]:
            moved.add(p.case.source)
            assert p.predicted_s != pytest.approx(p.in_sample_s, rel=1e-6), p.case.id
        else:
            assert p.predicted_s == p.in_sample_s, p.case.id
    assert len(moved) >= 2, moved


def test_the_printed_accuracy_is_the_current_models(held_out, capsys):
    """``plait simulate`` and ``plait plan`` print the held-out error of published runs of
    the same runtime and GPU type (``sim/held_out.py``). Catches a model change that moves
    those errors without rewriting the figures (``python benchmarks/simulator_accuracy.py
    --published --write-held-out``), and a line that names the wrong group."""
    from plait.cli import main
    from plait.sim import held_out as figures

    def same(stored, fresh):  # the figures are rounded to 6 places (the CLI's 1-decimal
        n, mean, worst, row = stored  # percent then rounds as the fresh figure does)
        return (n, row) == (fresh[0], fresh[3]) and mean == pytest.approx(fresh[1], abs=2e-4) \
            and worst == pytest.approx(fresh[2], abs=2e-4)  # fmt: skip

    fresh = validate.held_out_groups(held_out)
    assert figures.GROUPS.keys() == fresh.keys()
    assert all(same(figures.GROUPS[k], fresh[k]) for k in fresh), (figures.GROUPS, fresh)
    w = held_out.worst
    assert same(figures.ALL, (len(held_out.predictions), held_out.mean_error, w.error,
                              w.case.id))  # fmt: skip
    sc21 = [p for p in held_out.predictions if p.case.spec.runtime == "megatron-lm"]
    mean = sum(abs(p.error) for p in sc21) / len(sc21)
    assert main(["simulate", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "16",
                 "--global-batch-size", "1536", "--runtime", "megatron-lm"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("accuracy   published runs of runtime megatron-lm on A100"), line
    assert f"mean |error| {mean:.1%}" in line and f"{len(sc21)} rows" in line, line
    assert "no published run of runtime plait on H200" in figures.describe("plait", "h200")
    assert "on cpu-calibrated to check" in figures.describe("plait", "cpu-calibrated")


def test_a_sources_fold_does_not_see_it(grid):
    """The fold of a source must not see it: with that source's errors moved (its rows
    predicted e times slower at every ``gemm_max``), its fold's fit stays where it was.
    Catches a fold fitted on every source (then some source's move moves its fold)."""
    cases, log_err = grid
    h100 = [i for i, c in enumerate(cases) if c.family == "h100"]
    cases, log_err = [cases[i] for i in h100], log_err[h100]
    sources = np.array([c.source for c in cases])
    assert len(set(sources)) >= 3
    for source in set(sources):
        mine = sources == source
        moved = log_err.copy()
        moved[mine] += 1.0
        fold = validate.fit(cases, log_err, ~mine)["h100"]
        assert validate.fit(cases, moved, ~mine)["h100"] == fold, source


def test_each_sources_own_fit_is_the_floor_of_any_shared_one():
    """``validate.per_source_fits``: each source's level is the best of the grid for its
    own rows, so the mean error over all rows at their sources' levels is at most the
    mean at any one shared level. Catches a fit that maximises, that mixes GPU types
    or sources, or a floor averaged over sources instead of rows."""
    grid = (0.5, 0.6, 0.7, 0.8)
    fits, floor = validate.per_source_fits([DATA, MORE], grid)
    cases, _ = validate.load_cases([DATA, MORE])
    errors = np.abs(validate.grid_times(cases, grid) / [[c.measured_s] for c in cases] - 1)
    assert {(c.family, c.source) for c in cases} == set(fits)
    for key, (level, err) in fits.items():
        idx = [i for i, c in enumerate(cases) if (c.family, c.source) == key]
        assert level in grid and err == pytest.approx(errors[idx].mean(axis=0).min())
    assert floor <= errors.mean(axis=0).min() + 1e-12
    assert floor == pytest.approx(
        np.mean([errors[i, grid.index(fits[(c.family, c.source)][0])] for i, c in enumerate(cases)])
    )


def test_each_source_is_compared_in_its_own_flop_convention(predictions):
    by_id = {r["id"]: r for r in predictions}
    hardware = {i for i, r in by_id.items() if r["flops_convention"] == "hardware"}
    # SC21 Table 1 and BLOOM count recomputation; Megatron-Core and MosaicML report MFU
    assert hardware == {f"ntk21_t1_{i}" for i in range(1, 11)} | {"bloom176b_prod"}
    for i, r in by_id.items():
        if i in INCOMPLETE:
            assert r["pred_tflops_gpu"] == ""
            assert r["pred_note"].startswith("incomplete")
            continue
        pred = float(r["pred_tflops_gpu"])
        peak = 312 if "a100" in r["pred_hardware"] else 989.4
        conv = float(r["pred_hfu"] if i in hardware else r["pred_mfu"])
        assert pred == pytest.approx(conv * peak, rel=2e-3), i
        assert r["pred_fits"] == "true", i


def test_unknown_fields_take_the_frameworks_defaults():
    rows = {r["id"]: r for r in published_rows()}
    spec = runs.row_spec(rows["mlm_readme_h100_462B"])
    lay = spec.layout
    assert spec.runtime == "megatron-core" and spec.hardware.name == "h100-sxm"
    # Megatron's defaults: no recomputation, micro-batch 1; the notes' --overlap-param-gather
    # needs the distributed optimizer, --tp-comm-overlap sequence parallelism, and the
    # overlapped pipeline communication the interleaved schedule: the least one the layout
    # allows (112 layers on 16 stages: 7 a stage, so 7 chunks of one; 96 on 6: 2 of 8)
    assert (lay.vpp, lay.schedule, lay.recompute, lay.micro_batch_size) == (
        7, "interleaved-1f1b", "none", 1)  # fmt: skip
    assert lay.zero == 1 and lay.sequence_parallel
    assert "vpp ?=7" in spec.assumed and "zero ?=1" in spec.assumed
    assert runs.row_spec(rows["mlm_readme_h100_177B"]).layout.vpp == 2
    no_pp = runs.row_spec(rows["mlm_readme_h100_32B"]).layout
    assert no_pp.vpp == 1 and no_pp.schedule == "1f1b"  # nothing to interleave at pp 1
    assert spec.model.ffn_hidden == 4 * 18432 and spec.model.arch == "gpt2"
    sc21 = runs.row_spec(rows["ntk21_t1_5"])
    assert (sc21.layout.vpp, sc21.layout.micro_batch_size, sc21.layout.zero) == (1, 1, 0)
    bloom = runs.row_spec(rows["bloom176b_prod"])
    assert bloom.layout.zero == 1 and bloom.runtime == "megatron-deepspeed"
    mosaic = runs.row_spec(rows["mosaic_h100_3b_128"])
    assert mosaic.layout.zero == 2 and mosaic.runtime == "fsdp"


def test_fabric_partition_and_runtime_of_the_added_rows():
    with MORE.open(newline="") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    jz = runs.row_spec(rows["bloom_jz_176b_70x14336_dp8_tp4_pp12_mbs2"])
    # Jean Zay: 4 x 100 Gb/s Omni-Path per 8-GPU node, where BigScience's all-reduce bench
    # measured a bus bandwidth of 15 Gb/s a GPU (a third of the line rate's share); a row
    # without the measurement keeps 95% of the line rate
    assert jz.hardware.inter_node.bandwidth == pytest.approx(15e9 / 8)
    line_rate = {
        **rows["bloom_jz_176b_70x14336_dp8_tp4_pp12_mbs2"],
        "gpu": "A100 (Omni-Path, 4 links/node)",
    }
    assert runs.row_spec(line_rate).hardware.inter_node.bandwidth == pytest.approx(
        0.95 * 4 * 12.5e9 / 8
    )
    assert jz.hardware.intra_node == runs.get_hardware("a100-80gb").intra_node
    # --pp-partition-method type:transformer|embedding: 70 layers + 2 embedding slots on 12
    assert jz.layout.pp_layout == (5,) + (6,) * 10 + (5,)
    zero3 = runs.row_spec(rows["ntk21_t2_zero3_175b_1536"])
    assert zero3.runtime == "deepspeed-zero3" and zero3.source == "Narayanan et al. SC21"
    assert zero3.layout.zero == 3 and zero3.layout.dp == 1536
    assert runs.row_spec(rows["kort22_1t_sel_sp"]).runtime == "megatron-lm-2022"
    assert runs.row_spec(rows["ntk21_t2_ptdp_175b_384"]).runtime == "megatron-lm"


def parser():
    p = argparse.ArgumentParser(parents=[model_parent(), layout_parent()])
    sim_cli.add_arguments(p)
    return p


def test_cli_runs_round_trip(tmp_path, capsys):
    rows = {r["id"]: r for r in published_rows()}
    keep = ["ntk21_t1_3", "mosaic_h100_7b_128", "mlm_readme_h100_strong_96"]
    src = tmp_path / "runs.csv"
    columns = list(next(iter(rows.values())).keys())
    with src.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for i in keep:
            writer.writerow(rows[i])
        odd = dict(rows["ntk21_t1_3"], id="odd_gpu", gpu="TPU v4")
        writer.writerow(odd)
    out = tmp_path / "pred.csv"
    args = parser().parse_args(["--runs", str(src), "--out", str(out)])
    assert sim_cli.run(args) == 0
    printed = capsys.readouterr().out
    assert "mean absolute error" in printed and "ntk21_t1_3" in printed
    with out.open(newline="") as f:
        got = {r["id"]: r for r in csv.DictReader(f)}
    assert list(got) == keep + ["odd_gpu"]
    assert "vpp ?=1" in got["ntk21_t1_3"]["pred_note"]  # what was assumed is said
    for col in ("pred_iter_s", "pred_tflops_gpu", "pred_mfu", "pred_hfu", "pred_mem_gb",
                "pred_note", "err_tflops_gpu"):  # fmt: skip
        assert col in got["ntk21_t1_3"]
    for i in ("ntk21_t1_3", "mosaic_h100_7b_128"):
        assert float(got[i]["pred_tflops_gpu"]) > 0 and got[i]["err_tflops_gpu"]
        assert got[i]["source"] == rows[i]["source"]  # the input columns are kept
    assert got["mlm_readme_h100_strong_96"]["pred_tflops_gpu"] == ""
    assert "incomplete configuration" in got["mlm_readme_h100_strong_96"]["pred_note"]
    assert "no hardware entry" in got["odd_gpu"]["pred_note"]
    # errors against every measured column present
    assert got["mosaic_h100_7b_128"]["err_mfu"] and got["mosaic_h100_7b_128"]["err_tok_s_gpu"]
    assert got["ntk21_t1_3"]["err_iter_s"] and got["ntk21_t1_3"]["err_hfu"]


def test_cli_runs_missing_file_is_one_line(tmp_path, capsys):
    args = parser().parse_args(["--runs", str(tmp_path / "nope.csv")])
    assert sim_cli.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read" in err[0]


def test_runtime_and_hardware_columns_override(tmp_path):
    rows = {r["id"]: r for r in published_rows()}
    row = dict(rows["ntk21_t1_3"], runtime="plait", hardware="a100-40gb")
    out = runs.predict_row(row)
    assert out["pred_runtime"] == "plait" and out["pred_hardware"] == "a100-40gb"
