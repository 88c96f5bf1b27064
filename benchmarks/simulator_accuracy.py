"""Does the performance model, calibrated on this machine, predict plait's own step times?

    python benchmarks/simulator_accuracy.py                      # calibrate, then compare
    python benchmarks/simulator_accuracy.py --work runs/acc --reuse   # re-predict old runs
    python benchmarks/simulator_accuracy.py --json results.json

1. ``plait calibrate --procs P`` measures this machine into a hardware file for each
   process count P of the layouts (1, 2 and 4), just before the P-process runs: a device
   is a worker process, measured while P of them are busy, so a host with fewer cores
   than processes is described as the workers see it. ``--hardware FILE`` uses one file
   for every layout instead.
2. ``plait train`` runs a small GPT (4 x 128, seq 128, 16 sequences a step, fp32, bytes
   tokenizer, one thread per worker) for ``--steps`` steps in each of ``LAYOUTS`` (1-4
   processes: data, tensor and pipeline parallelism, the schedules, ZeRO stages); the
   measured step time is the median of ``step_time_s`` in ``metrics.jsonl`` past the
   first ``--warmup`` steps.
3. ``simulate`` (what ``plait simulate --hardware FILE`` prints) predicts each layout from
   the run's own resolved ``config.yaml``, with the file of its process count.
4. ``plait plan --hardware FILE`` picks a layout for each process count of the set; the
   fastest predicted of those is trained too, and compared with the fastest measured.

Prints the table (layout, predicted, measured, error), the mean absolute error, the
Spearman rank correlation of predicted and measured times, and the plan check. Runs take
a few minutes: process start-up (importing torch in every worker) dominates.
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


def train(name: str, flags: list[str], work: Path, steps: int, warmup: int, reuse: bool) -> dict:
    """Run ``plait train`` once; the median step time past ``warmup`` steps."""
    out = work / name.replace(" ", "_").replace(":", "")
    cmd = ["train", *MODEL, "--global-batch-size", str(BATCH), *flags, "--steps", str(steps),
           "--tokenizer", "bytes", "--data", str(corpus(work)), "--cache-dir", str(work / "cache"),
           "--eval-every", "0", "--eval-batches", "1", "--threads", "1", "--no-progress",
           "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    if not (reuse and (out / "metrics.jsonl").exists()):
        proc = plait(*cmd)
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    times = [r["step_time_s"] for r in records[warmup:]]
    return {"measured": statistics.median(times), "spread": (min(times), max(times)),
            "run": str(out), "wall": time.perf_counter() - t0}  # fmt: skip


def predict(run: str, hw) -> float:
    """``simulate`` on the run's resolved config (vocabulary of its tokenizer included)."""
    import yaml

    from plait.sim import simulate
    from plait.train.config import RunConfig

    cfg = RunConfig.from_dict(yaml.safe_load((Path(run) / "config.yaml").read_text()))
    return simulate(cfg.model, cfg.layout, hw).iter_time_s


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def plan_choice(files: dict[int, str], work: Path) -> tuple[str, list[str], float]:
    """The fastest predicted plan over the process counts: (label, train flags, seconds)."""
    best = None
    for n, hardware in sorted(files.items()):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", help="one hardware file for all (default: calibrate now)")
    ap.add_argument("--quick-calibration", action="store_true", help="plait calibrate --quick")
    ap.add_argument("--reuse", action="store_true", help="keep runs already in --work")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--work", help="folder for runs (default: a temporary one)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", help="comma-separated layout names")
    args = ap.parse_args()

    from plait.sim.hardware import load_hardware

    work = Path(args.work or tempfile.mkdtemp(prefix="plait-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layouts = LAYOUTS
    if args.only:
        keep = {x.strip() for x in args.only.split(",")}
        layouts = [(n, f) for n, f in LAYOUTS if n in keep]
    worlds = sorted({_world(f) for _, f in layouts})
    files, hws, rows = {}, {}, []
    for n in worlds:  # calibrate for n processes, then run the n-process layouts right away
        files[n] = args.hardware or str(work / f"calibrated-{n}.yaml")
        if not args.hardware and not (args.reuse and Path(files[n]).exists()):
            quick = ["--quick"] if args.quick_calibration else []
            proc = plait("calibrate", "--procs", str(n), "--out", files[n], *quick)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            print(f"calibrated for {n} process(es): {proc.stdout.strip().splitlines()[-1]}",
                  flush=True)  # fmt: skip
        hws[n] = load_hardware(path=files[n])
        for name, flags in layouts:
            if _world(flags) != n:
                continue
            r = train(name, flags, work, args.steps, args.warmup, args.reuse)
            if "error" in r:
                print(f"  {name}: skipped ({r['error']})", flush=True)
                continue
            r.update(name=name, predicted=predict(r["run"], hws[n]))
            rows.append(r)
            print(f"  {name:<20} predicted {r['predicted']:.3f} s  measured "
                  f"{r['measured']:.3f} s ({r['wall']:.0f} s)", flush=True)  # fmt: skip

    plan = plan_choice(files, work)
    if plan is not None:
        r = train("plan " + plan[0], plan[1], work, args.steps, args.warmup, args.reuse)
        if "error" not in r:
            world = yaml_world(plan[1][1])
            r.update(name=plan[0], predicted=predict(r["run"], hws[world]))

    print(f"\n{'layout':<22}{'predicted':>11}{'measured':>11}{'error':>8}   "
          f"(min..max measured; error against the min)")  # fmt: skip
    for x in rows:
        err = x["predicted"] / x["measured"] - 1
        lo, hi = x["spread"]
        print(f"{x['name']:<22}{x['predicted']:>10.3f}s{x['measured']:>10.3f}s{err:>+8.0%}"
              f"   ({lo:.3f}..{hi:.3f}; {x['predicted'] / lo - 1:+.0%})")  # fmt: skip
    for stat, key in (("median", "measured"), ("min", None)):
        meas = [x[key] if key else x["spread"][0] for x in rows]
        errors = [abs(x["predicted"] / m - 1) for x, m in zip(rows, meas)]
        rho = spearman([x["predicted"] for x in rows], meas)
        within = sum(e <= 0.2 for e in errors)
        print(f"{'against the ' + stat + ' step:':<24}mean absolute error "
              f"{statistics.mean(errors):.0%}, {within} of {len(rows)} within 20%; Spearman "
              f"rank correlation {rho:.2f}")  # fmt: skip
    fastest = min(rows, key=lambda x: x["measured"])
    if plan is not None and "error" not in r:
        gap = r["measured"] / fastest["measured"] - 1
        print(f"plan       {plan[0]}: predicted {r['predicted']:.3f} s, measured "
              f"{r['measured']:.3f} s, {gap:+.0%} against the fastest measured "
              f"({fastest['name']}, {fastest['measured']:.3f} s)")  # fmt: skip
        rows.append({**r, "plan": True})
    print(f"hardware   {', '.join(sorted(set(files.values())))}; "
          f"{time.perf_counter() - t0:.0f} s in all")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def yaml_world(path: str) -> int:
    import yaml

    d = yaml.safe_load(Path(path).read_text())
    return d.get("dp", 1) * d.get("tp", 1) * d.get("pp", 1)


def _world(flags: list[str]) -> int:
    n = 1
    for axis in ("--dp", "--tp", "--pp"):
        if axis in flags:
            n *= int(flags[flags.index(axis) + 1])
    return n


if __name__ == "__main__":
    sys.exit(main())
