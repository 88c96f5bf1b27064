"""plait's CUDA paths on a real GPU: the context-parallel glue around PyTorch's fused
attention kernels, a training step against the CPU's, bf16 with fused AdamW, a checkpoint
round trip, ZeRO-Offload's pinned host masters, and the step's host synchronisations.

Skipped without CUDA. On a GPU machine: ``PYTHONPATH=src python -m pytest -q -s
tests/test_cuda.py`` (``-s`` prints the measured facts: kernels picked, synchronisations
per step, peaks); ``benchmarks/gpu_checks.sh`` runs it with the other GPU checks. One
process, one GPU, about a minute.

Tolerances are ``tests/numerics.py``'s: the float32 rounding chains, and for bf16 a count
of bf16 roundings (u = 2^-8, half an ulp 2^-9 each) on the way to each value.
"""

from __future__ import annotations

import dataclasses
import math
import sysconfig
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from numerics import U16, U32, assert_same_run, attention_chain

from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model.config import preset
from plait.topology import Topology
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import Trainer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run `PYTHONPATH=src python -m pytest -q -s tests/test_cuda.py` "
    "on a GPU machine (or benchmarks/gpu_checks.sh)",
)

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def exact_fp32():
    """float32 matmuls in float32: ``Trainer.build`` turns TF32 on for the whole process
    (a deliberate speed choice, u = 2^-11), which the fp32 bounds here do not cover."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------- context-parallel kernels

KERNEL_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
}
B, H, K, D, TQ = 2, 8, 2, 64, 100  # GQA (4 query heads per K/V head); 100: not a multiple of 32


def _block(dt, causal: bool, tk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, TQ, D, generator=g).to(dt)
    k, v = (torch.randn(B, K, tk, D, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(B, H, TQ, D, generator=g).to(dt)
    k_pos = torch.arange(tk)
    q_pos = k_pos[tk - TQ :] if causal else torch.arange(tk, tk + TQ)
    return q, k, v, dout, q_pos, k_pos


def _reference(q, k, v, dout, q_pos, k_pos):
    """float64 attention of the block (the same inputs, as rounded), autograd gradients of
    sum(out * dout), and the magnitudes each error is bounded against (as
    tests/test_context.py's ``_reference``)."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    g, scale = H // K, D**-0.5
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kr.transpose(-1, -2) * scale).masked_fill(
        ~(k_pos[None, :] <= q_pos[:, None]), -math.inf
    )
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = p @ vr
    (out * dout.double()).sum().backward()
    with torch.no_grad():
        a = (q.abs() @ kr.abs().transpose(-1, -2) * scale).max().item()
        do = dout.double().abs()
        gm = do @ vr.abs().transpose(-1, -2)
        sm = p * (gm + (p * gm).sum(-1, keepdim=True))
        tk = k.shape[2]
        mag = {
            "out": p @ vr.abs(),
            "lse": 1 + lse.abs(),
            "dq": sm @ kr.abs() * scale,
            "dk": (sm.transpose(-1, -2) @ q.abs() * scale).view(B, K, g, tk, D).sum(2),
            "dv": (p.transpose(-1, -2) @ do).view(B, K, g, tk, D).sum(2),
        }
    ref = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: t.detach() for n, t in ref.items()}, mag, a


def test_kernel_choice_on_cuda():
    """``context._kernel`` picks the fused kernels on a GPU for grouped-query blocks: flash
    for bf16, memory-efficient for fp32, math only under document masks; on a block with
    keys before its queries (Tk = 3 Tq), as a ring's are. Catches an eligibility check
    asked about the grouped K/V itself (the efficient kernel refuses grouped heads, so fp32
    GQA blocks silently fell back to math attention, holding each block's (B, H, Tq, Tk)
    scores) or with the causal flag (flash refuses causal with Tq != Tk, though the
    kernels only ever run causal on square parts)."""
    from plait.parallel.context import _kernel

    for dt, want in ((torch.bfloat16, "flash"), (torch.float32, "efficient")):
        q, k, *_ = _block(dt, True, 3 * TQ, 0)
        q, k = q.to(CUDA), k.to(CUDA)
        assert _kernel(q, k, None) == want, dt
        assert _kernel(q, k, torch.zeros(B, TQ, dtype=torch.long, device=CUDA)) is None
    print(f"\n  context kernels on {torch.cuda.get_device_name(0)}: bf16 flash, fp32 efficient")


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_fused_kernel_glue_on_real_kernels(kernel, monkeypatch):
    """``attend`` / ``attend_backward`` on CUDA's real fused kernels -- causal blocks with
    visible keys before the causal square (300 keys) and without (100), a fully visible
    block (200) -- against the float64 reference, and the math path (document ids given)
    against it too: out, LSE and dQ/dK/dV, GQA, head size 64. Catches the kernels' calling
    conventions broken (an empty tensor where they take an undefined one selects the
    variable-length flash backward or an attention bias; an unpadded LSE handed to the
    efficient backward; the efficient LSE used with its padding; a causal flag on a
    non-square part: all move values by far more than the bounds).

    Bounds, relative to each value's float64 magnitude: the float32 chain
    (``attention_chain``) for both; flash (bf16) adds at most six bf16 roundings of
    2^-9 on any value's path: P before P V, each of the two parts' outputs, O before
    rowsum(dO O), dS, and each part's bf16 gradient."""
    from plait.parallel import context
    from plait.parallel.context import attend, attend_backward

    seen: list[str] = []
    real_op = context._op

    def counting(name):
        seen.append(name)
        return real_op(name)

    monkeypatch.setattr(context, "_op", counting)
    dt = torch.bfloat16 if kernel == "flash" else torch.float32
    extra = 6 * U16 / 2 if kernel == "flash" else 0.0
    worst = {}
    for i, (causal, tk) in enumerate(((True, 3 * TQ), (True, TQ), (False, 2 * TQ))):
        q, k, v, dout, q_pos, k_pos = _block(dt, causal, tk, i)
        ref, mag, a = _reference(q, k, v, dout, q_pos, k_pos)
        tol = attention_chain(head_dim=D, keys=tk, score_sum=a, group=H // K, cp=2) * U32
        q, k, v, dout, q_pos, k_pos = (x.to(CUDA) for x in (q, k, v, dout, q_pos, k_pos))
        kw = dict(q_pos=q_pos, k_pos=k_pos, causal=causal, scale=D**-0.5)
        docs = dict(q_doc=torch.zeros(B, TQ, dtype=torch.long, device=CUDA),
                    k_doc=torch.zeros(B, tk, dtype=torch.long, device=CUDA))  # fmt: skip
        seen.clear()
        out, lse = attend(q, k, v, **kw)
        o = out.to(dt)
        delta = (dout.float() * o.float()).sum(-1)
        dq, dk, dv = attend_backward(q, k, v, dout, delta, lse, out=o, **kw)
        parts = 2 if causal and tk > TQ else 1
        op = KERNEL_OPS[kernel]
        assert seen == [op] * parts + [f"{op}_backward"] * parts, seen
        assert out.dtype == lse.dtype == dq.dtype == dk.dtype == torch.float32
        m_out, m_lse = attend(q, k, v, **kw, **docs)
        m_delta = (dout.float() * m_out).sum(-1)
        m_grads = attend_backward(q, k, v, dout, m_delta, m_lse, **kw, **docs)
        for path, got, bound in (
            ("fused", dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), tol + extra),
            ("math", dict(out=m_out, lse=m_lse, dq=m_grads[0], dk=m_grads[1], dv=m_grads[2]), tol),
        ):  # fmt: skip
            for name, t in got.items():
                b = bound if name != "lse" else tol  # the kernels' LSE is fp32 throughout
                ratio = ((t.double().cpu() - ref[name]).abs() / (b * mag[name])).max().item()
                worst[(path, name)] = max(worst.get((path, name), 0.0), ratio)
                assert ratio <= 1, (kernel, causal, tk, path, name, ratio)
    assert worst[("fused", "out")] > 0  # the kernels did round: not a vacuous comparison
    print(
        f"\n  {kernel}: worst error / bound "
        + ", ".join(f"{p} {n} {r:.2g}" for (p, n), r in worst.items())
    )


# ---------------------------------------------------------------- training on the GPU


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    (d / "a.txt").write_text(src.read_text())
    cfg = DataConfig(path=str(d / "a.txt"), tokenizer="bytes", cache_dir=str(d / "cache"))
    prepare(cfg)
    return cfg


def _cfg(corpus, out: Path, arch: str, **layout) -> RunConfig:
    model = preset("tiny", arch=arch, n_layers=2, hidden=64, n_heads=4, seq_len=64, vocab_size=256)
    if arch == "llama":
        model = model.replace(n_kv_heads=2)
    return RunConfig(
        model=model,
        layout=Layout(global_batch_size=8, micro_batch_size=4, **{"dtype": "fp32", **layout}),
        data=corpus,
        train=TrainConfig(
            steps=4,
            lr=3e-3,
            warmup=1,
            min_lr_ratio=1.0,
            eval_every=0,
            eval_batches=1,
            progress=False,
            peak_tflops=1.0,
        ),
        out=str(out),
    )


def _steps(cfg: RunConfig, device, steps: range, *, trainer=None):
    """(records, trainer) of ``steps`` on ``device``, TF32 off (``exact_fp32``)."""
    trainer = trainer or Trainer(cfg, topo=Topology.single(device))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return [trainer.step(s) for s in steps], trainer


def _tokens(cfg: RunConfig) -> int:
    return cfg.layout.global_batch_size * cfg.model.seq_len


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fp32_step_on_cuda_equals_the_cpu(corpus, tmp_path, arch):
    """Four fp32 steps of one process on the GPU against the same four on the CPU: loss
    and gradient norm within ``numerics.assert_same_run`` (only the order of summation
    differs: cuBLAS, SDPA's CUDA kernel, the fused AdamW). gpt2 and llama (RoPE, SwiGLU,
    grouped K/V). Catches anything the CUDA path computes differently: a parameter or
    buffer left on the host or built from the CUDA generator, a mis-scaled gradient,
    fused AdamW fed a host step count, a batch moved in the wrong order."""
    cfg = _cfg(corpus, tmp_path / "cpu", arch)
    cpu, _ = _steps(cfg, "cpu", range(4))
    gpu, trainer = _steps(dataclasses.replace(cfg, out=str(tmp_path / "gpu")), CUDA, range(4))
    assert all(p.device == CUDA for p in trainer.model.parameters())
    assert all(g.get("fused") for g in trainer.engine.optimizer.param_groups)
    assert_same_run(gpu, cpu, cfg.model, _tokens(cfg), what=f"{arch} cuda vs cpu")
    trainer.close()


@pytest.mark.parametrize("zero", [0, 1])
def test_bf16_fused_adamw_on_cuda_and_resume(corpus, tmp_path, zero):
    """bf16 autocast with fused AdamW, the GPU default, plain (zero 0) and through ZeRO's
    sharded optimizer (zero 1, dp 1): finite losses close to the fp32 run's first (as
    tests/test_train.py's CPU bf16 test), AdamW's ``step`` state on the parameter's device
    (fused AdamW fails on, or silently mis-steps with, a host step: issue of
    ``adamw_zero_state``), peak memory read from the device. Then a checkpoint round trip
    on the GPU: steps 3-4 of a run resumed from step 2's checkpoint against the
    uninterrupted run's, within one bf16 rounding (only the kernels' summation order may
    differ). Catches a device state saved or loaded through the host wrongly, the CUDA
    generator state not restored, a step count restored onto the host."""
    cfg = _cfg(corpus, tmp_path / "run", "llama", dtype="bf16", zero=zero)
    fp32, _ = _steps(_cfg(corpus, tmp_path / "fp32", "llama"), CUDA, range(1))
    torch.cuda.reset_peak_memory_stats(CUDA)
    recs, trainer = _steps(cfg, CUDA, range(4))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs)
    assert recs[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    opt = trainer.engine.optimizer
    adamw = opt.optimizer if zero else opt
    assert all(g.get("fused") for g in adamw.param_groups)
    states = list(adamw.state.values())
    assert states and all(s["step"].device == CUDA for s in states)
    assert all(s["exp_avg"].device == CUDA for s in states)
    peak = max(r["peak_mem_bytes"] for r in recs)
    assert recs[-1]["model_state_bytes"] < peak <= torch.cuda.max_memory_allocated(CUDA)
    trainer.close()

    # resume from step 2 and compare steps 3-4
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    first, t2 = _steps(cfg, CUDA, range(2))
    cfg.save(Path(cfg.out) / "config.yaml")
    t2.save(2)
    t2.close()
    resumed_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
    t3 = Trainer(resumed_cfg, topo=Topology.single(CUDA))
    assert t3.restore() == 2
    adamw = t3.engine.optimizer.optimizer if zero else t3.engine.optimizer
    assert all(s["step"].device == CUDA and float(s["step"]) == 2 for s in adamw.state.values())
    rest, _ = _steps(resumed_cfg, CUDA, range(2, 4), trainer=t3)
    for key in ("loss", "grad_norm"):
        for got, want in zip(rest, recs[2:]):
            assert abs(got[key] - want[key]) <= U16 / 2 * abs(want[key]), (key, got, want)
    t3.close()


def test_offload_keeps_pinned_host_masters_and_the_curve(corpus, tmp_path, monkeypatch):
    """ZeRO-Offload (zero 1, dp 1) on the GPU: the fp32 masters and AdamW's state in pinned
    host memory (pageable memory would make every non-blocking copy a synchronous one),
    the shards on the GPU, AdamW multi-tensor on the host; four fp32 steps within
    ``assert_same_run`` of the run without offload (host AdamW against fused: only the
    rounding of the update differs). And no ``torch.cuda.synchronize`` in any step (the
    host waits on one event for its gradient copies). Catches an offloaded update read
    before its copies landed (stale or zero gradients), masters not pinned, a device-wide
    synchronize."""
    ref, _ = _steps(_cfg(corpus, tmp_path / "ref", "gpt2"), CUDA, range(4))
    cfg = _cfg(corpus, tmp_path / "off", "gpt2", zero=1, offload_optimizer=True)
    trainer = Trainer(cfg, topo=Topology.single(CUDA))
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), real(*a, **k)))
    got, trainer = _steps(cfg, CUDA, range(4), trainer=trainer)
    assert calls == []
    opt = trainer.engine.optimizer
    assert opt.offload and all(
        t.device.type == "cpu" and t.is_pinned() for t in opt.targets.values()
    )
    assert all(s.device == CUDA for s in opt.shards.values())
    assert not any(g.get("fused") for g in opt.optimizer.param_groups)
    assert_same_run(got, ref, cfg.model, _tokens(cfg), what="offload vs on-device")
    trainer.close()


def test_host_synchronisations_per_step(corpus, tmp_path, monkeypatch):
    """The steady-state step's host synchronisations, counted by CUDA's sync debug mode:
    the same number in the last two steps (nothing that grows with the step count or waits
    on more as the run goes; the first steps may still create state lazily), and never ``torch.cuda.synchronize`` (loop.py's GPU notes). Prints
    the count: the statistics read, plus any blocking copy of the batch to the device."""
    cfg = _cfg(corpus, tmp_path / "sync", "gpt2")
    trainer = Trainer(cfg, topo=Topology.single(CUDA))
    trainer.step(0)  # warm-up: lazy state, first kernels
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), real(*a, **k)))
    counts = []
    for s in range(1, 5):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.step(s)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [x for x in w if "synchroniz" in str(x.message)]
        counts.append(len(syncs))
        where = Counter(f"{Path(x.filename).name}:{x.lineno}" for x in syncs)
    assert calls == []
    print(f"\n  host synchronisations per step {counts}, the last at {dict(where)}")
    assert counts[-1] >= 1 and counts[-1] == counts[-2], counts  # the statistics read at least
    trainer.close()


def test_this_gpu_has_a_peak_and_a_device_default():
    """``plait train`` on this GPU needs its dense peak (MFU; else it stops asking for
    --peak-tflops) and defaults to bf16 here. Catches a device name plait's table does
    not match (``torch.cuda.get_device_name`` spells it) and the default dtype on a GPU."""
    from plait.commands.train import _default_train_dtype
    from plait.train.metrics import peak_tflops

    name = torch.cuda.get_device_name(0)
    bf16 = peak_tflops(CUDA, "bf16")
    assert bf16 > peak_tflops(CUDA, "fp32") > 0, name
    assert _default_train_dtype() == "bf16"
    print(f"\n  {name}: bf16 peak {bf16} TFLOP/s")
