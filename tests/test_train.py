"""Trainer shards without the launcher: schedule, scaling, recomputation, precision,
checkpoints, config files, the worker's argument parser."""

import json
import math

import pytest
import torch
from numerics import assert_same_run

from plait.commands.common import read_config_file
from plait.commands.train import build_run_config
from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.topology import Topology
from plait.train import checkpoint, optim
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train
from plait.train.worker import _parse


def test_lr_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    lrs = [optim.lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps():
    s = optim.LossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    s.update(found_inf=True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 1024.0
    off = optim.LossScaler(enabled=False)
    off.update(found_inf=True)
    assert off.scale == 1.0


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_changes_nothing_numerically(recompute):
    cfg = preset("tiny", arch="llama", n_layers=2, vocab_size=128, seq_len=16)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("none", recompute):
        model = build_model(cfg, seed=1, recompute=mode)
        model(ids[:, :-1], ids[:, 1:]).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    import sysconfig
    from pathlib import Path

    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    (d / "a.txt").write_text(src.read_text())
    cfg = DataConfig(path=str(d / "a.txt"), tokenizer="bytes", cache_dir=str(d / "cache"))
    prepare(cfg)
    return cfg


def _run(data_cfg, out, **train_kw):
    model = preset("tiny", n_layers=2, hidden=64, seq_len=32, vocab_size=256)
    dtype = train_kw.pop("dtype", "fp32")
    cfg = RunConfig(
        model=model,
        layout=Layout(global_batch_size=4, micro_batch_size=2, dtype=dtype),
        data=data_cfg,
        train=TrainConfig(
            **{
                "steps": 6,
                "eval_every": 0,
                "eval_batches": 1,
                "progress": False,
                "warmup": 1,
                **train_kw,
            }
        ),  # fmt: skip
        out=str(out),
    )
    out.mkdir(parents=True, exist_ok=True)
    train(cfg, topo=Topology.single())
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_bf16_autocast_trains_close_to_fp32(small_data, tmp_path):
    fp32 = _run(small_data, tmp_path / "fp32")
    bf16 = _run(small_data, tmp_path / "bf16", dtype="bf16")
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    assert bf16[-1]["loss"] < bf16[0]["loss"]


@pytest.mark.slow
def test_compiled_blocks_train_as_eager(small_data, tmp_path):
    """--compile (torch.compile per block, inductor's C++ kernels here) reproduces the eager
    loss and gradient-norm curves within the layout bounds of ``numerics``: compiled
    kernels fuse and reorder float32 sums, as another layout does."""
    eager = _run(small_data, tmp_path / "eager")
    compiled = _run(small_data, tmp_path / "compiled", compile=True)
    cfg = preset("tiny", n_layers=2, hidden=64, seq_len=32, vocab_size=256)  # as _run's
    assert_same_run(compiled, eager, cfg, 4 * cfg.seq_len, "compiled")


def test_fp16_skips_overflowing_steps(small_data, tmp_path, monkeypatch):
    # Start the loss scale at 2^28: the logits' gradient alone is then ~2^28 / 128 tokens
    # = 2^21 per element, past float16's largest value (65504), so the first steps must
    # overflow. Each is skipped (no update) and halves the scale, until the gradients fit
    # and training proceeds.
    start = 2.0**28
    init = optim.LossScaler.__init__

    def huge(self, enabled, init_scale=None, growth_interval=200):
        init(self, enabled, init_scale=start, growth_interval=growth_interval)

    monkeypatch.setattr(optim.LossScaler, "__init__", huge)
    recs = _run(small_data, tmp_path / "fp16", dtype="fp16", steps=14)
    skipped = [r["skipped"] for r in recs]
    scales = [r["loss_scale"] for r in recs]
    assert skipped[0], "a 2^28 loss scale must overflow float16 on the first step"
    first_kept = skipped.index(False)  # raises if every step was skipped
    assert all(skipped[:first_kept]) and first_kept >= 2
    # the scale recorded after each step: halved by every skipped step, kept otherwise
    # (it grows only after 200 clean steps)
    for i in range(len(recs)):
        want = start / 2 ** sum(skipped[: i + 1])
        assert scales[i] == want, (i, scales[i], want)
    kept = [r["loss"] for r, s in zip(recs, skipped) if not s]
    assert len(kept) >= 3 and kept[-1] < kept[0]


def _engine(model, topo):
    """The stage-0 engine the trainer builds, with its optimizer (what checkpoints hold)."""
    import functools

    from plait.parallel.engine import DataParallelConfig, build_data_parallel

    return build_data_parallel(
        model,
        topo=topo,
        cfg=DataParallelConfig(),
        make_optimizer=functools.partial(optim.build_adamw, cfg=TrainConfig()),
        owns_grad=functools.partial(optim.owns_grad, topo=topo),
    )


def test_checkpoint_ignores_half_written_and_roundtrips(tmp_path):
    """What a stage-0 engine holds (parameters and AdamW state) saved and loaded into
    another model's engine; catches a load that misses the live optimizer state."""
    cfg = preset("tiny", arch="llama", n_layers=2, vocab_size=64, seq_len=8)
    model = build_model(cfg, seed=0)
    topo = Topology.single()
    state = _engine(model, topo).held_state()
    for key in ("exp_avg", "exp_avg_sq"):
        state[f"optim/blocks.0.attn.q.weight/{key}"].flat.fill_(3.0)
    root = tmp_path / "ckpt"
    checkpoint.save(root, 5, state=state, meta={"x": 1}, topo=topo)
    (root / "step-00000009.tmp").mkdir()  # a crash mid-write of a later checkpoint
    assert checkpoint.latest(root).name == "step-00000005"
    other = build_model(cfg, seed=99)
    engine = _engine(other, topo)
    meta = checkpoint.load(checkpoint.latest(root), state=engine.held_state(), topo=topo)
    engine.state_loaded()
    assert meta["step"] == 5 and meta["x"] == 1
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n
    # the optimizer the trainer steps holds the loaded state
    q_weight = dict(other.named_parameters())["blocks.0.attn.q.weight"]
    assert torch.all(engine.optimizer.state[q_weight]["exp_avg"] == 3.0)


def test_config_files_yaml_and_toml(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("model: tiny\narch: llama\ntp: 2\nglobal-batch-size: 32\nsteps: 7\n")
    t = tmp_path / "run.toml"
    t.write_text('model = "tiny"\narch = "llama"\ntp = 2\nglobal_batch_size = 32\nsteps = 7\n')
    for f in (y, t):
        values = read_config_file(str(f))
        cfg = build_run_config(values)
        assert cfg.model.arch == "llama" and cfg.layout.tp == 2 and cfg.train.steps == 7
        assert cfg.layout.global_batch_size == 32 and cfg.layout.micro_batch_size == 32
    # a resolved config.yaml round-trips
    resolved = tmp_path / "config.yaml"
    cfg.save(resolved)
    again = build_run_config(read_config_file(str(resolved)))
    assert again.model == cfg.model and again.layout == cfg.layout


def test_a_run_config_feeds_simulate_plan_and_info(tmp_path, capsys):
    """``--config runs/x/config.yaml`` describes the same model and layout to every
    command; only train takes its data and run folder (plan writes where --out says)."""
    from plait.cli import main

    cfg = build_run_config({"model": "tiny", "dp": 2, "zero": 3, "global_batch_size": 16,
                            "micro_batch_size": 4, "data": "corpus.txt",
                            "out": str(tmp_path / "run")})  # fmt: skip
    resolved = tmp_path / "config.yaml"
    cfg.save(resolved)
    assert main(["simulate", "--config", str(resolved), "--gpu", "cpu", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["n_devices"] == 2 and sim["layout"]["zero"] == 3
    assert sim["layout"]["micro_batch_size"] == 4
    # flags override the file
    assert (
        main(["simulate", "--config", str(resolved), "--gpu", "cpu", "--json", "--zero", "1"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["layout"]["zero"] == 1
    plan = tmp_path / "plan.yaml"
    assert main(["plan", "--config", str(resolved), "--gpu", "cpu", "--out", str(plan)]) == 0
    assert plan.exists() and not (tmp_path / "run").exists()
    assert main(["info", "--config", str(resolved)]) == 0
    others = read_config_file(str(resolved), run=False)
    assert "out" not in others and "data" not in others and others["zero"] == 3
    assert read_config_file(str(resolved))["data"] == "corpus.txt"


def test_worker_parser_rejects_abbreviations():
    assert _parse(["--config", "x.yaml"]).config == "x.yaml"
    with pytest.raises(SystemExit):
        _parse(["--conf", "x.yaml"])


def test_grad_norm_and_clip_through_the_engine():
    """The trainer's own path: the engine's |g|^2 (a float64 device scalar, summed with
    the other statistics in one all-reduce) and its clip (scale_grads_)."""
    model = torch.nn.Linear(3, 1, bias=False)
    topo = Topology.single()
    engine = _engine(model, topo)
    model.weight.grad = torch.full((1, 3), 2.0)
    engine.finish()  # no hooks fired: finish launches (and here completes) the bucket
    sq = engine.grad_sq_local()
    assert sq.dtype == torch.float64 and sq.device == topo.device
    grad_sq, loss = optim.global_stats([sq, torch.tensor(0.5)], topo)
    # the per-tensor norm is an fp32 result (relative rounding 2^-24), squared in float64
    assert grad_sq == pytest.approx(12.0, rel=2**-22) and loss == 0.5
    engine.scale_grads_(optim.clip_coef(math.sqrt(grad_sq), 1.0))
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_weight_decay_follows_the_parameter_not_its_shard():
    """One rule (optim.decays): a ZeRO shard is a flat 1-D shard of a matrix, and decays
    as the matrix does; biases and norm weights never decay."""
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    shard = w.detach().reshape(-1)[:8]
    opt = optim.build_adamw([("w", shard, w), ("b", b, b)], TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["params"] == [shard] and decay["weight_decay"] == 0.1
    assert no_decay["params"] == [b] and no_decay["weight_decay"] == 0.0


def test_workers_bind_their_gpu_or_use_gloo():
    """On a GPU machine each worker takes the GPU of its local rank and binds the NCCL
    group to it (``device_id``); on a CPU, gloo."""
    from plait.train.worker import device_and_backend

    device, backend, extra = device_and_backend(3, cuda=True)
    assert device == torch.device("cuda", 3) and backend == "nccl"
    assert extra == {"device_id": torch.device("cuda", 3)}
    assert device_and_backend(3, cuda=False) == (torch.device("cpu"), "gloo", {})


def test_gpu_peaks_by_name_and_a_one_line_error_for_unknown_gpus():
    from plait.sim.devices import default_dtype, gpu_peak_tflops
    from plait.sim.hardware import get_hardware
    from plait.train.metrics import gpu_peak

    names = {  # as torch.cuda.get_device_name reports them
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA A100-PCIE-40GB": 312.0,
        "NVIDIA A10": 125.0,
        "NVIDIA H100 80GB HBM3": 989.4,
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H100 NVL": 835.0,
        "NVIDIA H200": 989.4,
        "NVIDIA B200": 2250.0,
        "NVIDIA L4": 121.0,
        "NVIDIA L40S": 362.05,
    }
    for name, bf16 in names.items():
        assert gpu_peak_tflops(name, "bf16") == bf16, name
    assert gpu_peak_tflops("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert gpu_peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None
    with pytest.raises(ValueError, match="--peak-tflops") as e:
        gpu_peak("NVIDIA GeForce RTX 4090", "bf16")
    assert "\n" not in str(e.value) and "RTX 4090" in str(e.value)
    # the dtype a device trains in by default: the fastest, fp32 on a tie
    assert default_dtype(get_hardware("a100-80gb").peak_flops) == "bf16"
    assert default_dtype(get_hardware("v100").peak_flops) == "fp16"
    assert default_dtype(get_hardware("cpu").peak_flops) == "fp32"


def test_train_defaults_to_bf16_on_a_gpu(monkeypatch):
    from plait.commands import train as cli

    assert cli._default_train_dtype() == ("bf16" if torch.cuda.is_available() else "fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli._default_train_dtype() == "bf16"


def test_allocator_flushes_are_counted_per_step_and_told_once(small_data, tmp_path, monkeypatch,
                                                             capsys):  # fmt: skip
    """The CUDA allocator's retry counter (cumulative, host-side) becomes each step's own
    count in the record, through the statistics' all-reduce, beside an unchanged peak
    memory; the user is told once. Stand-in counter: +3 a step from step 3. Catches the
    cumulative count reported as the step's (3, 6, 9), the slot written over a peak
    (a peak of 3 bytes), and a note printed every step."""
    from plait.train import loop

    calls = {"n": 0}

    def counter(device):
        calls["n"] += 1
        return 3 * max(calls["n"] - 2, 0)

    monkeypatch.setattr(loop, "alloc_retries", counter)
    recs = _run(small_data, tmp_path / "r", steps=5)
    assert [r.get("alloc_retries", 0) for r in recs] == [0, 0, 3, 3, 3]
    assert all(r["peak_mem_bytes"] > 2**20 for r in recs)
    out = capsys.readouterr().out
    assert out.count("the CUDA allocator ran out of free blocks") == 1
    assert "step 3:" in out
