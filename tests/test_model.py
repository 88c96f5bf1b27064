"""Model: sizes against published figures, formulas against the built modules, determinism."""

import pytest
import torch

from plait.model.config import PRESETS, preset
from plait.model.sizes import (
    hardware_flops_per_token,
    model_flops_per_token,
    model_state_bytes,
    num_params,
)
from plait.model.transformer import build_model

PUBLISHED = {  # Brown et al. 2020 Table 2.1; Touvron et al. 2023; Meta's Llama 3 card
    "gpt3-125m": 125e6,
    "gpt3-350m": 350e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-175b": 175e9,
    "llama-7b": 6.7e9,
    "llama-65b": 65.2e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "llama3.2-1b": 1.24e9,  # Meta's Llama 3.2 card
    "llama3.2-3b": 3.21e9,
    "qwen2.5-0.5b": 0.49e9,  # the Qwen2.5 model cards
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
    "qwen3-8b": 8.2e9,  # the Qwen3 model card
    "mistral-7b": 7.24e9,  # Jiang et al. 2023
}

# The exact counts: the bf16 checkpoints' safetensors index total_size / 2 (Hugging Face),
# where q/k/v biases (Qwen2.5), q/k norms and 128-wide heads (Qwen3) and tied embeddings
# (Llama 3.2, Qwen2.5 0.5B) all count.
EXACT = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published(name):
    assert num_params(preset(name)) == pytest.approx(PUBLISHED[name], rel=0.02)


@pytest.mark.parametrize("name", EXACT)
def test_parameter_counts_are_the_checkpoints(name):
    """Catches a size formula that forgets a family's own tensors (biases, norms, tying)."""
    assert num_params(preset(name)) == EXACT[name]


@pytest.mark.parametrize(
    "name",
    ["gpt3-175b", "llama-65b", "llama3-405b", "gpt2-124m", "llama3.2-1b", "qwen2.5-7b",
     "qwen3-8b", "mistral-7b"],
)  # fmt: skip
def test_meta_build_allocates_nothing_and_matches_formula(name):
    cfg = preset(name)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_built_model_matches_formula_and_shapes(arch):
    cfg = preset("tiny", arch=arch, n_layers=2)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    assert model(ids).shape == (3, 9, cfg.vocab_size)
    loss = model(ids[:, :-1], ids[:, 1:])
    assert loss.shape == (3 * 8,)
    # an untrained model predicts roughly uniformly
    assert loss.mean().item() == pytest.approx(
        torch.log(torch.tensor(cfg.vocab_size)).item(), rel=0.05
    )


def test_llama_flavour_details():
    cfg = preset("tiny", arch="llama", n_kv_heads=2)
    model = build_model(cfg, seed=0)
    names = dict(model.named_parameters())
    assert "head.weight" in names and "embed.positions.weight" not in names  # untied, rotary
    assert names["blocks.0.attn.k.weight"].shape == (cfg.kv_dim, cfg.hidden)  # GQA
    assert not any(n.endswith(".bias") for n in names)
    gpt = dict(build_model(preset("tiny"), seed=0).named_parameters())
    assert "head.weight" not in gpt and "embed.positions.weight" in gpt  # tied, learned


def test_init_depends_only_on_seed_and_name():
    cfg = preset("tiny", arch="llama")
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = build_model(cfg, seed=8)
    assert not torch.equal(a.blocks["0"].attn.q.weight, c.blocks["0"].attn.q.weight)
    # a pipeline chunk holding blocks 2..3 starts from the very same weights
    chunk = build_model(cfg, seed=7, layers=[2, 3], pre=False, post=True)
    full = dict(a.named_parameters())
    for n, p in chunk.named_parameters():
        assert torch.equal(p, full[n]), n


def test_sequence_longer_than_positions_is_refused():
    cfg = preset("tiny", seq_len=8)
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="--seq-len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=130), "--heads 4 does not divide --hidden 130"),
        (dict(arch="llama", n_kv_heads=3), "--kv-heads 3 must divide --heads 4"),
        (dict(arch="gpt2", n_kv_heads=2), "needs --arch llama"),
        (dict(n_layers=0), "--layers must be at least 1"),
    ],
)
def test_config_errors_name_the_flag(kwargs, match):
    arch = kwargs.pop("arch", None)
    with pytest.raises(ValueError, match=match):
        preset("tiny", arch=arch, **kwargs)


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="--model 'gpt5' is not a preset; choose one of tiny"):
        preset("gpt5")


def test_all_presets_valid_in_both_flavours():
    for name in PRESETS:
        for arch in ("gpt2", "llama"):
            cfg = preset(name, arch=arch)
            assert num_params(cfg) > 0


def test_flops_match_megatron_formula():
    # Narayanan et al. 2021: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per iteration without
    # recomputation, 96 B s l h^2 (...) with full recomputation.
    for name in ("gpt3-175b", "gpt3-1.3b"):
        cfg = preset(name)
        l, h, s, V = cfg.n_layers, cfg.hidden, cfg.seq_len, cfg.vocab_size
        per_token = 72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
        assert model_flops_per_token(cfg) == pytest.approx(per_token, rel=1e-12)
        with_recompute = 96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        assert hardware_flops_per_token(cfg, recompute="full") == pytest.approx(
            with_recompute, rel=1e-12
        )


def test_model_state_bytes_per_zero_stage():
    n = 1_000_000
    assert model_state_bytes(n, dp=4, zero=0) == 16 * n
    assert model_state_bytes(n, dp=4, zero=1) == 8 * n + 8 * n / 4
    assert model_state_bytes(n, dp=4, zero=2) == 4 * n + 12 * n / 4
    assert model_state_bytes(n, dp=4, zero=3) == 16 * n / 4


def _head_run(cfg, device="cpu"):
    model = build_model(cfg, device=device)
    x = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1)
    )
    x = x.to(device)
    logits = model(x)
    loss = model(x, x).mean()
    loss.backward()
    return logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])  # fmt: skip
@pytest.mark.parametrize("tied", [True, False])
def test_vocab_head_padded_for_its_gemm_gives_the_same_logits_and_gradients(tied, device,
                                                                          monkeypatch):  # fmt: skip
    """The vocabulary head's product runs with its rows padded to a multiple of 128
    (``tensor.vocab_linear``, on by default on CUDA; forced here against the unpadded
    product): same logits (the padded columns cut off: V of them), same loss, same
    gradient of every parameter, the head's / embedding's included, within fp32 rounding
    of the GEMMs' different blocking. Catches the padded columns leaking into the logits
    or the loss's normaliser, and a weight gradient taken from the wrong rows."""
    from functools import partial

    from plait.model import transformer
    from plait.parallel import tensor

    cfg = preset("tiny", n_layers=1, hidden=32, n_heads=2, seq_len=8, vocab_size=200,
                 **({} if tied else {"arch": "llama", "tied_embeddings": False}))  # fmt: skip
    monkeypatch.setattr(tensor, "vocab_linear", partial(tensor.vocab_linear, align=False))
    monkeypatch.setattr(transformer, "vocab_linear", partial(tensor.vocab_linear, align=False))
    plain_logits, plain_grads = _head_run(cfg, device)
    monkeypatch.setattr(tensor, "vocab_linear", partial(tensor.vocab_linear.func, align=True))
    monkeypatch.setattr(transformer, "vocab_linear", partial(tensor.vocab_linear.func, align=True))
    logits, grads = _head_run(cfg, device)
    assert logits.shape == plain_logits.shape == (2, 8, 200)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-6)
    for name, g in plain_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_recompute_layers_recomputes_the_first_blocks_of_each_chunk():
    """``--recompute full --recompute-layers N``: a model chunk's first N blocks re-run
    their forward in the backward, the others keep their activations. ``FlopCounterMode``
    counts the linear FLOPs a step runs: with N = 1 of 4 blocks, the re-run share is a
    quarter of full recomputation's; the gradients equal the run without recomputation
    bit for bit (checkpointing changes when a forward runs, not what it computes); a
    pipeline chunk of blocks 2 and 3 recomputes block 2 only. Catches the flag ignored
    (every block or none recomputed) or counted over the whole model, not per chunk."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = preset("tiny", arch="llama", n_layers=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def run(**kw):
        model = build_model(cfg, seed=1, **kw)
        with FlopCounterMode(display=False) as fc:
            model(ids[:, :-1], ids[:, 1:]).mean().backward()
        grads = [p.grad for p in model.parameters()]
        return fc.get_total_flops(), grads

    none, g_none = run(recompute="none")
    full, _ = run(recompute="full")
    one, g_one = run(recompute="full", recompute_layers=1)
    assert full > none and one - none == pytest.approx((full - none) / 4, rel=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(g_none, g_one))
    chunk = build_model(cfg, layers=[2, 3], pre=False, recompute="full", recompute_layers=1)
    assert [chunk.blocks[k].recompute_full for k in ("2", "3")] == [True, False]


def test_rotary_is_the_rotation_and_its_backward_the_rotation_back():
    """``apply_rotary`` (``transformer._Rotary``: two kernels a half each way): its forward
    equals the rotation of each pair (x1, x2) by its position's angle -- (x1 cos - x2 sin,
    x2 cos + x1 sin) -- on a strided (B, T, H, D) view, within one rounding of bf16 and to
    fp32's rounding in fp32, contiguous and in x's dtype; its backward is that rotation's
    adjoint (``gradcheck`` in float64). Catches a sign flipped in either direction (a
    backward that rotates forward again passes every loss-curve test at small angles but
    not this), swapped halves, and a result left strided or in fp32."""
    from plait.model.transformer import apply_rotary, rotary_tables

    cfg = preset("tiny", arch="llama", hidden=256, n_heads=4, n_kv_heads=4, seq_len=32)
    cos, sin = rotary_tables(cfg, 32, "cpu")
    g = torch.Generator().manual_seed(0)
    # fp32 arithmetic: two rounded products and their rounded sum, <= 3 u (|a| + |b|); then
    # one rounding to x's dtype, <= u_x |result| (u: half an ulp, relative)
    for dtype, u_x in ((torch.bfloat16, 2**-8), (torch.float32, 0.0)):
        qkv = torch.randn(2, 32, 12, 64, generator=g).to(dtype)
        x = qkv[:, :, 4:8]  # (B, T, H, D), strided as q or k of a fused product
        got = apply_rotary(x, cos, sin, seq_dim=1)
        x1, x2 = x.double().chunk(2, dim=-1)
        c, s = cos[:, None].double(), sin[:, None].double()
        want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        terms = torch.cat([(x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()], -1)
        bound = 3 * 2**-24 * terms + u_x * want.abs() * (1 + 2**-20)
        assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
        assert ((got.double() - want).abs() <= bound).all(), dtype

    c64, s64 = cos.double(), sin.double()
    x = torch.randn(2, 8, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: apply_rotary(t, c64[:, :8], s64[:, :8], seq_dim=1), (x,)
    )
