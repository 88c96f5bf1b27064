"""LoRA (``plait.model.lora``): configuration errors, how adapters split over tp, their
parameter and FLOP counts, merging, the PEFT round trip through ``peft`` and
``transformers`` (models built from configs, no downloads), export refusals, and
resuming a LoRA run -- one process each; the layouts are in ``test_finetune.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_finetune import run_config, write_instructions

from plait.cli import main
from plait.data import DataConfig, prepare
from plait.generate import load_model
from plait.model import lora
from plait.model.config import ModelConfig
from plait.model.lora import LoRAConfig, apply_lora, is_adapter, merged_state
from plait.model.transformer import build_model
from plait.parallel.tensor import REPLICATED, ShardSpec, shard_spec, tp_shard
from plait.topology import Topology
from plait.train.config import RunConfig
from plait.train.loop import train

CASES = {
    "gpt2": ModelConfig(arch="gpt2", n_layers=2, hidden=32, n_heads=4, seq_len=16, vocab_size=64),
    "llama-gqa": ModelConfig(arch="llama", n_layers=2, hidden=32, n_heads=4, n_kv_heads=2,
                             seq_len=16, vocab_size=64),
}  # fmt: skip


def _randomise_b(model, seed=3):
    """Non-zero B (a trained adapter): B starts at zero, which would hide mistakes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora.B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(rank=0), "--lora-rank must be a positive integer"),
        (dict(rank=4, alpha=0), "--lora-alpha must be positive"),
        (dict(rank=4, targets="q,x"), "--lora-targets 'x' is unknown"),
        (dict(rank=4, targets="q,q"), "names a layer twice"),
        (dict(rank=4, targets=""), "--lora-targets is empty"),
    ],
)
def test_config_errors_are_one_line(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as e:
        LoRAConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_flags_that_do_not_fit_the_model_or_each_other():
    from plait.commands.train import build_run_config

    with pytest.raises(ValueError, match="--lora-targets gate: the gpt2 block has no such"):
        build_run_config({"lora_rank": 4, "lora_targets": "q,gate"})
    with pytest.raises(ValueError, match="--qat with --lora-rank"):
        build_run_config({"lora_rank": 4, "qat": "int8"})
    with pytest.raises(ValueError, match="--lora-alpha and --lora-targets need --lora-rank"):
        build_run_config({"lora_alpha": 4.0})
    cfg = build_run_config({"lora_rank": 8, "lora_targets": "q,k,v,o", "arch": "llama"})
    assert cfg.lora == LoRAConfig(rank=8, alpha=8.0, targets=("q", "k", "v", "o"))
    assert RunConfig.from_dict(cfg.to_dict()).lora == cfg.lora  # config.yaml round trip


@pytest.mark.parametrize("name", list(CASES))
def test_adapters_split_like_their_layers(name):
    """tp = 2 without processes: A replicated (its gradient a tp partial sum) beside a
    column-parallel layer, B split by its rows as the weight is (key/value replicas
    included); A split by columns and B replicated beside a row-parallel layer; each
    rank's initial values are its cut of the whole model's; the counts match the formula."""
    cfg = CASES[name]
    lcfg = LoRAConfig(rank=4, targets="q,k,v,o,up,down" + (",gate" if cfg.arch == "llama" else ""))
    whole = build_model(cfg, seed=0)
    apply_lora(whole, lcfg, arch=cfg.arch, seed=0)
    full = dict(whole.named_parameters())
    assert sum(p.numel() for n, p in full.items() if is_adapter(n)) == lora.num_adapter_params(
        cfg, lcfg
    )
    for tp_rank in range(2):
        topo = Topology(tp=2, rank=tp_rank)
        model = build_model(cfg, seed=0, topo=topo)
        apply_lora(model, lcfg, arch=cfg.arch, seed=0)
        params = dict(model.named_parameters())
        assert all(p.requires_grad == is_adapter(n) for n, p in params.items())
        a, b = params["blocks.0.attn.q.lora.A"], params["blocks.0.attn.q.lora.B"]
        assert shard_spec(a) == REPLICATED and a.tp_partial and shard_spec(b) == ShardSpec(dim=0)
        a, b = params["blocks.1.attn.o.lora.A"], params["blocks.1.attn.o.lora.B"]
        assert shard_spec(a) == ShardSpec(dim=1) and shard_spec(b) == REPLICATED and b.tp_partial
        for n, p in params.items():
            if is_adapter(n):
                cut = tp_shard(full[n], shard_spec(p), tp_rank=tp_rank, tp=2)
                assert torch.equal(p, cut), n
        per_layer = sum(p.numel() for n, p in params.items() if is_adapter(n)) / cfg.n_layers
        assert per_layer == lora.adapter_params_per_layer(cfg, lcfg, tp=2)
    if cfg.n_kv_heads < 4:  # kv heads split over tp 2: B of k follows the weight's spec
        assert shard_spec(params["blocks.0.attn.k.lora.B"]) == shard_spec(
            params["blocks.0.attn.k.weight"]
        )


def test_adapters_start_from_the_base_and_merge_exactly():
    cfg = CASES["llama-gqa"]
    lcfg = LoRAConfig(rank=4, alpha=16, targets="q,v,o,up,down,gate")
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    base = build_model(cfg, seed=0).eval()
    model = build_model(cfg, seed=0).eval()
    apply_lora(model, lcfg, arch=cfg.arch, seed=0)
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))  # B = 0: exactly the base model
        _randomise_b(model)
        unmerged = model(ids)
        merged = build_model(cfg, seed=5).eval()
        merged.load_state_dict(merged_state(dict(model.named_parameters()), lcfg))
        # merged in float64, rounded once: the logits differ by fp32 rounding only
        assert (merged(ids) - unmerged).abs().max().item() < 1e-5
        assert (unmerged - base(ids)).abs().max().item() > 1e-2  # the adapters do something


def test_lora_flops_count_frozen_weights_without_weight_gradients():
    from plait.model.sizes import layer_matmul_params, model_flops_per_token

    cfg = CASES["gpt2"]
    lcfg = LoRAConfig(rank=2, targets="q")
    dense = cfg.n_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden
    adapters = cfg.n_layers * 2 * (cfg.hidden + cfg.hidden)
    full = model_flops_per_token(cfg)
    assert lora.model_flops_per_token(cfg, lcfg) == full - 2 * dense + 6 * adapters


# --- a LoRA run on instruction data, one process: export and resume ------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("lora-data")
    cfg = DataConfig(path=str(write_instructions(root / "d.jsonl", n=300)), tokenizer="bytes",
                     cache_dir=str(root / "cache"), val_fraction=0.05)  # fmt: skip
    prepare(cfg)
    return cfg


def _lora_run(data, out: Path, arch: str, **train_kw) -> RunConfig:
    lcfg = LoRAConfig(rank=4, alpha=8, targets="q,k,v,o,up,down")
    cfg = run_config(data, out, arch, lora=lcfg)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6, **train_kw))
    torch.manual_seed(0)
    train(cfg, topo=Topology.single())
    cfg.save(out / "config.yaml")  # what the launcher writes
    return cfg


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lora_run(request, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"lora-{request.param}")
    _lora_run(data, out, request.param, save_every=3, keep_checkpoints=2)
    return out


def test_peft_round_trip_gives_plaits_logits(lora_run, tmp_path, capsys):
    """``plait export --adapter``: transformers loads the base folder, PEFT the adapter
    beside it, and together they compute the logits of plait's (unmerged) model; the
    merged export alone does too."""
    import peft
    import transformers

    _, _, model = load_model(lora_run)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    assert main(["export", "--run", str(lora_run), "--adapter", "--out", str(tmp_path / "a")]) == 0
    assert "adapter/ (PEFT LoRA r=4" in capsys.readouterr().out
    conf = json.loads((tmp_path / "a" / "adapter" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").eval()
    with torch.no_grad():
        plain = base(ids).logits
        tuned = peft.PeftModel.from_pretrained(base, tmp_path / "a" / "adapter").eval()
        theirs = tuned(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - plain).abs().max().item() > 1e-3  # the adapters were trained
    assert (
        main(["export", "--run", str(lora_run), "--merge-lora", "--out", str(tmp_path / "m")]) == 0
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        assert (ours - merged(ids).logits).abs().max().item() < 1e-5


def test_export_of_a_lora_run_says_what_to_choose(lora_run, tmp_path, capsys):
    assert main(["export", "--run", str(lora_run), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass --merge-lora" in err and "--adapter" in err and "\n" not in err
    args = ["export", "--run", str(lora_run), "--adapter", "--quantize", "int8"]
    assert main(args) == 2
    assert "--quantize with --adapter" in capsys.readouterr().err


@pytest.mark.parametrize("lora_run", ["llama"], indirect=True)
def test_resume_continues_the_lora_curve(lora_run, data, tmp_path):
    """The checkpoint holds the adapters and their AdamW state: resuming from step 3 gives
    steps 4-6 of the uninterrupted run."""
    import shutil

    full = [json.loads(x) for x in (lora_run / "metrics.jsonl").read_text().splitlines()]
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        lora_run / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000003"
    )
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in full[:3])
    )  # fmt: skip
    _lora_run(data, out, "llama", save_every=3, keep_checkpoints=2, resume=True)
    again = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == list(range(1, 7))
    for a, b in zip(again[3:], full[3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


# --- memory: what the runtime holds, the formula, the simulator, plait info --------------


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_of_a_lora_run_matches_the_formula(zero):
    """One process: the engine's measured parameters + gradients + AdamW state of a LoRA
    model equals ``sizes.model_state_breakdown`` with the base as frozen parameters."""
    import functools

    from plait.model.sizes import model_state_breakdown
    from plait.parallel.engine import DataParallelConfig, build_data_parallel
    from plait.train import optim
    from plait.train.config import TrainConfig

    cfg, lcfg = CASES["llama-gqa"], LoRAConfig(rank=4, targets="q,v,o,down")
    topo = Topology.single()
    model = build_model(cfg, seed=0)
    apply_lora(model, lcfg, arch=cfg.arch, seed=0)
    engine = build_data_parallel(
        model, topo=topo, cfg=DataParallelConfig(zero=zero),
        make_optimizer=functools.partial(optim.build_adamw, cfg=TrainConfig()),
        owns_grad=functools.partial(optim.owns_grad, topo=topo),
    )  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:]).mean().backward()
    engine.finish()
    engine.step(1e-3)  # AdamW's state exists from its first step (stage 0 creates it then)
    got = engine.model_state_bytes()
    n = lora.num_adapter_params(cfg, lcfg)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    want = model_state_breakdown(n, zero=zero, frozen_params=base)
    assert got["grads"] == want["grads"] and got["params"] == want["params"]
    # AdamW's state: two moments per adapter element, plus a scalar step per tensor
    assert got["optim"] - want["optim"] == 4 * sum(p.requires_grad for p in model.parameters())
    engine.close()


def test_simulator_and_info_count_the_frozen_base():
    """``plait simulate`` / ``plait info`` with --lora-rank: weights of base + adapters,
    gradients and AdamW state of the adapters only (tp 2: each rank's split of them), and
    the activations of the base plus each adapter's rank-r product (T r a token and
    adapter), less the frozen head's input. Catches adapters counted as full weights, a
    frozen base given gradients, and the adapters' own activations dropped again."""
    from plait.layout import Layout
    from plait.sim import costs
    from plait.sim.costs import ACT_BYTES
    from plait.sim.hardware import get_hardware
    from plait.sim.simulate import simulate

    cfg = CASES["llama-gqa"].replace(n_layers=4)
    lcfg = LoRAConfig(rank=8, targets="q,k,v,o,up,down,gate")
    lay = Layout(tp=2, dp=2, global_batch_size=8)
    full = simulate(cfg, lay, get_hardware("cpu")).memory
    tuned = simulate(cfg, lay, get_hardware("cpu"), lora=lcfg).memory
    adapters = cfg.n_layers * lora.adapter_params_per_layer(cfg, lcfg, tp=2)
    assert tuned.grads == pytest.approx(4 * adapters)
    assert tuned.optimizer == pytest.approx(8 * adapters)
    assert tuned.weights == pytest.approx(full.weights + 4 * adapters)
    # every linear adapted: no input dropped; each adapter keeps its rank-8 product; the
    # frozen head keeps no input, nor the first block's input norm (the frozen
    # embedding's output takes no gradient; the residual stream's dtype)
    tokens, e = lay.micro_batch_size * cfg.seq_len, ACT_BYTES[lay.dtype]
    kept = cfg.n_layers * 7 * tokens * 8 * e - tokens * cfg.hidden * e
    kept -= tokens * cfg.hidden * costs.residual_bytes(lay)
    assert tuned.activations == pytest.approx(full.activations + kept)


def test_info_prints_what_lora_trains(capsys):
    from plait.model.config import preset

    assert main(["info", "--model", "tiny", "--lora-rank", "8", "--lora-targets", "q,v"]) == 0
    out = capsys.readouterr().out
    t = lora.num_adapter_params(preset("tiny"), LoRAConfig(rank=8))
    assert f"trainable            {t:,}" in out and "gradients 0.000" in out
    assert main(["info", "--lora-targets", "q"]) == 2
    assert "need --lora-rank" in capsys.readouterr().err


def test_dry_run_counts_the_frozen_base_as_info_does(capsys):
    """``plait train --dry-run`` with --lora-rank prints the model state ``plait info``
    prints (base frozen: no gradients or AdamW state for it). Catches the dry run counting
    every weight as trained (it printed 12.55 GiB for llama2-7b, LoRA, ZeRO-3 over 8,
    against plait info's 3.2 GiB)."""
    flags = ["--model", "llama2-7b", "--lora-rank", "16", "--lora-targets",
             "q,k,v,o,up,down,gate", "--dp", "8", "--zero", "3", "--global-batch-size", "64",
             "--micro-batch-size", "1"]  # fmt: skip
    assert main(["info", *flags]) == 0
    info = capsys.readouterr().out
    state = float(info.split("model state per rank ")[1].split(" GiB")[0])
    # (--skip-memory-check: 8 workers of llama2-7b are a GPU node's, not this host's)
    assert main(["train", "--dry-run", "--skip-memory-check", *flags]) == 0
    dry = capsys.readouterr().out
    per_rank = float(dry.split("~")[1].split(" GiB")[0])
    assert per_rank == pytest.approx(state, abs=0.006), (info, dry)  # 3 vs 2 decimals
    assert main(["train", "--dry-run", "--skip-memory-check", *flags[:2], "--dp", "8",
                 "--zero", "3", "--global-batch-size", "64", "--micro-batch-size", "1"]) == 0  # fmt: skip
    full = float(capsys.readouterr().out.split("~")[1].split(" GiB")[0])
    assert full > 3 * per_rank  # without LoRA every weight trains
