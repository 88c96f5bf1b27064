"""Hugging Face mixtures of experts (``plait.model.hf``): Mixtral and Qwen3-MoE, each as
``transformers`` builds it from a tiny random config -- in (``hf.load`` of the folder
``save_pretrained`` wrote gives transformers' logits), out (``hf.save`` writes a folder
transformers loads as the same class with plait's logits) and back (the same config and
tensors) -- and the MoE configs no Hugging Face family holds, refused in one line."""

from __future__ import annotations

import pytest
import torch
import transformers
from numerics import U32, forward_chain

from plait.model import hf
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.topology import Topology

SEQ = 32
TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            rms_norm_eps=1e-6)  # fmt: skip

WANT = {  # name -> (plait arch, class, fields plait must read)
    "mixtral": ("llama", "MixtralForCausalLM",
                dict(moe_experts=4, moe_top_k=2, moe_every=1, moe_ffn_hidden=96,
                     moe_norm_topk=True)),
    # block 0 dense (intermediate_size), block 1 MoE with experts of its own width
    "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM",
                  dict(moe_experts=4, moe_top_k=2, moe_every=2, moe_ffn_hidden=48,
                       ffn_hidden=96, moe_norm_topk=True, head_dim=16)),
}  # fmt: skip


def _hf_config(name: str):
    if name == "mixtral":
        return transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    return transformers.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=48, decoder_sparse_step=2,
                                       norm_topk_prob=True)  # fmt: skip


def _folder(name: str, folder):
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(name)).eval()
    with torch.no_grad():  # norms off one: a norm mapped to the wrong tensor shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def _tol(cfg, *logits) -> float:
    scale = max(1.0, *(x.abs().max().item() for x in logits))
    return forward_chain(cfg, 0) * U32 * scale


@pytest.mark.parametrize("name", list(WANT))
def test_import_and_export_give_transformers_logits(name, tmp_path):
    """Catches a router or expert tensor mapped to the wrong name or expert, stacks in the
    wrong order, a dense/MoE block pattern or expert width read wrongly, routing that
    differs (top-k renormalisation), and an export transformers loads otherwise."""
    arch, cls, fields = WANT[name]
    theirs_dir = _folder(name, tmp_path / "theirs")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(theirs_dir).eval()
    cfg, state = hf.load(theirs_dir)
    assert cfg.arch == arch
    assert {k: getattr(cfg, k) for k in fields} == fields
    ours = build_model(cfg, seed=9).eval()
    hf.load_into(ours, state, Topology.single())
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    assert (a - b).abs().max().item() <= _tol(cfg, a, b), name
    out = hf.save(tmp_path / "ours", dict(ours.named_parameters()), cfg)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == cls
    with torch.no_grad():
        c = back(ids).logits
    assert (a - c).abs().max().item() <= _tol(cfg, a, c), name
    cfg2, state2 = hf.load(out)
    assert cfg2 == cfg
    assert set(state2) == set(state) and all(torch.equal(state2[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("arch", "fields", "message"),
    [
        ("gpt2", {}, "a mixture of experts of --arch gpt2 has no Hugging Face family"),
        ("llama", dict(moe_shared_experts=1), "--moe-shared-experts: Hugging Face's mixtral"),
        ("qwen3", dict(moe_router="sigmoid"), "--moe-router sigmoid: Hugging Face's qwen3_moe"),
        ("llama", dict(moe_every=2), "--moe-every (Mixtral's blocks are all MoE)"),
    ],
)
def test_an_moe_no_family_holds_is_refused_in_one_line(arch, fields, message, tmp_path):
    """Export of what Mixtral / Qwen3-MoE cannot represent fails with one line naming the
    flag, instead of writing a folder transformers would load as another model."""
    cfg = preset("tiny", arch=arch, n_layers=2, moe_experts=4, **fields)
    state = dict(build_model(cfg, device="meta").named_parameters())
    with pytest.raises(hf.HFError) as e:
        hf.save(tmp_path, {k: torch.zeros(v.shape) for k, v in state.items()}, cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_qwen3_moe_with_dense_only_layers_is_refused(tmp_path):
    """Qwen's ``mlp_only_layers`` (dense blocks outside the sparse step) has no plait
    equivalent: one line naming the field."""
    d = hf.hf_config(preset("tiny", arch="qwen3", n_layers=2, moe_experts=4))
    d["mlp_only_layers"] = [1]
    with pytest.raises(hf.HFError, match="mlp_only_layers"):
        hf.model_config(d)
