"""How far the performance model was from published runs it was not fitted on, by the
software and GPU type of the run: what ``plait simulate`` and ``plait plan`` print beside a
prediction, so a step time is never shown without the error the same model made on
runs like it.

The figures are ``sim/validate.py``'s leave-one-source-out errors (each source predicted
with ``gemm_max`` fitted on the other sources), grouped by the run's runtime profile and
GPU type. ``python benchmarks/simulator_accuracy.py --published --write-held-out``
rewrites them; ``tests/test_sim_runs.py`` fails when the model moves and they were not
rewritten. No torch, no numpy: read by the CLI as it prints.
"""

from __future__ import annotations

BEGIN, END = "# -- figures: begin --", "# -- figures: end --"

# (runtime, GPU type): (rows, mean |error|, worst row's error, worst row); ALL over every row
# fmt: off
# -- figures: begin --
GROUPS = {
    ("deepspeed-zero3", "a100"): (6, 0.11709, 0.298957, "ntk21_t2_zero3_175b_1536"),
    ("fms-fsdp", "a100"): (4, 0.048226, -0.073606, "ibmfsdp_a100_7B"),
    ("fms-fsdp", "h100"): (4, 0.095698, -0.158043, "ibmfsdp_h100_7B"),
    ("fsdp", "h100"): (6, 0.041752, 0.075932, "mosaic_h100_70b_128"),
    ("fsdp-torch2.0", "a100"): (16, 0.057084, 0.148342, "mosaic2_a100_30b_s2048_8"),
    ("fsdp-torch2.0", "h100"): (6, 0.07126, 0.160257, "mosaic2_h100_30b_s2048_32"),
    ("fsdp2", "a100"): (5, 0.02825, -0.046072, "titan_a100_llama3-8b_bs1_sel_layer"),
    ("megatron-core", "h100"): (9, 0.09167, 0.327924, "mlm_readme_h100_32B"),
    ("megatron-deepspeed", "a100"): (32, 0.067268, -0.195989, "bloom_jz_181b_dp8_tp8_pp6_mbs4_gbs1568"),
    ("megatron-lm", "a100"): (16, 0.022475, 0.086282, "ntk21_t1_4"),
    ("megatron-lm-2022", "a100"): (9, 0.040519, 0.093797, "kort22_1t_full"),
}
ALL = (113, 0.059405, 0.327924, "mlm_readme_h100_32B")
# -- figures: end --
# fmt: on


GPU_TYPES = ("a100", "h100", "h200", "v100")


def gpu_type(hardware_name: str) -> str:
    """The GPU type of a hardware entry's name: a100, h100, h200, v100, else the name."""
    for fam in GPU_TYPES:
        if hardware_name.startswith(fam):
            return fam
    return hardware_name


def describe(runtime: str, hardware_name: str) -> str:
    """One line: the held-out error of published runs with this runtime on this GPU type,
    and over every published row."""
    fam = gpu_type(hardware_name)
    shown = fam.upper() if fam in GPU_TYPES else fam
    n, mean, worst, _ = ALL
    ratio = max(1 + worst, 1 / (1 + worst))
    everything = f"all {n} published rows: mean |error| {mean:.1%}, worst x{ratio:.2f}"
    if (runtime, fam) not in GROUPS:
        return f"no published run of runtime {runtime} on {shown} to check it on; {everything}"
    rows, mean, worst, row = GROUPS[(runtime, fam)]
    return (
        f"published runs of runtime {runtime} on {shown}, each source held out: mean "
        f"|error| {mean:.1%}, worst {worst:+.1%} ({row}; {rows} rows); {everything}"
    )
