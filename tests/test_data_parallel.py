"""Data parallelism (--zero 0): buckets, the all-reduces launched from the backward, no
communication on accumulation micro-batches, exact averaging, and the loss curve of
``--dp 2`` / ``--dp 4`` against the single process (DESIGN.md section 3).

The helpers at the top (a tiny corpus and model, ``train_cases`` run inside workers,
the curve comparison) are shared with ``test_zero.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
from pathlib import Path

import pytest
import torch
from distributed import place_resume_checkpoint, run_workers
from numerics import assert_same_run
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from plait import comm
from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model.config import preset
from plait.model.sizes import model_state_breakdown
from plait.model.transformer import build_model
from plait.parallel.data_parallel import split_buckets
from plait.parallel.engine import DataParallelConfig, build_data_parallel
from plait.parallel.tensor import weight_casts
from plait.topology import Axis, Topology
from plait.train import optim
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train

STEPS = 12
# After one AdamW step at lr 1e-2: where a gradient is near eps (1e-8), lr * g / (|g| + eps)
# turns a 1e-8 summation-order difference into up to ~1e-4.
PARAM_TOL = 2e-4
WORDS = "the a of to in and model layer data shard rank step loss token batch weight".split()


def tiny(arch: str = "gpt2"):
    return preset("tiny", arch=arch, n_layers=2, hidden=64, n_heads=4, vocab_size=256, seq_len=32)


def make_data(root: Path) -> DataConfig:
    """A small deterministic corpus, tokenised once here so workers only open the cache."""
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(3000))
    (root / "corpus.txt").write_text(text)
    data = DataConfig(path=str(root / "corpus.txt"), tokenizer="bytes", cache_dir=str(root / "c"))
    prepare(data)
    return data


def make_documents(root: Path) -> DataConfig:
    """A corpus of short documents (JSON Lines, one per record: 40-100 bytes each), so
    that every 32-token window of the tiny model crosses an end-of-text token or two --
    what --document-mask acts on."""
    rng = random.Random(1)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 18)))})
             for _ in range(3000)]  # fmt: skip
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    data = DataConfig(path=str(root / "docs.jsonl"), tokenizer="bytes", cache_dir=str(root / "c"))
    prepare(data)
    return data


def make_instructions(root: Path) -> DataConfig:
    """Instruction data (JSON Lines of prompt / completion): the loss is taken on the
    completions only, so each sequence's targets are partly masked."""
    rng = random.Random(2)
    lines = [json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))
                         + "?\n", "completion": " ".join(rng.choice(WORDS) for _ in range(6))})
             for _ in range(2000)]  # fmt: skip
    (root / "instruct.jsonl").write_text("\n".join(lines) + "\n")
    data = DataConfig(path=str(root / "instruct.jsonl"), tokenizer="bytes",
                      cache_dir=str(root / "c"))  # fmt: skip
    prepare(data)
    return data


def run_config(data: DataConfig, out: Path, *, arch="gpt2", train=None, **layout) -> RunConfig:
    train_cfg = TrainConfig(
        **{
            **dict(steps=STEPS, lr=3e-3, warmup=5, eval_every=0, eval_batches=1,
                   progress=False, peak_tflops=1.0, keep_checkpoints=4),
            **(train or {}),
        }
    )  # fmt: skip
    # two micro-batches per step on every layout: accumulation without many collectives
    mbs = 8 // (2 * layout.get("dp", 1))
    layout = Layout(**{"global_batch_size": 8, "micro_batch_size": mbs, **layout})
    Path(out).mkdir(parents=True, exist_ok=True)
    return RunConfig(model=tiny(arch), layout=layout, data=data, train=train_cfg, out=str(out))


def read_metrics(out) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def local_params(cfg: RunConfig, topo: Topology) -> int:
    """Parameters this rank holds (its tp shard of its pipeline chunks), counted on meta."""
    from plait.parallel.pipeline.stage import build_stage

    if cfg.layout.pp > 1:
        model = build_stage(cfg.model, cfg.layout, topo=topo, seed=0, device="meta")
    else:
        model = build_model(cfg.model, topo=topo, device="meta")
    return sum(p.numel() for p in model.parameters())


def resume_from(cfg: RunConfig, checkpoint_dir: Path) -> RunConfig:
    """``cfg`` resuming from a checkpoint that an earlier case (maybe of the same worker
    group) writes: the folder is copied into ``cfg.out`` just before this case runs."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
    object.__setattr__(cfg, "resume_from", str(checkpoint_dir))
    return cfg


class LargestAllocation(TorchDispatchMode):
    """The largest floating-point tensor (bytes) any op creates while active -- not counting
    outputs that share storage with an input (views, in-place ops, collectives into their
    arguments), nor the byte tensors of DCP's object collectives (its pickled plans: their
    size is the number of chunks', not the model's)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.untyped_storage().data_ptr() not in seen):  # fmt: skip
                self.bytes = max(self.bytes, t.nbytes)
        return out


@contextlib.contextmanager
def probe_checkpoints():
    """{"save", "load": the largest tensor created while a checkpoint's state is built and
    saved or loaded; "param": the largest tp shard of one tensor this rank holds a part
    of}, filled while ``Trainer`` saves and resumes inside the context."""
    from plait.train import checkpoint, loop

    probe = {"save": 0, "load": 0, "param": 0}
    real = {
        "save": checkpoint.save,
        "load": checkpoint.load,
        "state": loop.Trainer.checkpoint_state,
    }

    def watched(fn, what):
        def run(*a, **k):
            with LargestAllocation() as mode:
                try:
                    return fn(*a, **k)
                finally:
                    probe[what] = max(probe[what], mode.bytes)
                    for held in (k.get("state") or {}).values():
                        probe["param"] = max(probe["param"],
                                             math.prod(held.shape) * held.flat.element_size())  # fmt: skip

        return run

    checkpoint.save, checkpoint.load = watched(real["save"], "save"), watched(real["load"], "load")
    loop.Trainer.checkpoint_state = watched(real["state"], "save")  # save and resume alike
    try:
        yield probe
    finally:
        checkpoint.save, checkpoint.load = real["save"], real["load"]
        loop.Trainer.checkpoint_state = real["state"]


def train_cases(rank, world, cases):
    """Worker: train every config in turn on one process group; rank 0 returns each run's
    metrics, every rank the model-state bytes it measured, how many parameters it holds and
    what its checkpoints allocated (``probe_checkpoints``)."""
    results = []
    for cfg in cases:
        place_resume_checkpoint(rank, cfg)
        lay = cfg.layout
        topo = Topology.build(pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp)
        with probe_checkpoints() as probe:
            last = train(cfg, topo=topo)
        state = {"total": last["model_state_bytes"], "host": last.get("host_state_bytes", 0)}
        results.append(
            {
                "metrics": read_metrics(cfg.out) if rank == 0 else None,
                "state": state,
                "n_local": local_params(cfg, topo),
                "checkpoint_alloc": probe,
            }
        )
    return results


def assert_same_curve(records: list[dict], ref: list[dict], what: str = "", arch="gpt2") -> None:
    """DESIGN.md section 3: loss and gradient norm of every step as the single process's,
    within the float32 bounds of ``numerics`` (8 sequences of the tiny model a step)."""
    cfg = tiny(arch)
    assert_same_run(records, ref, cfg, 8 * cfg.seq_len, what)


def reference_metrics(data, root: Path, arch="gpt2", steps=STEPS, dtype="fp32",
                      **layout) -> list[dict]:  # fmt: skip
    name = f"ref-{arch}-{steps}" + ("" if dtype == "fp32" else f"-{dtype}")
    name += "".join(f"-{k}" for k in layout)
    cfg = run_config(data, root / name, arch=arch, train={"steps": steps}, dtype=dtype, **layout)
    train(cfg, topo=Topology.single())
    return read_metrics(cfg.out)


def state_matches_formula(result: dict, *, dp: int, zero: int, offload=False, tol=0.05):
    want = model_state_breakdown(result["n_local"], dp=dp, zero=zero, offload_optimizer=offload)
    got = result["state"]
    assert abs(got["total"] - want["device"]) <= tol * want["device"], (got, want)
    assert abs(got["host"] - want["host"]) <= tol * max(want["host"], 1), (got, want)


# --- pure logic --------------------------------------------------------------------------


def test_buckets_are_reverse_order_and_sized():
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]
    buckets = split_buckets(ps, bucket_bytes=4 * 50)
    assert [[p.numel() for p in b] for b in buckets] == [[40, 30], [20, 10]]
    assert split_buckets(ps, bucket_bytes=1) == [[p] for p in reversed(ps)]


def test_config_errors_are_one_line():
    for kwargs in ({"zero": 4}, {"bucket_mb": 0}, {"zero": 0, "offload_optimizer": True}):
        with pytest.raises(ValueError) as e:
            DataParallelConfig(**kwargs)
        assert "\n" not in str(e.value)
    cfg = DataParallelConfig.from_layout(Layout(dp=2, global_batch_size=8, zero=2))
    assert (cfg.zero, cfg.num_microbatches) == (2, 4)


# --- multi-process -----------------------------------------------------------------------


def engine_step(
    rank, world, zero, *, bucket_mb=0.05, shard_group=None, offload=False, gather_dtype="fp32"
):
    """One step of two micro-batches through the engine, checked against the whole batch
    on one process: dp communication per phase, the reduced gradients, the new weights,
    the model-state bytes. ``gather_dtype`` (stage 3): the weights cross the wire, and so
    reach the forward, rounded to it, and both models run under autocast to it (the
    linear layers' weights are then held in it); the reference is given the same rounded
    weights and runs one sequence per micro-batch (bf16 GEMM outputs depend on how rows
    are batched) within a step's ``weight_casts`` (q, k and v as one GEMM, as the units'
    adjacent rows run them), so the gradients still agree to fp32 summation order."""
    topo = Topology.build(pp=1, dp=world, tp=1)
    tcfg = TrainConfig(lr=1e-2, warmup=0)
    cfg = tiny()
    ids = torch.randint(0, 256, (2 * world, 33), generator=torch.Generator().manual_seed(0))
    tokens = ids[:, 1:].numel()

    ref = build_model(cfg, seed=0)
    autocast, rows, casts = contextlib.nullcontext, [ids], contextlib.nullcontext()
    if gather_dtype != "fp32":
        wire = {"bf16": torch.bfloat16, "fp16": torch.float16}[gather_dtype]
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(wire).float())
        autocast = functools.partial(torch.autocast, "cpu", dtype=wire)
        rows = ids.split(1)
        casts = weight_casts()  # q / k / v as one GEMM, as the units' adjacent rows run
    with casts:
        for mb in rows:
            with autocast():
                loss = ref(mb[:, :-1], mb[:, 1:]).sum() / tokens
            loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt = optim.build_adamw([(n, p, p) for n, p in ref.named_parameters()], tcfg)
    opt.step()

    model = build_model(cfg, seed=0, topo=topo)
    engine = build_data_parallel(
        model,
        topo=topo,
        cfg=DataParallelConfig(
            zero=zero,
            bucket_mb=bucket_mb,
            num_microbatches=2,
            shard_group=shard_group,
            offload_optimizer=offload,
            gather_dtype=gather_dtype,
        ),
        make_optimizer=functools.partial(optim.build_adamw, cfg=tcfg),
        owns_grad=functools.partial(optim.owns_grad, topo=topo),
    )
    local = ids.chunk(world)[topo.dp_rank]
    seen = {}
    topo.stats.reset()
    for i, mb in enumerate(local.split(1)):
        with autocast():
            loss = model(mb[:, :-1], mb[:, 1:]).sum() / tokens
        loss.backward()
        seen[f"after micro-batch {i + 1}"] = dict(topo.stats.calls)
    seen["launched by hooks"] = engine.grads.launched_by_hooks
    seen["buckets"] = len(engine.grads.buckets)
    engine.finish()
    seen["after finish"] = dict(topo.stats.calls)
    seen["finish bytes"] = dict(topo.stats.bytes)
    grad_err = max(
        (engine.grad(p).reshape(-1) - _shard(engine, ref_grads[n])).abs().max().item()
        for n, p in model.named_parameters()
    )
    (sq,) = optim.global_stats([engine.grad_sq_local()], topo)
    ref_sq = sum(g.double().pow(2).sum().item() for g in ref_grads.values())
    topo.stats.reset()
    engine.step(1e-2)
    seen["step"] = dict(topo.stats.calls)
    seen["step bytes"] = dict(topo.stats.bytes)
    held = engine.held_state()  # this rank's shard of each parameter (what it checkpoints)
    param_err = max(
        (held[f"model/{n}"].flat - _shard(engine, p.detach())).abs().max().item()
        for n, p in ref.named_parameters()
    )
    if gather_dtype != "fp32":  # checkpoints see the fp32 masters, not the wire copy
        seen["full_is_rounded"] = all(
            torch.equal(h.flat, h.flat.to(wire).float())
            for key, h in held.items()
            if key.startswith("model/")
        )
    seen["state"] = engine.model_state_bytes()
    engine.close()
    seen["n_local"] = sum(p.numel() for p in model.parameters())
    seen.update(grad_err=grad_err, sq_err=sq / ref_sq - 1, param_err=param_err)
    return seen


def device_refusals(world) -> dict:
    """Every collective of comm.py handed a tensor that is not on topo.device (a meta
    tensor here; a CPU tensor on a GPU rank): the one-line error each raises, or None."""
    topo = Topology.build(pp=1, dp=world, tp=1)
    bad = torch.zeros(world, device="meta")
    ok = torch.zeros(world)
    peer = topo.group_ranks[Axis.DP][1 - topo.dp_rank] if world == 2 else 0
    calls = {
        "all_reduce": lambda: comm.all_reduce(bad, topo=topo, axis=Axis.DP),
        "all_gather": lambda: comm.all_gather_into(ok.repeat(world), bad, topo=topo, axis=Axis.DP),
        "reduce_scatter": lambda: comm.reduce_scatter_into(ok[:1], bad, topo=topo, axis=Axis.DP),
        "broadcast": lambda: comm.broadcast(bad, topo=topo, axis=Axis.DP),
        "send": lambda: comm.batch_p2p([("send", bad, peer)], topo=topo, axis=Axis.DP),
        "world_all_reduce": lambda: comm.world_all_reduce(bad, topo=topo),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except comm.CommDeviceError as e:
            out[name] = str(e)
    comm.barrier(topo=topo)  # nothing was posted: the group still works
    return out


def run_checks(rank, world, engine_cases, train_cases_):
    """Worker: the device refusals, several engine steps (kwargs of ``engine_step``), then
    training runs."""
    refusals = device_refusals(world)
    steps = [engine_step(rank, world, **kw) for kw in engine_cases]
    return steps, train_cases(rank, world, train_cases_), refusals


def _shard(engine, full):
    if engine.zero == 0:
        return full.reshape(-1)
    from plait.parallel.flat import zero_shard

    return zero_shard(full, rank=engine.rank, n=engine.n)


def test_dp2_buckets_overlap_accumulate_average_and_match_single_process(tmp_path):
    """--dp 2, stage 0: nothing on the first micro-batch; every bucket launched from the
    second's backward; exactly one all-reduce per bucket; the whole-batch gradient; and
    the single-process loss curve with the model state of the formula."""
    data = make_data(tmp_path)
    ref = reference_metrics(data, tmp_path)
    cases = [run_config(data, tmp_path / "dp2", dp=2)]
    ranks = run_workers(2, run_checks, [{"zero": 0}], cases)
    (seen,), (curve,), refusals = ranks[0]
    assert seen["after micro-batch 1"] == {}
    nb = seen["buckets"]
    assert nb >= 4 and seen["launched by hooks"] == nb
    assert seen["after micro-batch 2"] == {("dp", "all_reduce"): nb}
    assert seen["after finish"] == {("dp", "all_reduce"): nb}
    assert seen["step"] == {}
    assert seen["grad_err"] < 1e-7 and abs(seen["sq_err"]) < 1e-6
    assert seen["param_err"] < PARAM_TOL
    assert_same_curve(curve["metrics"], ref, "dp2")
    for (step,), (result,), refusals in ranks:
        # every collective refuses a tensor off topo.device, in one line naming the call
        for name, msg in refusals.items():
            assert msg is not None and f"comm.{name} was given a tensor on meta" in msg, name
            assert "\n" not in msg
        state_matches_formula(result, dp=2, zero=0)
        state_matches_formula({"state": step["state"], "n_local": step["n_local"]}, dp=2, zero=0)
