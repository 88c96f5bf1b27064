"""The Hugging Face families plait maps (``plait.model.hf``): Llama 3.1 and 3.2 (rope
scaling ``llama3``, tied embeddings), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm, its own
head size) and Mistral (sliding window), each as ``transformers`` builds it from a tiny
random config:

- in: ``hf.load`` of the folder ``save_pretrained`` wrote gives plait's model the same
  logits as ``transformers``;
- out: ``hf.save`` writes a folder ``transformers`` loads as the same class, with plait's
  logits, and that comes back in as the same config and tensors;
- trained: every family starts from its folder, trains 2 steps under tp 2 (sequence
  parallel for two; the tied model also under pp 2, Qwen3 also under ZeRO-3), each step
  within the numerics bound of the single-process run, and the export of its checkpoint
  gives ``transformers`` the trained model's logits.

One group of two workers trains every case (starting processes is the slow part); the
single-process references run in the test process.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from distributed import run_workers
from numerics import U32, assert_same_run, forward_chain

from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model import hf
from plait.model.config import ModelConfig, RopeScaling
from plait.model.transformer import build_model
from plait.topology import Topology
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train

STEPS = 2
SEQ = 32  # four windows of Mistral's 8: the sliding window is in every forward
TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            rms_norm_eps=1e-6)  # fmt: skip
# Llama 3.1's scaling, its original context shrunk to 8 so that T = 32 reaches past it
LLAMA3 = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=8)  # fmt: skip


def hf_configs() -> dict[str, transformers.PretrainedConfig]:
    """Each family's tiny config; what plait must make of it is in ``WANT``."""
    T = transformers
    return {
        "llama3.1": T.LlamaConfig(**TINY, rope_parameters=LLAMA3),
        "llama3.2": T.LlamaConfig(
            **TINY, rope_parameters=dict(LLAMA3, factor=32.0), tie_word_embeddings=True
        ),
        # one key/value head: replicated at tp 2, so the k/v biases' copies are summed too
        "qwen2": T.Qwen2Config(
            **{**TINY, "num_key_value_heads": 1},
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
        "qwen3": T.Qwen3Config(**TINY, head_dim=24),  # 4 x 24 = 96 wide queries, hidden 64
        "mistral": T.MistralConfig(**TINY, sliding_window=8),
    }


WANT = {  # family -> (arch, transformers class, ModelConfig fields it must carry)
    "llama3.1": ("llama", "LlamaForCausalLM",
                 dict(rope_theta=5e5, rope_scaling=RopeScaling(factor=8.0, original_seq_len=8))),
    "llama3.2": ("llama", "LlamaForCausalLM",
                 dict(tied_embeddings=True, rope_scaling=RopeScaling(factor=32.0,
                                                                     original_seq_len=8))),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", dict(n_kv_heads=1, rope_theta=1e6)),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(head_dim=24, tied_embeddings=False)),
    "mistral": ("mistral", "MistralForCausalLM", dict(sliding_window=8)),
}  # fmt: skip


def make_folder(name: str, folder: Path) -> Path:
    """``transformers``' own random model of family ``name``, saved with save_pretrained.
    Its initialiser zeroes biases and sets norms to one; they are moved off those values,
    or a q/k/v bias or q/k norm mapped to the wrong tensor would go unseen."""
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(hf_configs()[name]).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def logits_tol(cfg: ModelConfig, *logits: torch.Tensor) -> float:
    """Absolute bound on a logit difference between two float32 implementations of the
    same model: the forward chain's relative bound (numerics.py) times the largest logit
    (at least 1: a logit is a sum whose terms may exceed it)."""
    scale = max(1.0, *(x.abs().max().item() for x in logits))
    return forward_chain(cfg, 0) * U32 * scale


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _plait(cfg: ModelConfig, state: dict) -> torch.nn.Module:
    model = build_model(cfg, topo=Topology.single("cpu"), seed=9).eval()
    hf.load_into(model, state, Topology.single("cpu"))
    return model


@pytest.mark.parametrize("name", list(WANT))
def test_import_and_export_give_transformers_logits(name, tmp_path):
    """Catches a family whose config maps to the wrong plait model (a dropped rope scaling,
    window, tie or head size), a tensor mapped to the wrong name, and an export that
    transformers would load as another class or with other logits."""
    arch, cls, fields = WANT[name]
    theirs_dir = make_folder(name, tmp_path / "theirs")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(theirs_dir).eval()
    cfg, state = hf.load(theirs_dir)
    assert cfg.arch == arch
    assert {k: getattr(cfg, k) for k in fields} == fields
    ours = _plait(cfg, state)
    ids = _ids(cfg)
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    assert (a - b).abs().max().item() <= logits_tol(cfg, a, b), name
    # out: the same class, plait's logits, and back in exactly
    out = hf.save(tmp_path / "ours", dict(ours.named_parameters()), cfg)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == cls
    with torch.no_grad():
        c = back(ids).logits
    assert (a - c).abs().max().item() <= logits_tol(cfg, a, c), name
    cfg2, state2 = hf.load(out)
    assert cfg2 == cfg
    assert set(state2) == set(state) and all(torch.equal(state2[k], state[k]) for k in state)


def test_each_feature_moves_the_logits(tmp_path):
    """The logit checks above can see each feature: plait's model without it is farther
    from transformers' than the bound (else a feature could be silently ignored)."""
    for name, drop in (("llama3.1", dict(rope_scaling=None)), ("mistral", dict(sliding_window=None)),
                       ("llama3.2", dict(rope_scaling=None))):  # fmt: skip
        folder = make_folder(name, tmp_path / name)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        cfg, state = hf.load(folder)
        ours = _plait(cfg.replace(**drop), state)
        with torch.no_grad():
            a, b = ours(_ids(cfg)), theirs(_ids(cfg)).logits
        assert (a - b).abs().max().item() > 10 * logits_tol(cfg, a, b), (name, drop)


REFUSED = {  # what plait cannot represent -> the field its one line names
    "attention_bias": ("llama", dict(attention_bias=True)),  # o_proj's bias too
    "mlp_bias": ("llama", dict(mlp_bias=True)),
    "'yarn'": ("qwen2", dict(rope_scaling=dict(rope_type="yarn", factor=4.0))),
    "use_sliding_window": ("qwen2", dict(use_sliding_window=True, sliding_window=8)),
    "layer_types": ("qwen3", dict(layer_types=["full_attention", "sliding_attention"])),
    "partial_rotary_factor": ("llama", dict(partial_rotary_factor=0.5)),
    "hidden_act": ("mistral", dict(hidden_act="gelu")),
    "model_type 'gemma2'": ("gemma2", {}),
}


def _config_json(arch: str, extra: dict) -> dict:
    return {"model_type": arch, **TINY, "rope_theta": 1e4, **extra}


@pytest.mark.parametrize("field", list(REFUSED))
def test_a_config_plait_cannot_represent_is_one_line(field, tmp_path, capsys):
    """Catches a config that would load as a different model instead of being refused,
    and a refusal that is a traceback rather than one line naming the field (exit 2)."""
    from plait.cli import main

    arch, extra = REFUSED[field]
    with pytest.raises(hf.HFError, match=field):
        hf.model_config(_config_json(arch, extra))
    (tmp_path / "config.json").write_text(json.dumps(_config_json(arch, extra)))
    assert main(["train", "--init-hf", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_folder_from_each_family_picks_its_arch(tmp_path):
    """``plait train --init-hf`` takes the architecture from config.json: the model it
    would build is the folder's (what ``--dry-run`` prints), also when --arch names the
    same family's flavour (llama3 is llama); a contradicting --arch is one line."""
    from plait.cli import main
    from plait.commands.train import build_run_config

    folder = make_folder("qwen3", tmp_path / "q3")
    cfg = build_run_config({"init_hf": str(folder), "out": str(tmp_path / "r")})
    assert cfg.model == hf.read_config(folder) and cfg.model.arch == "qwen3"
    llama = make_folder("llama3.1", tmp_path / "l3")
    cfg = build_run_config({"init_hf": str(llama), "arch": "llama3", "out": str(tmp_path / "r")})
    assert cfg.model.rope_scaling == RopeScaling(factor=8.0, original_seq_len=8)
    assert main(["train", "--init-hf", str(folder), "--arch", "mistral", "--dry-run"]) == 2


# --- trained under tp 2 (and pp 2, ZeRO-3), exported, loaded by transformers --------------

CASES = {  # run -> (family, layout)
    "llama3.1-tp2": ("llama3.1", dict(tp=2)),
    "llama3.2-tp2": ("llama3.2", dict(tp=2)),
    "llama3.2-pp2": ("llama3.2", dict(pp=2)),  # the tied embedding on both stages
    "qwen2-tp2-sp": ("qwen2", dict(tp=2, sequence_parallel=True)),
    "qwen3-tp2": ("qwen3", dict(tp=2)),
    "qwen3-dp2-z3": ("qwen3", dict(dp=2, zero=3)),
    "mistral-tp2-sp": ("mistral", dict(tp=2, sequence_parallel=True)),
}


def run_config(folder: Path, data: DataConfig, out: Path, **layout) -> RunConfig:
    out.mkdir(parents=True, exist_ok=True)
    dp = layout.get("dp", 1)
    return RunConfig(
        model=hf.read_config(folder),
        layout=Layout(global_batch_size=4, micro_batch_size=2 // dp, **layout),
        data=data,
        train=TrainConfig(
            steps=STEPS,
            lr=LR,
            warmup=1,
            eval_every=0,
            eval_batches=1,
            progress=False,
            peak_tflops=1.0,
            init_hf=str(folder),
        ),
        out=str(out),
    )


LR = 1e-2


def _train_all(rank, world, runs):
    for cfg in runs:
        lay = cfg.layout
        train(cfg, topo=Topology.build(pp=lay.pp, dp=lay.dp, tp=lay.tp))
    return True


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-families")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly ships"
    lines = (" ".join(rng.choice(words.split()) for _ in range(12)) for _ in range(400))
    (root / "corpus.txt").write_text("\n".join(lines))
    data = DataConfig(path=str(root / "corpus.txt"), tokenizer="bytes",
                      cache_dir=str(root / "cache"), val_fraction=0.05)  # fmt: skip
    prepare(data)
    folders = {f: make_folder(f, root / "hf" / f) for f in {f for f, _ in CASES.values()}}
    cfgs = {n: run_config(folders[f], data, root / n, **lay) for n, (f, lay) in CASES.items()}
    for cfg in cfgs.values():
        cfg.save(Path(cfg.out) / "config.yaml")  # what the launcher writes
    run_workers(2, _train_all, list(cfgs.values()), timeout=600)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    refs = {}
    try:
        for f, folder in folders.items():
            ref = run_config(folder, data, root / f"ref-{f}")
            ref.save(Path(ref.out) / "config.yaml")
            train(ref, topo=Topology.single())
            refs[f] = ref.out
    finally:
        torch.set_num_threads(threads)
    return root, cfgs, refs


def _metrics(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("run", list(CASES))
def test_trained_layout_exports_what_transformers_computes(trained, run):
    """Catches a tp split that is wrong for a family's own tensors -- q/k/v biases not cut
    with their weights, q/k norm gradients not summed over the tp ranks' heads, a
    replicated kv head's bias copies not summed -- and an export of a trained checkpoint
    that transformers computes differently from plait.

    The steps are held to the single-process run's bounds (``numerics.assert_same_run``)
    and so are the weights, to a tenth of the learning rate: AdamW moves a weight by about
    lr per step whatever the size of its gradient, so a gradient that lacks a part moves
    it by ~lr (q/k norms without their sum over tp: 4e-2 here), while summation order moves
    it by far less (measured: at most 8e-5, on coordinates whose gradient is near 0)."""
    from plait.export import ExportOptions, export
    from plait.generate import load_model

    root, cfgs, refs = trained
    cfg = cfgs[run]
    family = CASES[run][0]
    got, want = _metrics(cfg.out), _metrics(refs[family])
    assert len(got) == len(want) == STEPS
    assert_same_run(got, want, cfg.model, cfg.layout.global_batch_size * SEQ, run)
    _, _, ours = load_model(Path(cfg.out))
    _, _, ref = load_model(Path(refs[family]))
    mine, single = dict(ours.named_parameters()), dict(ref.named_parameters())
    moved = {k: (mine[k] - single[k]).abs().max().item() for k in single}
    assert max(moved.values()) <= LR / 10, max(moved.items(), key=lambda kv: kv[1])
    out, _ = export(Path(cfg.out), root / f"{run}-hf", ExportOptions())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == WANT[family][1]
    initial = _plait(*hf.load(cfg.train.init_hf))
    ids = _ids(cfg.model)
    with torch.no_grad():
        a, b, before = ours(ids), theirs(ids).logits, initial(ids)
    assert (a - b).abs().max().item() <= logits_tol(cfg.model, a, b), run
    assert (a - before).abs().max().item() > 1e-3, "the export must hold the trained weights"
    shutil.rmtree(out)
