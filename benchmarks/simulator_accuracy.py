"""Does the performance model predict runs it was not fitted on?

    python benchmarks/simulator_accuracy.py --published           # published runs only (~3 s)
    python benchmarks/simulator_accuracy.py --published --write-held-out  # and sim/held_out.py
    python benchmarks/simulator_accuracy.py --published --per-source  # each source's own fit
    python benchmarks/simulator_accuracy.py                       # both parts below
    python benchmarks/simulator_accuracy.py --quick-calibration --only "single,dp2,tp2,pp2 1f1b,dp2 zero3"
    python benchmarks/simulator_accuracy.py --rounds 5 --json results.json
    python benchmarks/simulator_accuracy.py --hardware calibrated.yaml --only dp2,tp2

Part 1, published runs (``plait.sim.validate``): every row of
``benchmarks/data/published_runs.csv`` and ``benchmarks/data/published_runs_more.csv``,
each source predicted with ``gemm_max`` fitted on the other sources only; prints the
held-out error per source and per row. ``--per-source`` also fits each source on its own
(``validate.per_source_fits``): the error no shared ``gemm_max`` can go below.

Part 2, this machine:

1. ``plait calibrate --procs 4`` measures this machine into a hardware file at the start
   of every round (the host's speed drifts by tens of percent over minutes, so each
   round's runs are predicted from a calibration taken just before them; the first file
   also feeds the planner): compute measured with as many workers busy as there are
   cores, collectives over 2..4 worker processes, and the number of cores
   (``compute_slots_per_node``) with which the simulator shares them when a layout runs
   more single-thread workers than that (``plait.sim.simulate``, "time sharing").
2. ``plait train`` runs a small GPT (4 x 128, seq 128, 16 sequences a step, fp32, bytes
   tokenizer, one thread per worker) for ``--steps`` steps in each of ``LAYOUTS`` (1-4
   processes: data, tensor and pipeline parallelism, the schedules, ZeRO stages), in
   ``--rounds`` rounds that visit every layout once, so that each layout is sampled at
   several moments (a shared host's speed drifts by tens of percent within minutes); a
   layout's measured step time is the median of its ``step_time_s`` (``metrics.jsonl``)
   past the first ``--warmup`` steps of each run, pooled over the rounds.
3. ``simulate`` (what ``plait simulate --hardware FILE`` prints) predicts each run from
   its own resolved ``config.yaml`` and its round's file; a layout's prediction is the
   median over its rounds.
4. ``plait plan --hardware FILE --gpus P`` for P = 1, 2, 4: the fastest predicted of the
   three plans is trained too (as many rounds), and compared with the fastest measured.

Prints the table (layout, predicted, measured, error), the mean absolute error, the
Spearman rank correlation of predicted and measured times, and the plan check. Takes about
17 minutes with 3 rounds: process start-up (importing torch in every worker) dominates
each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

MODEL = ["--model", "tiny", "--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "128"]
BATCH = 16
LAYOUTS = [  # (name, plait train flags)
    ("single", []),
    ("dp2", ["--dp", "2"]),
    ("dp4", ["--dp", "4"]),
    ("tp2", ["--tp", "2"]),
    ("pp2 1f1b", ["--pp", "2", "--schedule", "1f1b", "--micro-batch-size", "4"]),
    ("pp2 gpipe", ["--pp", "2", "--schedule", "gpipe", "--micro-batch-size", "4"]),
    (
        "pp2 interleaved v2",
        ["--pp", "2", "--vpp", "2", "--schedule", "interleaved-1f1b", "--micro-batch-size", "4"],
    ),  # fmt: skip
    ("dp2 zero1", ["--dp", "2", "--zero", "1"]),
    ("dp2 zero3", ["--dp", "2", "--zero", "3"]),
    ("tp2 dp2", ["--tp", "2", "--dp", "2"]),
    ("pp2 dp2", ["--pp", "2", "--dp", "2", "--micro-batch-size", "4"]),
]


def plait(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def corpus(folder: Path) -> Path:
    path = folder / "data.txt"
    if not path.exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        names = ("argparse.py", "dataclasses.py", "enum.py")
        path.write_text("".join((stdlib / n).read_text() for n in names))
    return path


def train(name: str, flags: list[str], work: Path, steps: int, warmup: int, round_: int) -> dict:
    """Run ``plait train`` once; its step times past ``warmup`` steps."""
    out = work / f"{name.replace(' ', '_').replace(':', '')}-r{round_}"
    cmd = ["train", *MODEL, "--global-batch-size", str(BATCH), *flags, "--steps", str(steps),
           "--tokenizer", "bytes", "--data", str(corpus(work)), "--cache-dir", str(work / "cache"),
           "--eval-every", "0", "--eval-batches", "1", "--threads", "1", "--no-progress",
           "--out", str(out)]  # fmt: skip
    proc = plait(*cmd)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return {"times": [r["step_time_s"] for r in records[warmup:]], "run": str(out)}


def predict(run: str, hw) -> float:
    """``simulate`` on the run's resolved config (vocabulary of its tokenizer included)."""
    import yaml

    from plait.sim import simulate
    from plait.train.config import RunConfig

    cfg = RunConfig.from_dict(yaml.safe_load((Path(run) / "config.yaml").read_text()))
    return simulate(cfg.model, cfg.layout, hw).iter_time_s


def plan_choice(hardware: str, work: Path, worlds) -> tuple[str, list[str], float]:
    """The fastest predicted plan over the process counts: (label, train flags, seconds)."""
    best = None
    for n in worlds:
        proc = plait("plan", *MODEL, "--vocab-size", "256", "--global-batch-size", str(BATCH),
                     "--gpus", str(n), "--hardware", hardware, "--dtype", "fp32", "--json",
                     "--top", "1", "--out", str(work / f"plan-{n}.yaml"))  # fmt: skip
        if proc.returncode != 0:
            print(f"  plan --gpus {n}: {proc.stderr.strip()}")
            continue
        entry = json.loads(proc.stdout)[0]
        if best is None or entry["iter_time_s"] < best[2]:
            lay = entry["layout"]
            flags = ["--config", str(work / f"plan-{n}.yaml")]
            label = (f"plan: dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} {lay['schedule']} "
                     f"v{lay['vpp']} mbs{lay['micro_batch_size']} z{lay['zero']} "
                     f"{lay['recompute']}" + (" sp" if lay["sequence_parallel"] else ""))  # fmt: skip
            best = (label, flags, entry["iter_time_s"])
    return best


PUBLISHED = [
    Path(__file__).resolve().parent / "data" / "published_runs.csv",
    Path(__file__).resolve().parent / "data" / "published_runs_more.csv",
]


HELD_OUT = Path(__file__).resolve().parents[1] / "src" / "plait" / "sim" / "held_out.py"


def published(rows: bool = True, write_held_out: bool = False, per_source: bool = False) -> None:
    """Part 1: leave-one-source-out predictions of the published runs (``write_held_out``:
    their errors by runtime and GPU type into ``src/plait/sim/held_out.py`` too)."""
    from plait.sim import validate

    t0 = time.perf_counter()
    report = validate.cross_validate([p for p in PUBLISHED if p.exists()])
    if write_held_out:
        validate.write_held_out(report, HELD_OUT)
        print(f"wrote {HELD_OUT}")
    print("published runs, each source predicted by a fit on the others (step time):")
    print(validate.table(report))
    if rows:
        print(validate.rows_table(report))
    bloom = [p for p in report.predictions if p.case.id.startswith("bloom_jz_181b")]
    if bloom:
        rho = validate.spearman([p.predicted_s for p in bloom], [p.case.measured_s for p in bloom])
        print(f"BLOOM's sweep of one 181B model ({len(bloom)} layouts on 384 A100s): Spearman "
              f"rank correlation of predicted and measured step times {rho:.2f}")  # fmt: skip
    print(f"({len(report.skipped)} rows not compared: {', '.join(sorted(report.skipped))}; "
          f"{time.perf_counter() - t0:.1f} s)\n")  # fmt: skip
    if per_source:
        fits, floor = validate.per_source_fits([p for p in PUBLISHED if p.exists()])
        print("each source fitted on its own (in sample, formula pipeline):")
        for (gpu, source), (level, err) in fits.items():
            print(f"  {gpu:5s} {source[:44]:44s} gemm_max {level:.2f}  mean |error| "
                  f"{100 * err:.1f}%")  # fmt: skip
        print(f"  all rows at their own source's level: {100 * floor:.2f}% (held out: "
              f"{100 * report.mean_error:.2f}%)\n")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--published", action="store_true", help="part 1 only (no training)")
    ap.add_argument("--write-held-out", action="store_true",
                    help="write part 1's errors by runtime and GPU type into "
                    "src/plait/sim/held_out.py (what plait simulate and plan print)")  # fmt: skip
    ap.add_argument(
        "--per-source",
        action="store_true",
        help="part 1: also fit each source on its own (the error's floor)",
    )
    ap.add_argument("--no-published", action="store_true", help="part 2 only")
    ap.add_argument("--hardware", help="one hardware file for every round (default: "
                    "plait calibrate --procs 4 before each round)")  # fmt: skip
    ap.add_argument("--quick-calibration", action="store_true", help="plait calibrate --quick")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every layout, interleaved")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps of each run left out")
    ap.add_argument("--work", help="folder for runs (default: a temporary one)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", help="comma-separated layout names")
    ap.add_argument("--no-plan", action="store_true", help="skip the plan check")
    args = ap.parse_args()
    if not args.no_published:
        published(write_held_out=args.write_held_out, per_source=args.per_source)
        if args.published:
            return 0

    from plait.sim.hardware import load_hardware

    work = Path(args.work or tempfile.mkdtemp(prefix="plait-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layouts = LAYOUTS
    if args.only:
        keep = {x.strip() for x in args.only.split(",")}
        layouts = [(n, f) for n, f in LAYOUTS if n in keep]
    worlds = sorted({_world(f) for _, f in layouts})

    def calibrate(r: int) -> str:
        if args.hardware:
            return args.hardware
        path = str(work / f"calibrated-r{r}.yaml")
        quick = ["--quick"] if args.quick_calibration else []
        proc = plait("calibrate", "--procs", str(max(worlds)), "--out", path, *quick)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        print(f"round {r + 1}: {proc.stdout.strip().splitlines()[-1]}", flush=True)
        return path

    first = calibrate(0)
    plan = None if args.no_plan else plan_choice(first, work, worlds)
    todo = list(layouts) + ([(plan[0], plan[1])] if plan else [])
    runs: dict[str, dict] = {name: {"times": [], "predicted": []} for name, _ in todo}
    for r in range(args.rounds):
        hw = load_hardware(path=first if r == 0 else calibrate(r))
        order = todo[r % len(todo) :] + todo[: r % len(todo)]  # a different neighbour each round
        for name, flags in order:
            res = train(name, flags, work, args.steps, args.warmup, r)
            if "error" in res:
                print(f"  {name}: failed ({res['error']})", flush=True)
                continue
            runs[name]["times"] += res["times"]
            runs[name]["predicted"].append(predict(res["run"], hw))
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    rows = []
    for name, _ in todo:
        x = runs[name]
        if not x["times"]:
            continue
        times = sorted(x["times"])
        spread = (_quantile(times, 0.1), _quantile(times, 0.9))
        rows.append({"name": name, "predicted": statistics.median(x["predicted"]),
                     "measured": statistics.median(times), "spread": spread,
                     "samples": len(times), "plan": plan is not None and name == plan[0]})  # fmt: skip

    print(f"\n{'layout':<22}{'predicted':>11}{'measured':>11}{'error':>8}   "
          f"(10th..90th percentile of the measured steps)")  # fmt: skip
    for x in rows:
        err = x["predicted"] / x["measured"] - 1
        lo, hi = x["spread"]
        print(f"{x['name']:<22}{x['predicted']:>10.3f}s{x['measured']:>10.3f}s{err:>+8.0%}"
              f"   ({lo:.3f}..{hi:.3f}, {x['samples']} steps)")  # fmt: skip
    bench = [x for x in rows if not x["plan"]]
    errors = [abs(x["predicted"] / x["measured"] - 1) for x in bench]
    from plait.sim import validate

    rho = validate.spearman([x["predicted"] for x in bench], [x["measured"] for x in bench])
    print(f"mean absolute error {statistics.mean(errors):.0%}, {sum(e <= 0.2 for e in errors)} of "
          f"{len(bench)} within 20%, worst {max(errors):.0%}; Spearman rank correlation "
          f"{rho:.2f}")  # fmt: skip
    fastest = min(bench, key=lambda x: x["measured"])
    for x in rows:
        if x["plan"]:
            gap = x["measured"] / fastest["measured"] - 1
            print(f"plan       {x['name']}: predicted {x['predicted']:.3f} s, measured "
                  f"{x['measured']:.3f} s, {gap:+.0%} against the fastest measured "
                  f"({fastest['name']}, {fastest['measured']:.3f} s)")  # fmt: skip
    print(f"hardware   {first if args.hardware else work / 'calibrated-r*.yaml'}; "
          f"{time.perf_counter() - t0:.0f} s in all")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _quantile(sorted_times: list[float], f: float) -> float:
    return sorted_times[min(len(sorted_times) - 1, int(f * len(sorted_times)))]


def _world(flags: list[str]) -> int:
    n = 1
    for axis in ("--dp", "--tp", "--pp"):
        if axis in flags:
            n *= int(flags[flags.index(axis) + 1])
    return n


if __name__ == "__main__":
    sys.exit(main())
