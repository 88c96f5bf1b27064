"""Measurements of ``plait calibrate``: each figure the fits need, timed on this machine.

- compute, in this process (``measure_compute``): matrix multiplies over a sweep of shapes
  in a linear layer's three operand layouts, fused attention, copy bandwidth, the
  memory-bound kernels of one layer, and plait's own training step in a few probe sizes
  (``measure_probes``);
- collectives (``measure``'s workers): all-reduce, all-gather, reduce-scatter and
  point-to-point through ``comm.py`` itself -- the calls the trainer makes -- on groups of
  2..``--procs`` worker processes, each repetition after a few milliseconds of compute.

Communication: the worker processes of ``measure`` join one process group (gloo on CPU,
NCCL on CUDA) and build one sub-group per size (``dist.new_group``, on every rank, in the
same order). Each measured collective is issued by every member of its group in the same
order (a barrier first, then the same compute, then the call; the slowest rank's time is
all-reduced over the group), and point-to-point pairs post one send and one receive per
batch in matching order (a ping then a pong, ``comm.batch_p2p``), so no rank waits on a
message that is not posted: no deadlock under NCCL's rules. Ranks outside a group skip
it and meet the others at the next world barrier.
"""

from __future__ import annotations

import socket
import statistics
import time

from plait.calibrate.config import CalibrateConfig

# -- timing --------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _median_time(fn, device: str, *, min_s: float, reps: int) -> float:
    """Median seconds of one ``fn()`` call: ``reps`` timed batches of enough calls to last
    ``min_s`` each (after one warm-up call)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(min_s / one))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


# -- compute -------------------------------------------------------------------------------


def gemm_cases(quick: bool, device: str = "cpu") -> list[tuple[int, int, int, str]]:
    """(m, n, k, kind) of the sweep: ``square`` products, and the transformer products of a
    linear layer with n outputs, k inputs and T tokens: ``forward`` (T, n, k),
    ``input_grad`` (T, k, n) and ``weight_grad`` (n, k, T) (tokens T, hidden h, FFN 4h).
    The sizes are a CPU's small models', or, on a GPU, a real model's: a 1024-square
    product takes an H200 about 10 us, far from its peak (measured: the CPU sweep put the
    H200's bf16 best at 192 TFLOP/s, a quarter of it)."""
    if device.startswith("cuda"):
        squares = [1024, 4096, 8192] if quick else [512, 1024, 2048, 4096, 8192]
        tokens = [2048, 8192] if quick else [1024, 4096, 16384]
        hiddens = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192]
    else:
        squares = [64, 256, 1024] if quick else [32, 64, 128, 256, 512, 1024]
        tokens = [256, 1024] if quick else [128, 512, 2048]
        hiddens = [64, 256] if quick else [64, 128, 256, 512]
    cases = {(s, s, s, "square") for s in squares}
    for T in tokens:
        for h in hiddens:
            for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
                cases |= {(T, n, k, "forward"), (T, k, n, "input_grad"), (n, k, T, "weight_grad")}
    return sorted(cases)


def gemm_shapes(quick: bool, device: str = "cpu") -> list[tuple[int, int, int]]:
    """The distinct (m, n, k) of ``gemm_cases``."""
    return sorted({c[:3] for c in gemm_cases(quick, device)})


def measure_matmuls(
    cfg: CalibrateConfig, log=print, sync=lambda: None
) -> list[tuple[str, int, int, int, float]]:
    """(dtype, m, n, k, seconds) of ``(m x k) @ (k x n)`` over ``gemm_shapes``; ``sync()``
    before each shape keeps concurrent workers on the same one. Squares multiply
    contiguous matrices; the transformer shapes are run with the operand layouts a linear
    layer has: forward ``x W^T``, input gradient ``g W``, weight gradient ``g^T x``."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    min_s, reps = (0.004, 2) if cfg.quick else (0.01, 3)
    out = []
    for dtype in cfg.dtypes:
        shapes = gemm_cases(cfg.quick, str(cfg.device))
        if dtype != "fp32":  # the curve is fitted on fp32; other dtypes only need a peak
            shapes = [s for s in shapes if s[3] == "square" and s[0] >= 256]
        for m, n, k, kind in shapes:
            a, b = _linear_operands(m, n, k, kind, dt[dtype], cfg.device)
            sync()
            t = _median_time(lambda a=a, b=b: a @ b, cfg.device, min_s=min_s, reps=reps)
            out.append((dtype, m, n, k, t))
        best = max(2 * m * n * k / t for d, m, n, k, t in out if d == dtype)
        log(f"  matmul {dtype}: {len(shapes)} shapes, best {best / 1e9:.1f} GFLOP/s")
    return out


def _linear_operands(m: int, n: int, k: int, kind: str, dtype, device):
    """Operands of ``(m x k) @ (k x n)`` laid out as a linear layer has them
    (``gemm_cases``): the forward multiplies by the transposed weight (x W^T), the input
    gradient by the weight as stored (g W), the weight gradient takes the transposed
    output gradient (g^T x)."""
    import torch

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if kind == "forward":
        return randn(m, k), randn(n, k).t()
    if kind == "weight_grad":
        return randn(k, m).t(), randn(k, n)
    return randn(m, k), randn(k, n)  # square, input_grad


def measure_attention(
    cfg: CalibrateConfig, sync=lambda: None
) -> list[tuple[int, int, int, int, float]]:
    """(batch, heads, seq, head size, dtype, seconds) of causal fused attention, forward +
    backward. On a GPU a real model's sizes in bf16 where bf16 is calibrated (the CPU's
    sizes take an H200 microseconds: launch-bound, they fitted an efficiency of 0.00)."""
    import torch
    import torch.nn.functional as F

    gpu = str(cfg.device).startswith("cuda")
    if gpu:
        shapes = [(4, 16, 2048, 128), (8, 12, 1024, 64)] if cfg.quick else GPU_ATTENTION
        dtype = "bf16" if "bf16" in cfg.dtypes else "fp32"
    else:
        shapes = (
            [(4, 4, 128, 32)] if cfg.quick else [(4, 4, 128, 32), (2, 8, 256, 64), (1, 8, 512, 64)]
        )
        dtype = "fp32"
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    min_s, reps = (0.01, 2) if cfg.quick else (0.02, 3)
    out = []
    for b, a, s, d in shapes:
        q, k, v = (torch.randn(b, a, s, d, device=cfg.device).to(dt).requires_grad_()
                   for _ in range(3))  # fmt: skip

        def step(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        sync()
        out.append((b, a, s, d, dtype, _median_time(step, cfg.device, min_s=min_s, reps=reps)))
    return out


GPU_ATTENTION = ((4, 16, 2048, 128), (2, 32, 4096, 128), (8, 12, 1024, 64))


def measure_stream(cfg: CalibrateConfig) -> float:
    """Sustained bytes/s of a large copy (read + write counted)."""
    import torch

    n = (8 if cfg.quick else 32) * 2**20  # floats: 32 / 128 MiB, far past the caches
    src = torch.randn(n, device=cfg.device)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), cfg.device, min_s=0.02, reps=3 if cfg.quick else 5)
    return 2 * 4 * n / t


ELEMENTWISE = (  # (arch, tokens, hidden, heads): the memory-bound kernels of one layer
    ("gpt2", 2048, 128, 4),
    ("gpt2", 1024, 256, 8),
    ("llama", 2048, 128, 4),
    ("llama", 1024, 256, 8),
)
# on a GPU a real model's: the CPU's shapes take an H200 a few microseconds a kernel
# (measured: 72 GB/s where its copies move 3,560 GB/s)
GPU_ELEMENTWISE = (  # in bf16, as a GPU trains: the stream, norms' casts, the activations
    ("gpt2", 16384, 1024, 16, "bf16"),
    ("gpt2", 4096, 4096, 32, "bf16"),
    ("llama", 16384, 1024, 16, "bf16"),
    ("llama", 4096, 4096, 32, "bf16"),
)


def measure_elementwise(
    cfg: CalibrateConfig, sync=lambda: None
) -> list[tuple[tuple, float, float]]:
    """Seconds of the memory-bound kernels of one transformer layer, forward and backward,
    as plait's model runs them: two norms (LayerNorm or plait's RMSNorm), two residual
    adds, the MLP activation (tanh GELU, or SiLU times the up projection) and, for llama,
    rotary embeddings of q and k. One row (shape, bytes, seconds) per ``ELEMENTWISE``
    shape: the bytes its operators read and write, counted as the performance model counts
    a block's (``profiling.StreamBytes`` on the same call, so the rate fitted from them is
    the one the model's counts run at: a fixed formula missed 0.96-4x of what ran, by
    architecture and device)."""
    import torch
    import torch.nn.functional as F

    from plait.model.config import ModelConfig
    from plait.model.transformer import apply_rotary, make_norm, rotary_tables
    from plait.train.profiling import StreamBytes

    min_s, reps = (0.01, 2) if cfg.quick else (0.02, 3)
    out = []
    shapes = GPU_ELEMENTWISE if str(cfg.device).startswith("cuda") else ELEMENTWISE
    for shape in shapes[::2] if cfg.quick else shapes:
        arch, T, h, a = shape[:4]
        dt = torch.bfloat16 if shape[4:] == ("bf16",) else torch.float32
        mc = ModelConfig(arch=arch, n_layers=1, hidden=h, n_heads=a, seq_len=128, vocab_size=256)
        n1, n2 = make_norm(mc).to(cfg.device), make_norm(mc).to(cfg.device)
        for n in (n1, n2):
            torch.nn.init.ones_(n.weight)

        def leaf(*shape, dt=dt):
            return torch.randn(*shape, device=cfg.device).to(dt).requires_grad_()

        x, u, g = leaf(T, h), leaf(T, 4 * h), leaf(T, 4 * h)
        q, k = leaf(T // 128, a, 128, h // a), leaf(T // 128, a, 128, h // a)
        cos, sin = rotary_tables(mc, 128, cfg.device)

        def layer(arch=arch, x=x, u=u, g=g, q=q, k=k, n1=n1, n2=n2, cos=cos, sin=sin):
            r1 = x + n1(x)
            r2 = r1 + n2(r1)
            outs = [r2, F.gelu(u, approximate="tanh") if arch == "gpt2" else F.silu(g) * u]
            if arch == "llama":
                outs += [apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        count = StreamBytes()
        with count:
            layer()
        sync()
        out.append((shape, count.memory_bound(), _median_time(layer, cfg.device, min_s=min_s,
                                                             reps=reps)))  # fmt: skip
    return out


def measure_compute(cfg: CalibrateConfig, log=None, sync=lambda: None) -> dict:
    """Memory bandwidth, the matmul sweep, attention, elementwise kernels and model steps,
    in this process; ``sync()`` (a barrier, in workers) before each measurement keeps
    them measuring together.

    The whole set is measured ``cfg.rounds`` times over and each figure is the median of
    its rounds: a shared or virtual host changes speed for a fraction of a second at a
    time (a 1024^3 matmul on one thread moves between ~80 and ~125 GFLOP/s here), and a
    round seconds later catches the same shape at another moment."""
    import torch

    torch.set_num_threads(cfg.threads)
    if cfg.device == "cuda":
        # fp32 matmuls as the trainer runs them, on TF32 tensor cores (``Trainer.build``
        # turns it on for the process): else the first round's fp32 sweep ran without TF32
        # and, once the probe steps had built a trainer, the next rounds' with it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    passes = []
    for i in range(cfg.rounds):
        sync()
        passes.append({
            "stream": measure_stream(cfg),
            "elementwise": measure_elementwise(cfg, sync),
            "matmul": measure_matmuls(cfg, (log or (lambda m: None)) if i == 0 else (lambda m: None),
                                      sync),
            "attention": measure_attention(cfg, sync),
            **dict(zip(("probe", "optimizer"), measure_probes(cfg, sync))),
        })  # fmt: skip
    return median_of(passes)


def median_of(passes: list[dict]) -> dict:
    """Per-figure median of several measurements of the same set (rounds, or workers):
    ``stream`` is a number, every other key a list of rows whose last element is seconds."""
    return {
        "stream": statistics.median(p["stream"] for p in passes),
        **{key: [(*row[:-1], statistics.median(p[key][i][-1] for p in passes))
                 for i, row in enumerate(passes[0][key])]
           for key in ("matmul", "attention", "elementwise", "probe", "optimizer")},
    }  # fmt: skip


PROBES = (  # (layers, hidden, heads, seq, batch, micro-batch, vocab): overhead- to
    (2, 128, 4, 128, 1, 1, 512),  # compute-bound; the third accumulates 8 micro-batches
    (2, 256, 8, 128, 8, 8, 1024),
    (2, 96, 4, 128, 16, 2, 512),
    (3, 192, 6, 256, 4, 4, 512),
)


# On a GPU the CPU's probes are all launch-bound (an H200 runs their kernels in
# microseconds): a real model's layers instead, in bf16, as a GPU trains, from
# launch-bound (the first) to compute-bound (the third, ~1B-model layers).
GPU_PROBES = (
    (2, 256, 4, 256, 2, 2, 512, "bf16"),
    (4, 1024, 16, 1024, 8, 4, 4096, "bf16"),
    (4, 2048, 16, 2048, 8, 4, 4096, "bf16"),
    (2, 768, 12, 1024, 16, 4, 50304, "bf16"),
)


def probe_case(probe: tuple):
    """(``ModelConfig``, ``Layout``) of one of ``PROBES`` / ``GPU_PROBES`` (fp32 unless
    the probe names a dtype)."""
    from plait.layout import Layout
    from plait.model.config import ModelConfig

    layers, hidden, heads, seq, batch, micro, vocab = probe[:7]
    model = ModelConfig(n_layers=layers, hidden=hidden, n_heads=heads, seq_len=seq,
                        vocab_size=vocab)  # fmt: skip
    dtype = probe[7] if len(probe) > 7 else "fp32"
    return model, Layout(global_batch_size=batch, micro_batch_size=micro, dtype=dtype)


def measure_probes(cfg: CalibrateConfig, sync=lambda: None) -> tuple[list, list]:
    """Seconds of one single-process training step of plait's own model for each of
    ``PROBES`` (all of them also when ``quick``: two knobs are fitted to them, and only
    probes from overhead-bound to compute-bound tell the two apart -- with the two small
    ones alone the fit traded the GEMM level against the per-kernel time at random):
    ``train.loop.Trainer.step`` itself, as
    ``plait train`` runs it (sampler, runner, gradient sync, global statistics, clipping,
    AdamW, the step's metrics), on a corpus of random bytes. Returns (steps, tails): rows
    (probe, seconds) of the whole step, and of its tail from the gradient norm to the
    zeroed gradients (the engine's calls, timed where the trainer makes them;
    ``fit.fit_optimizer``)."""
    import itertools
    import tempfile
    from pathlib import Path

    from plait.topology import Topology
    from plait.train.config import RunConfig, TrainConfig
    from plait.train.loop import Trainer

    out, tails = [], []
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        data = _probe_corpus(Path(tmp))
        tcfg = TrainConfig(steps=1 << 30, warmup=0, eval_every=0, progress=False,
                           peak_tflops=1.0)  # fmt: skip
        probes = PROBES
        if str(cfg.device).startswith("cuda"):  # bf16 where it is calibrated, else fp32
            dtype = "bf16" if "bf16" in cfg.dtypes else "fp32"
            probes = tuple((*p[:7], dtype) for p in GPU_PROBES)
        for probe in probes:
            model_cfg, layout = probe_case(probe)
            run = RunConfig(model=model_cfg, layout=layout, data=data, train=tcfg, out=tmp)
            trainer = Trainer(run, topo=Topology.single(cfg.device))
            tail = _time_tail(trainer.engine, cfg.device)
            steps = itertools.count()
            sync()
            seconds = _median_time(lambda t=trainer, s=steps: t.step(next(s)), cfg.device,
                                   min_s=0.0, reps=2 if cfg.quick else 3)  # fmt: skip
            trainer.close()
            out.append((probe, seconds))
            tails.append((probe, statistics.median(tail[1:])))  # past the warm-up call
    return out, tails


def _probe_corpus(root):
    """Random bytes as text, tokenised once (the bytes tokenizer): enough tokens for any
    probe's batches, so the trainer's sampler has data to read."""
    import random

    from plait.data import DataConfig, prepare

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(8)) for _ in range(64)]
    (root / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(60000)))
    data = DataConfig(path=str(root / "corpus.txt"), tokenizer="bytes",
                      cache_dir=str(root / "cache"))  # fmt: skip
    prepare(data)
    return data


def _time_tail(engine, device: str) -> list[float]:
    """Wrap the trainer's engine so that each step appends the seconds from its gradient
    norm (``grad_sq_local``, the tail's first call) to its zeroed gradients
    (``zero_grad``, the last): the list it returns fills as steps run."""
    seconds, start = [], []
    first, last = engine.grad_sq_local, engine.zero_grad

    def grad_sq_local(*a, **k):
        _sync(device)
        start.append(time.perf_counter())
        return first(*a, **k)

    def zero_grad(*a, **k):
        result = last(*a, **k)
        _sync(device)
        seconds.append(time.perf_counter() - start.pop())
        return result

    engine.grad_sq_local, engine.zero_grad = grad_sq_local, zero_grad
    return seconds


# -- communication -------------------------------------------------------------------------


def message_sizes(quick: bool) -> list[int]:
    """Bytes per message: 1 KiB .. 16 MiB."""
    return [2**12, 2**16, 2**20, 2**22] if quick else [2**k for k in range(10, 25, 2)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg: CalibrateConfig, queue) -> None:
    """One of ``cfg.procs`` processes: the compute sweep (all at once, so that each sees
    the others' load, as training workers do), then the collective sweep; reports
    (rank, compute, collective rows, overhead)."""
    import datetime
    import resource
    import warnings

    import torch
    import torch.distributed as dist

    from plait import comm
    from plait.topology import Axis

    DP = Axis.DP
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor
    torch.set_num_threads(cfg.threads)
    device = "cpu"
    backend = "gloo"
    if cfg.device == "cuda":
        device, backend = f"cuda:{rank}", "nccl"
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    overhead = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}
    n_compute = cfg.compute_procs
    compute_group = dist.new_group(list(range(n_compute))) if n_compute < world else None
    compute = None
    if rank < n_compute:
        sync = (lambda: dist.barrier(group=compute_group)) if n_compute > 1 else (lambda: None)
        compute = measure_compute(cfg, sync=sync)
    dist.barrier()
    reps = 3 if cfg.quick else 5
    work = torch.randn(384, 384, device=device)

    def timed(fn, group) -> float:
        """Median seconds of ``fn`` as a training step meets it: each repetition starts
        together (a barrier), computes for a few milliseconds (the same matmuls on every
        rank, so the backend's threads have gone idle and the caches hold other data),
        then times the collective; the slowest rank's median."""
        fn()  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier(group=group)
            for _ in range(3):
                work @ work
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
        return float(t.median())

    topos = {n: _group_topology(rank, n, group, device) for n, group in groups.items()}
    samples: dict[tuple, list[float]] = {}  # (op, processes, bytes) -> seconds per round
    for _ in range(cfg.rounds):  # rounds apart in time, as for compute (measure_compute)
        for n, group in groups.items():
            if rank < n:
                topo = topos[n]
                for nbytes in message_sizes(cfg.quick):
                    elems = max(n, nbytes // 4 // n * n)
                    full = torch.randn(elems, device=device)
                    part = torch.randn(elems // n, device=device)
                    gathered, shard = torch.empty_like(full), torch.empty_like(part)
                    # the trainer's own calls (comm.py; the flat forms the data-parallel
                    # and ZeRO engines use), on the group as a dp axis
                    calls = {
                        "all_reduce": lambda f=full, t=topo: comm.all_reduce(f, topo=t, axis=DP),
                        "all_gather": lambda o=gathered, p=part, t=topo: comm.all_gather_into(
                            o, p, topo=t, axis=DP
                        ),
                        "reduce_scatter": lambda o=shard, f=full, t=topo: comm.reduce_scatter_into(
                            o, f, topo=t, axis=DP
                        ),
                    }
                    for op, call in calls.items():
                        samples.setdefault((op, n, 4 * elems), []).append(timed(call, group))
            dist.barrier()
        if rank < 2:  # point-to-point between ranks 0 and 1: half a ping-pong
            peer, pair = 1 - rank, topos[2]
            for nbytes in message_sizes(cfg.quick):
                buf = torch.randn(nbytes // 4, device=device)

                def ping(buf=buf, peer=peer, pair=pair):
                    # one operation per batch, the pair's in matching order: rank 0 sends
                    # while rank 1 receives, then the other way
                    for kind in ("send", "recv") if rank == 0 else ("recv", "send"):
                        works = comm.batch_p2p([(kind, buf, peer)], topo=pair, axis=DP)
                        comm.wait(works, topo=pair, axis="dp")

                samples.setdefault(("p2p", 2, nbytes), []).append(timed(ping, groups[2]) / 2)
        dist.barrier()
    rows = [(*key, statistics.median(v)) for key, v in samples.items()]
    queue.put((rank, compute, rows, overhead))
    dist.destroy_process_group()


def _group_topology(rank: int, n: int, group, device: str):
    """A ``Topology`` whose dp axis is ranks 0..n-1 (``group``), so that ``comm.py``'s
    collectives run on it exactly as the trainer calls them (the shape of
    ``Topology.shard_groups``' sub-topologies)."""
    import torch

    from plait.topology import Axis, Topology

    return Topology(
        pp=1, dp=n, tp=1, rank=rank, groups={Axis.DP: group} if rank < n else {},
        group_ranks={Axis.DP: list(range(n)), Axis.PP: [rank], Axis.TP: [rank]},
        device=torch.device(device),
    )  # fmt: skip


def measure(cfg: CalibrateConfig, log=print):
    """(compute, collective rows (op, processes, bytes, seconds), overhead bytes): in this
    process when ``cfg.procs`` is 1, else in ``cfg.procs`` workers started once (fork on
    CPU, spawn on CUDA), compute figures the median over the workers."""
    import resource

    import torch.multiprocessing as mp

    if cfg.procs == 1:
        compute = measure_compute(cfg, log)
        return compute, [], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ctx = mp.get_context("spawn" if cfg.device == "cuda" else "fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg.procs, port, cfg, queue))
             for r in range(cfg.procs)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=600) for _ in procs)
    except Exception:  # noqa: BLE001 - a worker died: say which, not the queue's error
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"the sweep failed (worker exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    compute = median_of([c for _, c, _, _ in results if c is not None])
    return compute, results[0][2], float(results[0][3])
