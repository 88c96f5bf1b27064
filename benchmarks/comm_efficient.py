"""Communication-efficient data parallelism: what each algorithm saves, measured.

    python benchmarks/comm_efficient.py --part bytes     # loss against bytes, 4 replicas
    python benchmarks/comm_efficient.py --part slow      # a rate-limited network, for real
    python benchmarks/comm_efficient.py --part convex    # logistic regression, one process
    python benchmarks/comm_efficient.py --part torch     # PowerSGD beside PyTorch's DDP hook
    python benchmarks/comm_efficient.py --part bytes --only "all-reduce,diloco H=16"
    python benchmarks/comm_efficient.py --part bytes --steps 512 --reuse a.json \
        --only "all-reduce,powersgd:4 warm-up 32"   # a.json: an earlier run's --save

1. ``bytes``: 4 gloo processes (``--dp 4``, one replica each), the ``tiny`` GPT (4 x 128,
   vocabulary 4,096) on the embedded corpus, 16 sequences of 128 tokens a step
   (``--batch`` sequences instead: ``--batch`` / 4 per replica, the same learning-rate
   schedule), AdamW at peak lr 3e-3 (``--optimizer sgd``: SGD with momentum 0.9, weight
   decay 1e-4, the optimizer of the local-SGD, gossip and PowerSGD papers; ``--lr`` sets
   every run's peak lr), the same seed and batches for every algorithm, ``--steps`` steps (a
   multiple of every period below, so every run ends on a synchronisation). For each:
   the validation loss at the end (8 held-out batches of ``--batch`` sequences), the mean
   training loss of the last 10 steps, and the bytes one replica sent over the dp axis
   in all (the trainer's ``dp_bytes_sent``, comm.py's count of what a rank puts on the
   wire). A table, and a plot of loss against bytes.
2. ``slow``: the same runs inside a network namespace whose loopback is rate-limited
   (``ip netns add``; ``tc qdisc add dev lo root tbf rate 200mbit burst 1mb limit 10mb``),
   which every byte between the 4 processes crosses: wall-clock time (the sum of step
   times, start-up and evaluation left out) until the training loss, averaged over 10
   steps, first reaches a target -- the loss plain all-reduce reaches at 80% of its
   ``--slow-steps``. The other algorithms get ``--slow-factor`` times as many steps (each
   is a run of its own length, learning-rate schedule included), since they may need
   more steps to reach it. Needs root; the script creates the namespace, runs itself
   inside it and removes it, or refuses in one line.
3. ``convex``: logistic regression on synthetic data (d = 50, label noise), n replicas of
   SGD with the same step size, simulated in one process with plait's own mixing
   matrices (``dp_algos.graphs``). The data are split among the replicas by the true
   logit (heterogeneous shards: each replica's own optimum differs, the case where gossip
   pays most); every mode draws the same mini-batches at a given n. Parallel SGD (exact
   average every step), gossip SGD on a ring, and Gossip-PGA (a global average every H).
   Reported: the steady-state excess loss of what the replicas hold, mean_i f(x_i) - f*,
   against n -- parallel SGD's falls as 1/n (linear speed-up; the fitted log-log slope);
   gossip on a ring falls less once the ring's spectral gap is small (its consensus error
   grows as the gap shrinks), and periodic averaging closes most of that gap -- the
   comparison Chen et al. (2021, Gossip-PGA) make.

4. ``torch``: plait's ``--compress powersgd:4`` engine beside DDP with PyTorch's own
   ``powerSGD_hook`` (rank 4, error feedback, warm start) on the same 4 processes, model,
   initial weights and batches, alternating step by step: the loss each reaches and the
   median step time.

Durations on this 2-core machine at the defaults: bytes 6 min, slow 7.5 min, convex 1 min,
torch 2 min (``--part all``: about 17 min).

Timings are taken under the shared CPU lock (``flock /tmp/plait-cpu.lock``), with other
single-process work possibly running beside them; 4 single-thread processes share 2
cores, so compute is slow and the network term is what the slow part varies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).with_name("RESULTS.md")  # the sections printed at the end go there
FIGURES = Path(__file__).with_name("figures")
SECTION = "## Communication-efficient data parallelism"

# name -> DPAlgoConfig fields (periods divide the default step counts)
BYTES_RUNS = {
    "all-reduce": {},
    "bf16": {"compress": "bf16"},
    "int8": {"compress": "int8"},
    "qsgd:8": {"compress": "qsgd:8"},
    "topk:0.01": {"compress": "topk:0.01"},
    "powersgd:4": {"compress": "powersgd:4"},
    "local-sgd H=16": {"algo": "local-sgd", "sync_every": 16},
    "diloco H=16": {"algo": "diloco", "sync_every": 16},
    "gossip ring": {"algo": "gossip", "topology": "ring"},
    "gossip one-peer": {"algo": "gossip", "topology": "one-peer-exponential"},
    "gossip ring + avg/8": {"algo": "gossip", "topology": "ring", "global_avg_every": 8},
    # settings from the literature for longer runs (docs/comm-efficient.md, "Settings"):
    # post-local SGD, its plain phase cut to the lr warm-up so the run stays >= 10x
    "local-sgd H=32 warm-up 32": {"algo": "local-sgd", "sync_every": 32, "local_warmup": 32},
    # PowerSGD after plain all-reduce steps (PyTorch's start_powerSGD_iter >= the lr warm-up)
    "powersgd:2 warm-up 32": {"compress": "powersgd:2", "compress_warmup": 32},
    "powersgd:4 warm-up 32": {"compress": "powersgd:4", "compress_warmup": 32},
    # shorter plain phases, run after seeing the 32-step one (a sweep after the fact): 24
    # and 16 plain steps give 11.0x and 13.1x over 512 steps, inside the lr warm-up
    "powersgd:4 warm-up 24": {"compress": "powersgd:4", "compress_warmup": 24},
    "powersgd:4 warm-up 16": {"compress": "powersgd:4", "compress_warmup": 16},
    "topk:0.01 warm-up 32": {"compress": "topk:0.01", "compress_warmup": 32},
    # the same, EF21's estimates started from zero after the warm-up instead of from the
    # last plain gradients (as PowerSGD's error starts)
    "topk:0.01 warm-up 32 zero-start": {
        "compress": "topk:0.01",
        "compress_warmup": 32,
        "ef21_start": "zero",
    },
    # rank 8, no plain phase: run after seeing rank 4 +2.5% at 21.6x under --optimizer sgd
    "powersgd:8": {"compress": "powersgd:8"},
    # the outer step of SlowMo (Wang et al. 2020; fairscale's defaults: slow lr 1, slow
    # momentum 0.5) on DiLoCo's Nesterov form, for SGD inner steps: run after seeing DiLoCo's
    # lr 0.7 / momentum 0.9 at +28% under --optimizer sgd
    "diloco H=16 outer 1/0.5": dict(algo="diloco", sync_every=16, outer_lr=1.0, outer_momentum=0.5),
    # the optimizer's elementwise state (SGD's momentum; AdamW's two moments) averaged with
    # the parameters at each sync (SlowMo's "average the base optimizer buffers"): chosen
    # after the SGD table, before any run -- H = 32 is 16x with SGD, 10.7x with AdamW;
    # H = 16 (8x with SGD) isolates the effect at local SGD H = 16's sync rate
    "local-sgd H=32 +opt": {"algo": "local-sgd", "sync_every": 32, "sync_optimizer_state": True},
    "local-sgd H=16 +opt": {"algo": "local-sgd", "sync_every": 16, "sync_optimizer_state": True},
    # what local steps cost, by H and by where in the run they are taken (diagnostics
    # under --optimizer sgd, not >= 10x settings): H = 4 and 8, and local SGD H = 16 after
    # 64, 128 or 256 plain steps
    "local-sgd H=4": {"algo": "local-sgd", "sync_every": 4},
    "local-sgd H=8": {"algo": "local-sgd", "sync_every": 8},
    "local-sgd H=16 warm-up 64": {"algo": "local-sgd", "sync_every": 16, "local_warmup": 64},
    "local-sgd H=16 warm-up 128": {"algo": "local-sgd", "sync_every": 16, "local_warmup": 128},
    "local-sgd H=16 warm-up 256": {"algo": "local-sgd", "sync_every": 16, "local_warmup": 256},
    # the sync's change since the last one in int8 (Int8Sum: 4x fewer bytes than fp32):
    # chosen after seeing H = 4 at +1.84% (4x) -- H = 4 int8 is 15.9x; H = 8 int8 31.7x
    "local-sgd H=4 int8": {"algo": "local-sgd", "sync_every": 4, "compress": "int8"},
    "local-sgd H=8 int8": {"algo": "local-sgd", "sync_every": 8, "compress": "int8"},
    "local-sgd H=4 bf16": {"algo": "local-sgd", "sync_every": 4, "compress": "bf16"},
    # no saving: per-replica AdamW steps averaged every step -- what the replicas' own
    # optimizers cost without any staleness
    "local-sgd H=1": {"algo": "local-sgd", "sync_every": 1},
}
# gossip is left out of the slow part: it sends whole parameters to each neighbour, about as
# many bytes as the all-reduce (part 1), so a bandwidth limit is not where it can win
# --optimizer sgd's L2 weight decay (coupled: the gradient gains wd x p, which momentum then
# amplifies by 1 / (1 - 0.9)); 1e-4, Goyal et al. 2017's SGD setting, where AdamW's 0.1
# coupled this way would shrink every weight by ~10% a step at lr 0.1
SGD_WEIGHT_DECAY = 1e-4
SLOW_RUNS = ("all-reduce", "powersgd:4", "topk:0.01", "local-sgd H=16", "diloco H=16")


# --- training runs in one group of worker processes -----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, args_of, folder, world: int = 4) -> None:
    """Run ``target(*args_of(rank, port))`` in ``world`` spawned processes and wait; each
    writes ``status-<rank>`` in ``folder`` ("ok" or its traceback)."""
    port, ctx = _free_port(), mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r, port)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    for r, p in enumerate(procs):
        status = Path(folder, f"status-{r}")
        text = status.read_text() if status.exists() else f"exit code {p.exitcode}"
        if text != "ok":
            raise RuntimeError(f"worker {r} failed:\n{text}")


def _group_worker(body, rank, world, port, out_dir, *args):
    """A spawned worker: one gloo group on the loopback (inside the slow part's namespace it
    is the one interface there is), ``body(rank, world, out_dir, *args)``, then its status
    in ``status-<rank>`` for ``_spawn`` ("ok" or the traceback)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        body(rank, world, out_dir, *args)
        status = "ok"
    except BaseException:  # noqa: BLE001 - reported by the parent
        status = traceback.format_exc()
    Path(out_dir, f"status-{rank}").write_text(status)
    dist.destroy_process_group()
    os._exit(0)


def _train_runs(rank, world, out_dir, cfgs):
    """Every config in ``cfgs`` in turn, a plait run each, on the group."""
    from plait.topology import Topology
    from plait.train.loop import train

    for cfg in cfgs:
        lay = cfg.layout
        train(cfg, topo=Topology.build(pp=lay.pp, dp=lay.dp, tp=lay.tp,
                                       timeout=datetime.timedelta(seconds=600)))  # fmt: skip


def train_runs(
    names,
    *,
    steps: int | dict[str, int],
    root: Path,
    batch: int = 16,
    optimizer: str = "adamw",
    lr: float = 3e-3,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """Train the named runs in turn on 4 worker processes (``steps`` each, or per name;
    ``batch`` global sequences a step, ``batch / 4`` per replica; ``optimizer`` at peak
    ``lr``: AdamW with decoupled weight decay 0.1, or SGD with momentum 0.9 and L2
    ``SGD_WEIGHT_DECAY``; ``seed``: the initial weights, the batches and the algorithms'
    random streams); their metrics records."""
    from plait.data import DataConfig, prepare
    from plait.dp_algos.config import DPAlgoConfig
    from plait.layout import Layout
    from plait.model.config import preset
    from plait.train.config import RunConfig, TrainConfig

    data = DataConfig()  # the embedded corpus, byte-level BPE of 4,096 tokens
    prepare(data)
    cfgs = []
    for name in names:
        cfgs.append(RunConfig(
            model=preset("tiny"),
            layout=Layout(dp=4, global_batch_size=batch, micro_batch_size=batch // 4),
            data=data,
            train=TrainConfig(steps=steps if isinstance(steps, int) else steps[name], lr=lr, warmup=30, eval_every=0, eval_batches=8,
                              progress=False, peak_tflops=1.0, keep_checkpoints=1, optimizer=optimizer, seed=seed,
                              weight_decay=0.1 if optimizer == "adamw" else SGD_WEIGHT_DECAY),
            out=str(root / name.replace(" ", "_").replace("/", "-")),
            dp_algo=DPAlgoConfig(**BYTES_RUNS[name]),
        ))  # fmt: skip
    for cfg in cfgs:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
    _spawn(_group_worker, lambda r, port: (_train_runs, r, 4, port, root, cfgs), root)
    out = {}
    for name, cfg in zip(names, cfgs):
        lines = Path(cfg.out, "metrics.jsonl").read_text().splitlines()
        out[name] = [json.loads(x) for x in lines if x.strip()]
    return out


def summarise(metrics: dict[str, list[dict]]) -> list[dict]:
    base = metrics.get("all-reduce")
    rows = []
    for name, recs in metrics.items():
        sent = sum(r["dp_bytes_sent"] for r in recs)
        last = recs[-1]
        rows.append({
            "name": name,
            "val_loss": last.get("val_loss"),
            "train_loss": sum(r["loss"] for r in recs[-10:]) / min(10, len(recs)),
            "bytes": sent,
            "steps": len(recs),
            "consensus": last.get("consensus_distance"),
            "step_s": sorted(r["step_time_s"] for r in recs[1:])[(len(recs) - 1) // 2],
        })  # fmt: skip
    if base is not None:
        ref = next(r for r in rows if r["name"] == "all-reduce")
        for r in rows:
            r["bytes_ratio"] = ref["bytes"] / r["bytes"] if r["bytes"] else math.inf
            r["loss_vs_ref"] = r["val_loss"] / ref["val_loss"] - 1
    return rows


def bytes_table(rows) -> str:
    lines = [
        "| algorithm | validation loss | vs all-reduce | train loss (last 10) | MiB sent per "
        "replica | fewer bytes | consensus distance at the end | median step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cons = "-" if r["consensus"] is None else f"{r['consensus']:.3g}"
        lines.append(
            f"| {r['name']} | {r['val_loss']:.4f} | {r['loss_vs_ref']:+.2%} | "
            f"{r['train_loss']:.4f} | {r['bytes'] / 2**20:,.1f} | {r['bytes_ratio']:.2f}x | "
            f"{cons} | {r['step_s']:.3f} |"
        )
    return "\n".join(lines)


def noise_scale(
    big: list[dict], small: list[dict], *, b_big: int, b_small: int, windows: int = 8
) -> list[dict]:
    """The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018,
    appendix A), per window of steps, from the gradient norms of two runs on one
    trajectory: ``big`` (the all-reduce, batch ``b_big`` sequences) and ``small`` (the
    local SGD H = 1 control under SGD, whose ``grad_norm`` is a replica's own on
    ``b_small`` sequences and whose parameters follow the all-reduce's). With
    E|g_b|^2 = |G|^2 + tr(Sigma) / b: |G|^2 = (b_big |g_big|^2 - b_small |g_small|^2) /
    (b_big - b_small) and tr(Sigma) = (|g_small|^2 - |g_big|^2) / (1/b_small - 1/b_big),
    each averaged over the window before the ratio (their paper's advice). B_simple is the
    batch (in sequences) at which a step's noise equals its signal: far below it, a step
    is mostly noise. None where the |G|^2 estimate is not positive (noise swamps it)."""
    n = min(len(big), len(small))
    out = []
    for w in range(windows):
        lo, hi = w * n // windows, (w + 1) * n // windows
        gb = sum(r["grad_norm"] ** 2 for r in big[lo:hi]) / (hi - lo)
        gs = sum(r["grad_norm"] ** 2 for r in small[lo:hi]) / (hi - lo)
        g2 = (b_big * gb - b_small * gs) / (b_big - b_small)
        trace = (gs - gb) / (1 / b_small - 1 / b_big)
        out.append({"steps": (lo + 1, hi), "g2": g2, "trace": trace,
                    "b_simple": trace / g2 if g2 > 0 else None})  # fmt: skip
    return out


def noise_table(rows: list[dict], *, b_big: int, b_small: int) -> str:
    lines = [
        f"| steps | \\|G\\|^2 | tr(Sigma) | B_simple (sequences; a replica has {b_small}, "
        f"the all-reduce {b_big}) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        b = "noise swamps \\|G\\|^2" if r["b_simple"] is None else f"{r['b_simple']:.0f}"
        lo, hi = r["steps"]
        lines.append(f"| {lo}-{hi} | {r['g2']:.4f} | {r['trace']:.3f} | {b} |")
    return "\n".join(lines)


def plot_bytes(rows, path: Path, *, batch: int = 16, optimizer: str = "AdamW, lr 3e-3") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        x = max(r["bytes"], 1) / 2**20
        ax.scatter(x, r["val_loss"])
        ax.annotate(r["name"], (x, r["val_loss"]), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")  # fmt: skip
    ref = next(r for r in rows if r["name"] == "all-reduce")
    ax.axhline(ref["val_loss"] * 1.02, ls="--", lw=0.8, color="grey", label="all-reduce + 2%")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only
    ax.set_xlabel("MiB sent per replica over the run (log)")
    ax.set_ylabel("validation loss at the end")
    ax.set_title(
        f"4 replicas x {batch // 4} sequences, tiny GPT, {ref['steps']} steps, {optimizer}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


# --- the slow network -------------------------------------------------------------------------


def slow(args) -> str:
    """Set up the rate-limited namespace, run the slow part inside it, tear it down."""
    if os.geteuid() != 0:
        sys.exit("comm_efficient.py --part slow: needs root (ip netns, tc); run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.exit(f"comm_efficient.py --part slow: `{tool}` is not installed (iproute2)")
    ns = f"plait-slow-{os.getpid()}"
    out = Path(tempfile.mkdtemp(prefix="plait-slow-"))
    try:
        for cmd in (["ip", "netns", "add", ns],
                    ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                     "tbf", "rate", args.rate, "burst", "1mb", "limit", "10mb"]):  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"comm_efficient.py --part slow: `{' '.join(cmd)}` failed: "
                         f"{r.stderr.strip().splitlines()[0] if r.stderr.strip() else r.returncode}")  # fmt: skip
        cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--part", "slow-inside",
               "--slow-steps", str(args.slow_steps), "--slow-factor", str(args.slow_factor),
               "--out", str(out)]  # fmt: skip
        if args.only:
            cmd += ["--only", args.only]
        subprocess.run(cmd, check=True)
        metrics = json.loads((out / "metrics.json").read_text())
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(out, ignore_errors=True)
    return slow_table(metrics, args)


def time_to_target(recs, target: float, window: int = 10) -> tuple[float | None, int | None]:
    """Seconds (sum of step times) until the training loss averaged over ``window`` steps
    first reaches ``target``; and that step."""
    t = 0.0
    for i, r in enumerate(recs):
        t += r["step_time_s"]
        if i + 1 >= window:
            mean = sum(x["loss"] for x in recs[i + 1 - window : i + 1]) / window
            if mean <= target:
                return t, i + 1
    return None, None


def slow_table(metrics, args) -> str:
    ref = metrics["all-reduce"]
    k = int(0.8 * len(ref))
    target = sum(r["loss"] for r in ref[k - 10 : k]) / 10
    base, _ = time_to_target(ref, target)
    lines = [
        f"Target: training loss {target:.4f} (all-reduce's, averaged over steps {k - 9}-{k}).",
        "",
        "| algorithm | median step s | MiB sent per replica per step | time to target s | "
        "steps | speed-up vs all-reduce |",
        "|---|---|---|---|---|---|",
    ]
    for name, recs in metrics.items():
        secs, step = time_to_target(recs, target)
        times = sorted(r["step_time_s"] for r in recs[1:])
        med = times[len(times) // 2]
        sent = sum(r["dp_bytes_sent"] for r in recs) / len(recs) / 2**20
        reached = f"{secs:.1f} | {step} | {base / secs:.2f}x" if secs else "- | - | not reached"
        lines.append(f"| {name} | {med:.3f} | {sent:.2f} | {reached} |")
    return "\n".join(lines)


# --- convex check ------------------------------------------------------------------------------


def convex(args) -> str:
    """Logistic regression, n replicas simulated in one process (module docstring)."""
    import numpy as np

    from plait.dp_algos import graphs

    rng = np.random.default_rng(0)
    d, m = 50, 20000
    w_true = rng.normal(size=d) / np.sqrt(d) * 3
    X = rng.normal(size=(m, d))
    y = (rng.random(m) < 1 / (1 + np.exp(-X @ w_true))).astype(float)  # label noise built in

    def loss(w):
        z = X @ w
        return float(np.mean(np.logaddexp(0, z) - y * z)) + 0.5e-3 * float(w @ w)

    def losses(W):  # f(w) for every row of W at once
        z = X @ W.T  # (m, n)
        reg = 0.5e-3 * np.einsum("nd,nd->n", W, W)
        return np.mean(np.logaddexp(0, z) - y[:, None] * z, axis=0) + reg

    def grads(W, idx):  # W (n, d); idx (n, b): each replica's own mini-batch
        Xb, yb = X[idx], y[idx]  # (n, b, d), (n, b)
        p = 1 / (1 + np.exp(-np.einsum("nbd,nd->nb", Xb, W)))
        return np.einsum("nbd,nb->nd", Xb, p - yb) / idx.shape[1] + 1e-3 * W

    w_star = np.zeros(d)  # f* by full-batch gradient descent
    for _ in range(3000):
        z = X @ w_star
        w_star -= 1.0 * (X.T @ (1 / (1 + np.exp(-z)) - y) / m + 1e-3 * w_star)
    f_star = loss(w_star)
    lr, b, iters, tail = 0.05, 4, args.convex_iters, args.convex_iters // 4

    order = np.argsort(X @ w_true)  # heterogeneous shards: replica i sees one logit range

    def run(n, mode, h=0):
        draw = np.random.default_rng([1, n])  # the same draws for every mode at a given n
        shards = np.stack(np.array_split(order, n)[:n]) if m % n == 0 else None
        W = np.zeros((n, d))
        excess = []
        for t in range(iters):
            pick = draw.integers(0, m // n, size=(n, b))
            W = W - lr * grads(W, np.take_along_axis(shards, pick, axis=1))
            if mode == "parallel" or (h and (t + 1) % h == 0):
                W[:] = W.mean(0)
            elif mode == "gossip" and n > 1:
                W = graphs.mixing_matrix("ring", n) @ W
            if t >= iters - tail and t % 5 == 0:  # what the replicas hold, on average
                excess.append(float(np.mean(losses(W))) - f_star)
        return float(np.mean(excess))

    ns = (1, 2, 4, 8, 16, 32)
    par = {n: run(n, "parallel") for n in ns}
    gos = {n: run(n, "gossip") for n in ns}
    pga = {n: run(n, "gossip", h=args.pga_every) for n in ns}
    slope = np.polyfit(np.log(ns), np.log([par[n] for n in ns]), 1)[0]
    lines = [
        f"d = {d}, {m} samples split by logit among the replicas, mini-batch {b} per replica, "
        f"step size {lr}, {iters} iterations; excess loss mean_i f(x_i) - f* averaged over "
        f"the last {tail}. Parallel SGD's log-log "
        f"slope in n: **{slope:.2f}** (linear speed-up: -1).",
        "",
        "| replicas n | parallel SGD | gossip (ring) | gossip + average every "
        f"{args.pga_every} (PGA) | ring spectral gap |",
        "|---|---|---|---|---|",
    ]
    for n in ns:
        gap = graphs.spectral_gap(graphs.mixing_matrix("ring", n)) if n > 1 else 1.0
        lines.append(f"| {n} | {par[n]:.2e} | {gos[n]:.2e} | {pga[n]:.2e} | {gap:.3f} |")
    _plot_convex(ns, par, gos, pga, args.pga_every, FIGURES / "comm_efficient_convex.png")
    return "\n".join(lines)


def _plot_convex(ns, par, gos, pga, h, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for data, label in ((par, "parallel SGD"), (gos, "gossip SGD, ring"),
                        (pga, f"Gossip-PGA, ring, average every {h}")):  # fmt: skip
        ax.plot(ns, [data[n] for n in ns], marker="o", label=label)
    ax.plot(ns, [par[1] / n for n in ns], ls=":", color="grey", label="1/n")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("replicas n")
    ax.set_ylabel("steady-state excess loss, mean over replicas")
    ax.set_title("logistic regression, same step size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


# --- side by side with PyTorch's PowerSGD hook -------------------------------------------------


def _torch_runs(rank, world, out_dir, steps, rank_):
    """plait's ``--compress powersgd:R`` engine and DDP with torch's ``powerSGD_hook`` (rank
    R, error feedback, warm start), the same initial weights and batches, alternating step
    by step in the same processes; no clipping, AdamW with the same schedule."""
    import functools
    import time

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from plait import dp_algos
    from plait.data import DataConfig, GlobalBatchSampler, prepare
    from plait.dp_algos.config import DPAlgoConfig
    from plait.layout import Layout
    from plait.model.config import preset
    from plait.model.transformer import build_model
    from plait.parallel.engine import DataParallelConfig, build_data_parallel
    from plait.topology import Topology
    from plait.train import optim
    from plait.train.config import TrainConfig

    cfg, batch = preset("tiny"), 16
    tcfg = TrainConfig(steps=steps, lr=3e-3, warmup=30)
    layout = Layout(dp=world, global_batch_size=batch, micro_batch_size=batch // world)
    topo = Topology.build(pp=1, dp=world, tp=1)
    ds = prepare(DataConfig())
    sampler = GlobalBatchSampler(ds.train, seq_len=cfg.seq_len, global_batch=batch, seed=0)
    ours = build_model(cfg, seed=0)
    algo = dp_algos.build(DPAlgoConfig(compress=f"powersgd:{rank_}"), topo=topo,
                          layout=layout)  # fmt: skip
    engine = build_data_parallel(
        ours, topo=algo.engine_topo, cfg=DataParallelConfig.from_layout(layout),
        make_optimizer=functools.partial(optim.build_adamw, cfg=tcfg),
        owns_grad=functools.partial(optim.owns_grad, topo=topo),
        compression=algo.compression,
    )  # fmt: skip
    algo.attach(engine, ours)
    theirs = build_model(cfg, seed=0)
    own = dist.new_group(list(range(world)))  # DDP's traffic apart from plait's
    # one bucket: the hook launches its second all-reduce from the first one's
    # completion callback, so with several buckets gloo ranks can issue them in
    # different orders (a collective mismatch, seen here with DDP's 1 MiB first bucket)
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, process_group=own,
                                                    bucket_cap_mb=64)  # fmt: skip
    state = psgd.PowerSGDState(process_group=own, matrix_approximation_rank=rank_,
                               start_powerSGD_iter=2, min_compression_rate=1)  # fmt: skip
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = optim.build_adamw([(n, p, p) for n, p in theirs.named_parameters()], tcfg)
    tokens = batch * cfg.seq_len
    rec = {"plait": [], "torch": []}
    for step in range(steps):
        rows = sampler.local(step, dp_rank=rank, dp=world)
        x, y = rows[:, :-1], rows[:, 1:]
        lr = optim.lr_at(step, tcfg)
        for name in ("plait", "torch") if step % 2 == 0 else ("torch", "plait"):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "plait":  # loss over the global tokens: the dp sum is the mean
                loss = ours(x, y).sum() / tokens
                loss.backward()
                engine.finish()
                engine.step(lr)
                engine.zero_grad()
                share = loss.detach() * world
            else:  # DDP averages over dp: loss over the local tokens
                loss = ddp(x, y).sum() / (tokens / world)
                loss.backward()
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
                opt.zero_grad(set_to_none=True)
                share = loss.detach()
            dt = time.perf_counter() - t0
            dist.all_reduce(share)  # the global mean loss, for the record only
            rec[name].append({"loss": share.item() / world, "step_time_s": dt})
    if rank == 0:
        Path(out_dir, "torch.json").write_text(json.dumps(rec))


def torch_side_by_side(args) -> str:
    with tempfile.TemporaryDirectory() as d:
        _spawn(_group_worker, lambda r, port: (_torch_runs, r, 4, port, d, args.torch_steps, 4), d)
        rec = json.loads(Path(d, "torch.json").read_text())
    lines = [
        f"4 gloo processes, tiny GPT, 16 x 128 tokens a step, {args.torch_steps} steps, AdamW "
        "3e-3 (30 warm-up steps, cosine), no clipping; rank 4; torch's hook does one plain "
        "all-reduce first (start_powerSGD_iter=2, its minimum with error feedback). Steps "
        "alternate between the two in the same processes.",
        "",
        "| implementation | loss step 1 | train loss (last 10) | median step s |",
        "|---|---|---|---|",
    ]
    for name, label in (("plait", "plait `--compress powersgd:4`"),
                        ("torch", "DDP + `powerSGD_hook` rank 4")):  # fmt: skip
        r = rec[name]
        last = sum(x["loss"] for x in r[-10:]) / len(r[-10:])
        med = sorted(x["step_time_s"] for x in r[1:])[(len(r) - 1) // 2]
        lines.append(f"| {label} | {r[0]['loss']:.4f} | {last:.4f} | {med:.3f} |")
    return "\n".join(lines)


def _reused(args) -> dict[str, list[dict]]:
    """The runs of ``--reuse`` (empty without it); refused in one line if their length is
    not ``--steps`` or their batch, optimizer, lr or seed not ``--batch``, ``--optimizer``,
    ``--lr``, ``--seed``. A file saved without one of those keys was trained at the default
    (the runs alone, no keys: 16 sequences a step, AdamW at 3e-3, seed 0)."""
    if not args.reuse:
        return {}
    try:
        saved = json.loads(Path(args.reuse).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"comm_efficient.py --reuse {args.reuse}: cannot read it ({e})")
    metrics = saved.get("runs", saved)
    for flag, default in (("batch", 16), ("optimizer", "adamw"), ("lr", 3e-3), ("seed", 0)):
        was, now = saved.get(flag, default) if "runs" in saved else default, getattr(args, flag)
        if was != now:
            sys.exit(
                f"comm_efficient.py --reuse {args.reuse}: saved at --{flag} {was}, not --{flag} "
                f"{now}; use --{flag} {was} or train the runs again"
            )
    bad = [n for n, recs in metrics.items() if len(recs) != args.steps]
    if bad:
        sys.exit(
            f"comm_efficient.py --reuse {args.reuse}: {', '.join(bad)} ran another number "
            f"of steps than --steps {args.steps}; use the --steps it was saved with"
        )
    return metrics


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("bytes", "slow", "convex", "torch", "all", "slow-inside"),
                   default="all")  # fmt: skip
    p.add_argument("--steps", type=int, default=128, help="bytes part (a multiple of 16)")
    p.add_argument("--batch", type=int, default=16,
                   help="bytes part: global sequences a step, a multiple of the 4 replicas "
                   "(--batch / 4 per replica)")  # fmt: skip
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="bytes part: every run's optimizer (sgd: plait's --optimizer sgd, "
                   "momentum 0.9, weight decay 1e-4)")  # fmt: skip
    p.add_argument("--lr", type=float, default=None,
                   help="bytes part: every run's peak lr (default 3e-3 with adamw, 0.1 with "
                   "sgd)")  # fmt: skip
    p.add_argument("--slow-steps", type=int, default=80, help="slow part: all-reduce's steps")
    p.add_argument("--slow-factor", type=int, default=2,
                   help="slow part: the other algorithms run this many times as many steps")  # fmt: skip
    p.add_argument("--rate", default="200mbit", help="slow part: tbf rate of the loopback")
    p.add_argument("--convex-iters", type=int, default=3000)
    p.add_argument("--torch-steps", type=int, default=128)
    p.add_argument("--pga-every", type=int, default=8)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="bytes part: initial weights, batches and the algorithms' random streams",
    )
    p.add_argument("--only", help="comma-separated run names (default: all of the part's)")
    p.add_argument("--save", help="bytes part: also write the measured records to this JSON")
    p.add_argument("--reuse", help="bytes part: a JSON written by --save (same --steps): its "
                   "runs join the table instead of being trained again (runs are seeded); "
                   "without --only, the table of its runs alone")  # fmt: skip
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    only = args.only.split(",") if args.only else None
    if args.part == "slow-inside":  # inside the namespace: train and hand the metrics back
        names = only or list(SLOW_RUNS)
        steps = {n: args.slow_steps * (1 if n == "all-reduce" else args.slow_factor) for n in names}
        metrics = train_runs(names, steps=steps, root=Path(args.out))
        Path(args.out, "metrics.json").write_text(json.dumps(metrics))
        return
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adamw" else 0.1
    if not args.lr > 0:
        sys.exit(f"comm_efficient.py --lr {args.lr}: use a positive learning rate")
    if args.batch < 4 or args.batch % 4:
        sys.exit(f"comm_efficient.py --batch {args.batch}: use a positive multiple of 4 "
                 "(the 4 replicas each take --batch / 4 sequences)")  # fmt: skip
    sections = []
    date = datetime.date.today().isoformat()
    if args.part in ("bytes", "all"):
        metrics = _reused(args)
        names = only or ([] if args.reuse else list(BYTES_RUNS))  # --reuse alone: its runs
        todo = [n for n in names if n not in metrics]
        if "all-reduce" not in [*names, *metrics]:  # every row is read against it
            sys.exit("comm_efficient.py --only: add all-reduce, the reference every run is "
                     "compared with (or --reuse a JSON that holds it)")  # fmt: skip
        unknown = [n for n in todo if n not in BYTES_RUNS]
        if unknown:
            sys.exit(f"comm_efficient.py --only: unknown run {unknown[0]!r}; the runs are "
                     f"{', '.join(BYTES_RUNS)}")  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            if todo:
                metrics.update(train_runs(todo, steps=args.steps, root=Path(d), batch=args.batch,
                                          optimizer=args.optimizer, lr=args.lr,
                                          seed=args.seed))  # fmt: skip
        if args.save:
            Path(args.save).write_text(json.dumps({"batch": args.batch, "optimizer": args.optimizer,
                                                   "lr": args.lr, "seed": args.seed,
                                                   "runs": metrics}))  # fmt: skip
        if "all-reduce" in metrics:  # the reference first
            metrics = {"all-reduce": metrics.pop("all-reduce"), **metrics}
        rows = summarise(metrics)
        # one per horizon (and batch, where it is not the default 16)
        tag = f"{args.steps}" + (f"_batch{args.batch}" if args.batch != 16 else "")
        if (args.optimizer, args.lr) != ("adamw", 3e-3):  # and optimizer / lr, if not AdamW's
            tag += f"_{args.optimizer}_lr{args.lr:g}"
        tag += f"_seed{args.seed}" if args.seed else ""
        figure = f"comm_efficient_bytes_{tag}.png"
        plot_bytes(rows, FIGURES / figure, batch=args.batch,
                   optimizer=f"{'AdamW' if args.optimizer == 'adamw' else 'SGD'}, lr {args.lr:g}")  # fmt: skip
        text = bytes_table(rows)
        if args.optimizer == "sgd" and {"all-reduce", "local-sgd H=1"} <= metrics.keys():
            # the control follows the all-reduce's trajectory only under a linear optimizer
            noise = noise_scale(metrics["all-reduce"], metrics["local-sgd H=1"],
                                b_big=args.batch, b_small=args.batch // 4)  # fmt: skip
            text += "\n\nGradient noise scale:\n\n" + noise_table(
                noise, b_big=args.batch, b_small=args.batch // 4
            )
        print(text)
        sections.append((f"### Loss against bytes ({date})",
                         f"`python benchmarks/comm_efficient.py --part bytes --steps {args.steps}"
                         + (f" --batch {args.batch}" if args.batch != 16 else "")
                         + (f" --optimizer {args.optimizer} --lr {args.lr:g}"
                            if (args.optimizer, args.lr) != ("adamw", 3e-3) else "")
                         + (f" --seed {args.seed}" if args.seed else "")
                         + (f' --only "{args.only}"`' if args.only else "`"),
                         text + f"\n\n![loss against bytes](figures/{figure})"))  # fmt: skip
    if args.part in ("slow", "all"):
        text = slow(args)
        print(text)
        sections.append((f"### A slow network: loopback at {args.rate} ({date})",
                         f"`python benchmarks/comm_efficient.py --part slow --slow-steps "
                         f"{args.slow_steps} --slow-factor {args.slow_factor}` (as root)",
                         text))  # fmt: skip
    if args.part in ("convex", "all"):
        text = convex(args)
        print(text)
        sections.append((f"### Convex check: logistic regression ({date})",
                         f"`python benchmarks/comm_efficient.py --part convex --convex-iters "
                         f"{args.convex_iters}`",
                         text + "\n\n![convex](figures/comm_efficient_convex.png)"))  # fmt: skip
    if args.part in ("torch", "all"):
        text = torch_side_by_side(args)
        print(text)
        sections.append((f"### PowerSGD beside PyTorch's DDP hook ({date})",
                         f"`python benchmarks/comm_efficient.py --part torch --torch-steps "
                         f"{args.torch_steps}`", text))  # fmt: skip
    body = "\n\n".join(f"{title}\n\n{cmd}\n\n{text}" for title, cmd, text in sections)
    print(f"\n--- for {RESULTS.name}, section '{SECTION}' ---\n\n{body}")


if __name__ == "__main__":
    main()
