"""Hugging Face weights in and out (``plait.model.hf``): the converted model computes the
same logits in ``transformers``, conversions round-trip exactly, and ``plait export`` /
``plait train --init-hf`` carry a trained model out and back in, under any layout."""

import json

import pytest
import torch
import transformers

from plait.model import hf
from plait.model.config import ModelConfig
from plait.model.transformer import build_model
from plait.topology import Topology

CASES = {
    "gpt2": ModelConfig(arch="gpt2", n_layers=2, hidden=64, n_heads=4, seq_len=32, vocab_size=100),
    "llama-gqa": ModelConfig(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                             seq_len=32, vocab_size=100, norm_eps=1e-6, rope_theta=5e5),
}  # fmt: skip


def _plait(cfg, seed=0):
    return build_model(cfg, topo=Topology.single("cpu"), seed=seed, device="cpu").eval()


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_computes_the_same_logits(name, tmp_path):
    cfg = CASES[name]
    model = _plait(cfg)
    state = dict(model.named_parameters())
    folder = hf.save(tmp_path / "hf", state, cfg)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    # back in: exactly the tensors that went out, and the same config
    cfg2, state2 = hf.load(folder)
    assert cfg2 == cfg
    assert set(state2) == set(state)
    assert all(torch.equal(state2[k], state[k].detach()) for k in state)
    # and a model transformers initialised itself comes in with its logits
    other = transformers.AutoModelForCausalLM.from_config(ref.config).eval()
    other.save_pretrained(tmp_path / "theirs")
    cfg3, state3 = hf.load(tmp_path / "theirs")
    mine = _plait(cfg3, seed=5)
    hf.load_into(mine, state3, Topology.single("cpu"))
    with torch.no_grad():
        assert (mine(ids) - other(ids).logits).abs().max().item() < 1e-5


def test_what_does_not_map_is_one_line(tmp_path):
    cfg = hf.hf_config(CASES["llama-gqa"])
    bad = {
        "bert": {**cfg, "model_type": "bert"},
        "rope_scaling": {**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "'dynamic'": {**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5}},
        "lacks 'factor'": {**cfg, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
        "attention_bias": {**cfg, "attention_bias": True},
    }
    for key, d in bad.items():
        with pytest.raises(hf.HFError, match=key if key != "bert" else "model_type 'bert'"):
            hf.model_config(d)
    with pytest.raises(hf.HFError, match="no config.json"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFError, match="no .safetensors"):
        hf.load(tmp_path)
    state = dict(_plait(CASES["llama-gqa"]).named_parameters())
    del state["blocks.1.mlp.up.weight"]
    with pytest.raises(hf.HFError, match="blocks.1.mlp.up.weight"):
        hf.to_hf(state, CASES["llama-gqa"])


def test_a_folder_that_cannot_serve_is_one_line_before_any_worker(tmp_path, capsys):
    """``plait train --init-hf`` (``--dry-run``: nothing starts) and ``plait rehearse
    --init-hf`` open the folder's weight files before anything is built: a file that is
    not safetensors, and one that lacks a tensor the model needs, each exit 2 with one
    line naming it. Catches the check left to the workers' build (a traceback per rank,
    as ``plait rehearse`` printed for a corrupt file until 2026-11-28)."""
    import dataclasses

    from safetensors.torch import save_file

    from plait.cli import main

    model = dataclasses.replace(CASES["llama-gqa"], vocab_size=512)  # a BPE's vocabulary
    folder = tmp_path / "hf"
    hf.save(folder, dict(_plait(model).named_parameters()), model)
    assert (
        main(["train", "--init-hf", str(folder), "--dry-run", "--out", str(tmp_path / "ok")]) == 0
    )
    capsys.readouterr()
    weights = next(folder.glob("*.safetensors"))
    whole = hf.to_hf(dict(_plait(model).named_parameters()), model)
    del whole["model.layers.1.mlp.up_proj.weight"]
    save_file({k: v.detach().contiguous() for k, v in whole.items()}, str(weights))
    for argv in (["train", "--dry-run"], ["rehearse", "--dp", "2"]):
        assert main([*argv, "--init-hf", str(folder), "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.layers.1.mlp.up_proj.weight" in err[0], err
    weights.write_bytes(b"not a safetensors file")
    for argv in (["train", "--dry-run"], ["rehearse", "--dp", "2"]):
        assert main([*argv, "--init-hf", str(folder), "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a readable safetensors file" in err[0], err
