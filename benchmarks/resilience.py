"""Resilience: real kills of real workers, and the simulator's view of a large run.

    python benchmarks/resilience.py kills              # >= 20 SIGKILLs, ~3-5 minutes on 2 cores
    python benchmarks/resilience.py kills --signal stop --kills 5 --heartbeat-timeout 3
    python benchmarks/resilience.py kills --zero-replicas 2 --kills 10 --every 60 --batch 64
    python benchmarks/resilience.py linkdown --kills 20  # as root: node 1's link cut, 20 runs
    python benchmarks/resilience.py sim                # GPT-3 175B on 1,024 H100s, a plot
    python benchmarks/resilience.py all --write-results

``kills``: one ``plait train --fault-tolerance 1 --dp 2 --pp 2`` run of the tiny model with
``--chaos-every K`` (the coordinator SIGKILLs a random worker every K steps, at a random
point inside the step; a new worker replaces it and joins at a step boundary; a kill that
falls due while the replacement is still starting holds the run until it has joined, so
the run sees exactly the kills asked for on any machine), then the
same run without failures. It reports, from ``metrics.jsonl`` and the coordinator's event
log: the recovery time of every kill (from the kill to the first step of the new
generation: ``recovery_s``), its median and worst; the steps redone; that every step
1..S appears exactly once (no completed step lost, none applied twice) and how far the
loss curve is from the failure-free run's; throughput (tokens/s, median of steps) with 4
workers before the first kill, with 3 after a kill, and with 4 again after a rejoin.

``--zero-replicas K``: the same with ZeRO-2 inside replicas instead (``--dp 2K --pp 1 --zero
2 --zero-shard-group K``: two replicas of K workers sharding every parameter); a kill takes
a whole replica out until the replacement rejoins, so the next random kill (and the run)
waits for it.

``linkdown`` (root: network namespaces): ``--kills`` runs of ``--dp 2 --pp 2
--fault-tolerance 1`` on two nodes, node 1's launcher in a network namespace joined by a
veth pair, each with node 1's link taken down (on its side: no FIN, no RST, the machine
vanishes) once 5 steps are recorded. Per run: the time from the cut to the first step of
the new generation (the decision's ``t_failure`` + that step's ``recovery_s``, on this
machine's clock), whether the recovery was in place, whether node 1's workers, still
alive, exited as expelled once the link was back, and every step once.

``sim``: ``plait.resilience.availability`` for GPT-3 175B (dp 8 x tp 8 x pp 16, bf16,
selective recomputation, sequence parallelism, 1,536 sequences of 2,048 tokens) on
1,024 H100s, from one failure every 6 hours to one every 10 minutes: the fraction of the
failure-free throughput left under checkpoint-and-restart, in-place recovery and
redundant computation, as a table and a plot (``benchmarks/resilience_sim.png``).

Multi-process parts run under the shared CPU lock when called through the documented
command (``flock /tmp/plait-cpu.lock python benchmarks/resilience.py kills``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
PLOT = Path(__file__).with_name("resilience_sim.png")

TINY = [
    "--model", "tiny", "--layers", "4", "--hidden", "32", "--heads", "2", "--seq-len", "32",
    "--global-batch-size", "8", "--micro-batch-size", "1", "--lr", "3e-3", "--warmup", "2",
    "--eval-every", "0", "--eval-batches", "1", "--tokenizer", "bytes", "--threads", "1",
    "--dp", "2", "--pp", "2",
]  # fmt: skip


def _corpus(folder: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / f).read_text() for f in ("argparse.py", "dataclasses.py", "enum.py"))
    path = folder / "code.txt"
    path.write_text(text)
    return path


def _train(out: Path, data: Path, *extra) -> float:
    """``plait train`` of the tiny model (``TINY``; flags in ``extra`` override its own)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, "--data", str(data),
           "--cache-dir", str(data.parent / "cache"), "--out", str(out), *map(str, extra)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"plait train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (out / "stdout.txt").write_text(proc.stdout)
    return time.perf_counter() - t0


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def _events(run: Path) -> list[dict]:
    path = run / "logs" / "coordinator.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def kills(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = _corpus(tmp)
        steps = args.kills * args.every + args.every
        layout = ["--global-batch-size", args.batch, "--micro-batch-size", args.micro]
        if args.zero_replicas:
            k = args.zero_replicas
            layout += ["--dp", 2 * k, "--pp", 1, "--zero", 2, "--zero-shard-group", k]
        chaos = ["--fault-tolerance", 1, "--chaos-every", args.every, "--chaos-seed", args.seed,
                 "--chaos-signal", args.signal, "--heartbeat-timeout", args.heartbeat_timeout,
                 "--save-every", args.save_every, "--steps", steps, "--no-progress"]  # fmt: skip
        wall = _train(tmp / "chaos", data, *layout, *chaos)
        ref_wall = _train(tmp / "ref", data, *layout, "--steps", steps, "--no-progress")
        recs, ref, events = _records(tmp / "chaos"), _records(tmp / "ref"), _events(tmp / "chaos")
    shots = [e for e in events if e["event"] == "chaos"]
    decisions = {e["gen"]: e for e in events if e["event"] == "decision"}
    # steps completed during a failure are recorded from a survivor's statistics, without
    # a generation or timings: every step once counts them, the timings do not
    timed = [r for r in recs if "generation" in r]
    first_step = {}  # generation -> its first record (its recovery_s: failure -> resumed)
    for r in timed:
        first_step.setdefault(r["generation"], r)
    failures = [g for g, d in decisions.items() if "joined" not in d["why"]]
    joins = [g for g, d in decisions.items() if "joined" in d["why"]]
    rec_s = [first_step[g]["recovery_s"] for g in failures if g in first_step]
    join_s = [first_step[g]["recovery_s"] for g in joins if g in first_step]
    # throughput: steps that are not a generation's first (which includes its recovery)
    firsts = {id(r) for r in first_step.values()}
    before = [r["tokens_per_s"] for r in timed if r["generation"] == 0 and id(r) not in firsts
              and r["step"] > 2]  # fmt: skip
    by_world: dict[int, list[float]] = {}
    for r in timed:
        if r["generation"] > 0 and id(r) not in firsts:
            by_world.setdefault(r["world_size"], []).append(r["tokens_per_s"])
    ref_loss = {r["step"]: r["loss"] for r in ref}
    diffs = [abs(r["loss"] - ref_loss[r["step"]]) for r in recs]
    out = {
        "command": "flock /tmp/plait-cpu.lock python benchmarks/resilience.py kills "
        f"--kills {args.kills} --every {args.every} --signal {args.signal} --seed {args.seed}"
        + (
            f" --batch {args.batch} --micro {args.micro}"
            if (args.batch, args.micro) != (8, 1)
            else ""
        )
        + (f" --zero-replicas {args.zero_replicas}" if args.zero_replicas else ""),
        "steps": steps,
        "kills": len(shots),
        "recoveries": len(rec_s),
        "recovery_median_s": statistics.median(rec_s) if rec_s else None,
        "recovery_worst_s": max(rec_s) if rec_s else None,
        "recovery_all_s": [round(x, 3) for x in rec_s],
        "rejoins": len(join_s),
        "rejoin_median_s": statistics.median(join_s) if join_s else None,
        "steps_redone": sum(decisions[g]["redone"] for g in failures),
        "steps_rolled_forward": len(recs) - len(timed),
        "fallbacks": sum(d["start"] == "checkpoint" for d in decisions.values()),
        "every_step_once": [r["step"] for r in recs] == list(range(1, steps + 1)),
        "max_loss_diff_vs_failure_free": max(diffs),
        "first20_loss_diff": max(diffs[:20]),
        "tokens_per_s_before_first_kill": statistics.median(before) if before else None,
        "tokens_per_s_after_by_workers": {
            w: statistics.median(v) for w, v in sorted(by_world.items())
        },
        "wall_s": round(wall, 1),
        "ref_wall_s": round(ref_wall, 1),
    }
    print(json.dumps(out, indent=1))
    return out


def _wait(what, timeout: float, procs=()):
    deadline = time.time() + timeout
    while not (got := what()):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            return None
        time.sleep(0.02)
    return got


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _linkdown_run(tmp: Path, data: Path, net, i: int, args) -> dict:
    """One two-node run whose node 1 is cut off once 5 steps are recorded (``linkdown``)."""
    from plait.train.launch import children_by_rank

    out = tmp / f"run{i}"
    with socket.socket() as sock:  # a free port for node 0's store
        sock.bind((net.host_ip, 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, "--data", str(data),
           "--cache-dir", str(data.parent / "cache"), "--out", str(out), "--steps", "100000",
           "--fault-tolerance", "1", "--heartbeat-timeout", str(args.heartbeat_timeout),
           "--no-respawn", "--no-progress", "--nnodes", "2",
           "--rdzv-endpoint", f"{net.host_ip}:{port}"]  # fmt: skip
    logs = [(tmp / f"node{n}-{i}.txt").open("w") for n in (0, 1)]
    node0 = subprocess.Popen([*cmd, "--node-rank", "0"], stdout=logs[0], stderr=subprocess.STDOUT,
                             env={**os.environ, "GLOO_SOCKET_IFNAME": net.host_if})  # fmt: skip
    node1 = subprocess.Popen(["ip", "netns", "exec", net.name, *cmd, "--node-rank", "1"],
                             stdout=logs[1], stderr=subprocess.STDOUT,
                             env={**os.environ, "GLOO_SOCKET_IFNAME": net.ns_if})  # fmt: skip
    res = {"run": i, "recovery_s": None, "in_place": False, "expelled": 0, "every_step_once": False}
    try:
        metrics = out / "metrics.jsonl"
        if not _wait(lambda: metrics.exists() and len(_records(out)) >= 5, 180, (node0, node1)):
            res["why"] = _why(tmp, i)
            return res
        cut_off = list(children_by_rank(node1.pid).values())
        net.cut()
        t_cut = time.time()
        first = _wait(lambda: next((r for r in _records(out) if r.get("generation") == 1), None),
                      60, (node0,))  # fmt: skip
        net.up()
        if first is None:
            return res
        decision = next(e for e in _events(out) if e["event"] == "decision" and e["gen"] == 1)
        res["recovery_s"] = decision["t_failure"] + first["recovery_s"] - t_cut
        res["in_place"] = decision["start"] == "transfer"
        _wait(lambda: not [p for p in cut_off if _alive(p)], 20)
        res["did_not_leave"] = sum(_alive(p) for p in cut_off)
        res["expelled"] = sum("expelled" in (out / "logs" / f"rank-{w}.log").read_text()
                              for w in (1, 3) if (out / "logs" / f"rank-{w}.log").exists())  # fmt: skip
    finally:
        net.up()
        for p in (node1, node0):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    steps = [r["step"] for r in _records(out)]
    res["every_step_once"] = steps == list(range(1, len(steps) + 1))
    return res


def _why(tmp: Path, i: int) -> str:
    """The last lines of both nodes' output: why a run ended before its cut."""
    return " | ".join(
        f"node {n}: " + " / ".join((tmp / f"node{n}-{i}.txt").read_text().splitlines()[-3:])[-600:]
        for n in (0, 1)
    )


def linkdown(args) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("resilience.py linkdown: needs root (ip netns, veth pairs)")
    runs = []
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from netns import Machine  # the namespace helper the tests use

    net = Machine("pbl", "10.213.79")  # node 1's network
    if net.why:
        sys.exit(f"resilience.py linkdown: {net.why}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            data = _corpus(tmp)
            for i in range(args.kills):
                runs.append(_linkdown_run(tmp, data, net, i, args))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        net.close()
    rec = [r["recovery_s"] for r in runs if r["recovery_s"] is not None]
    out = {
        "command": f"flock /tmp/plait-cpu.lock python benchmarks/resilience.py linkdown "
        f"--kills {args.kills} --heartbeat-timeout {args.heartbeat_timeout:g}",
        "runs": len(runs),
        "recoveries": len(rec),
        "in_place": sum(r["in_place"] for r in runs),
        "recovery_median_s": statistics.median(rec) if rec else None,
        "recovery_worst_s": max(rec) if rec else None,
        "recovery_all_s": [round(x, 2) for x in rec],
        "within_timeout_plus_2": sum(x < args.heartbeat_timeout + 2 for x in rec),
        "expelled_workers": sum(r["expelled"] for r in runs),
        "every_step_once": all(r["every_step_once"] for r in runs),
    }
    print(json.dumps(out, indent=1))
    return out


SIM_MTBF_H = (6, 3, 2, 1, 0.5, 1 / 3, 1 / 6)


def sim(args) -> dict:
    from plait.layout import Layout
    from plait.model.config import preset
    from plait.resilience.availability import Assumptions, Model
    from plait.sim import get_hardware

    layout = Layout(dp=8, tp=8, pp=16, micro_batch_size=1, global_batch_size=1536,
                    dtype="bf16", recompute="selective", sequence_parallel=True)  # fmt: skip
    a = Assumptions()
    m = Model(preset("gpt3-175b"), layout, get_hardware("h100-sxm"), a)
    points = [m.point(h * 3600) for h in SIM_MTBF_H]
    print(f"GPT-3 175B, 1,024 H100 (dp 8 x tp 8 x pp 16): step {m.step_s:.2f} s, "
          f"{m.tokens_per_s:,.0f} tokens/s without failures; checkpoint {m.checkpoint_s:.0f} s, "
          f"state copy {m.copy_s:.2f} s, redundant-computation step {m.rc_step_s:.2f} s")  # fmt: skip
    print(f"{'MTBF':>8} {'ckpt+restart':>13} {'in-place':>9} {'redundant':>10}")
    for p in points:
        print(f"{_mtbf(p.mtbf_s):>8} {p.checkpoint:>13.3f} {p.in_place:>9.3f} {p.redundant:>10.3f}")
    _plot(points, m)
    return {"points": points, "model": m, "assumptions": a}


def _mtbf(s: float) -> str:
    return f"{s / 3600:g} h" if s >= 3600 else f"{s / 60:.0f} min"


def _plot(points, m) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [86400 / p.mtbf_s for p in points]  # failures a day
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for attr, label, style in (("in_place", "in-place recovery (plait)", "o-"),
                               ("checkpoint", "checkpoint + restart", "s--"),
                               ("redundant", "redundant computation (Bamboo-style)", "^:")):  # fmt: skip
        ax.plot(x, [getattr(p, attr) * m.tokens_per_s / 1e6 for p in points], style, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("failures per day (one every 6 h ... every 10 min)")
    ax.set_ylabel("million tokens / s")
    ax.set_title("GPT-3 175B on 1,024 H100 (simulated)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=120)
    print(f"plot: {PLOT}")


def write_results(k: dict | None, s: dict | None) -> None:
    text = RESULTS.read_text()
    head = "## Resilience"
    if head in text:  # replace our own section only
        start = text.index(head)
        end = text.find("\n## ", start + 1)
        text = text[:start] + (text[end + 1 :] if end != -1 else "")
    lines = [head, "", f"Measured {datetime.date.today()} on the 2-core CPU machine (gloo), "
             "while other single-process work may have been running.", ""]  # fmt: skip
    if k is not None:
        lines += [f"`{k['command']}` (tiny model, 4 layers x 32, dp 2 x pp 2, F = 1, "
                  f"{k['steps']} steps, a checkpoint every {k.get('save_every', 'N')} steps):", "",
                  f"- kills: {k['kills']}, recoveries in place: {k['recoveries']}, fallbacks to "
                  f"a checkpoint: {k['fallbacks']}",
                  f"- recovery (kill -> first step of the new generation): median "
                  f"{k['recovery_median_s']:.2f} s, worst {k['recovery_worst_s']:.2f} s "
                  f"(all: {k['recovery_all_s']})",
                  f"- steps redone: {k['steps_redone']} in all; steps a survivor completed "
                  f"(rolled forward): {k['steps_rolled_forward']}; every step 1..{k['steps']} "
                  f"recorded exactly once: {k['every_step_once']}",
                  f"- loss vs the failure-free run: first 20 steps within "
                  f"{k['first20_loss_diff']:.1e}, all steps within "
                  f"{k['max_loss_diff_vs_failure_free']:.1e}",
                  f"- tokens/s (median of steps): before the first kill (4 workers) "
                  f"{k['tokens_per_s_before_first_kill']:,.0f}; after recoveries, by workers: "
                  + ", ".join(f"{w}: {v:,.0f}" for w, v in k["tokens_per_s_after_by_workers"].items()),
                  f"- rejoins: {k['rejoins']} (median {k['rejoin_median_s'] or 0:.2f} s from the "
                  "request to the first step with the new worker)",
                  "- the run starts on the dp 2 x pp 2 grid; re-formed generations use the "
                  "one-stage template (the tiny model fits one worker), pipelines without a "
                  "bubble, so 4 workers after a rejoin run faster than the 4 of the start",
                  "- goal (median < 2 s, worst < 10 s, no completed step lost): "
                  + ("met" if k["recovery_median_s"] < 2 and k["recovery_worst_s"] < 10
                     and k["every_step_once"] else "NOT met"), ""]  # fmt: skip
    if s is not None:
        m, a = s["model"], s["assumptions"]
        lines += ["`python benchmarks/resilience.py sim`: GPT-3 175B, dp 8 x tp 8 x pp 16 on "
                  f"1,024 H100 (simulated step {m.step_s:.2f} s); assumptions: storage "
                  f"{a.storage_gbs:g} GB/s (checkpoint {m.checkpoint_s:.0f} s), restart "
                  f"{a.restart_s:g} s, detection {a.detect_s:g} s, new communicators "
                  f"{a.reform_s:g} s, state copy at {a.link_gbs:g} GB/s ({m.copy_s:.2f} s), "
                  f"repair {a.repair_s:g} s. Fraction of the failure-free throughput:", "",
                  "| one failure every | checkpoint + restart | in-place (plait) | redundant computation |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {_mtbf(p.mtbf_s)} | {p.checkpoint:.3f} | {p.in_place:.3f} | "
                  f"{p.redundant:.3f} |" for p in s["points"]]  # fmt: skip
        lines += ["", "![throughput against failure frequency](resilience_sim.png)", ""]
    RESULTS.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("kills", "linkdown", "sim", "all"))
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--every", type=int, default=25, help="steps between kills")
    p.add_argument("--signal", choices=("kill", "stop"), default="kill")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--save-every", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--micro", type=int, default=1, help="micro-batch size")
    p.add_argument(
        "--zero-replicas",
        type=int,
        default=0,
        metavar="K",
        help="ZeRO-2 inside two replicas of K workers (--dp 2K --pp 1)",
    )
    p.add_argument("--write-results", action="store_true")
    args = p.parse_args()
    if args.write_results and (args.zero_replicas or (args.batch, args.micro) != (8, 1)):
        p.error("--write-results writes the dp 2 x pp 2 section; run other layouts without it")
    if args.what == "linkdown":
        linkdown(args)
        return
    k = kills(args) if args.what in ("kills", "all") else None
    if k is not None:
        k["save_every"] = args.save_every
    s = sim(args) if args.what in ("sim", "all") else None
    if args.write_results:
        write_results(k, s)


if __name__ == "__main__":
    main()
