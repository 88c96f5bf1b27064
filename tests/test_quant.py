"""Weight-only quantisation (``plait.model.quant``): QAT's fake quantisation is torchao's,
bit for bit, and is what the exported model computes; ``plait export --quantize`` writes
a file that reloads to the same logits, packs int4 two to a byte, and reports the
validation perplexity change, which stays small for int8."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model.config import ModelConfig, preset
from plait.model.quant import (
    FakeQuant,
    QuantConfig,
    _pack_int4,
    _unpack_int4,
    apply_qat,
    load_quantized,
    quantize_model,
    quantized_layers,
)
from plait.model.transformer import build_model
from plait.topology import Topology
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train

CFG = ModelConfig(arch="llama", n_layers=2, hidden=64, n_heads=4, seq_len=16, vocab_size=64)
SCHEMES = [QuantConfig(dtype="int8"), QuantConfig(dtype="int4", group_size=32)]


@pytest.mark.parametrize("q", SCHEMES, ids=lambda q: q.dtype)
def test_fake_quant_is_torchaos_and_what_the_export_computes(q):
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig, IntxFakeQuantizer

    gran = PerAxis(0) if q.dtype == "int8" else PerGroup(q.group_size)
    theirs = IntxFakeQuantizer(IntxFakeQuantizeConfig(getattr(torch, q.dtype), gran))
    qat = build_model(CFG, seed=0).eval()
    apply_qat(qat, q)
    ptq = build_model(CFG, seed=0).eval()
    names = quantize_model(ptq, q)
    assert names == sorted(quantized_layers(qat)) and len(names) == 2 * 7
    for name, layer in quantized_layers(qat).items():
        fq = layer.weight_quant(layer.weight).detach()
        assert torch.equal(fq, theirs(layer.weight.detach())), name
        exported = dict(ptq.named_parameters())[name + ".weight"]
        assert torch.equal(fq, exported.dequantize()), name
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(qat(ids), ptq(ids))


def test_straight_through_gradient():
    """d(sum c * fq(w))/dw = c where rounding passes it (straight through), 0 where the
    value was clamped (int8's largest |w| lands on 127.5 -> clamped to 127 on one side)."""
    layer = build_model(CFG, seed=0).blocks["0"].mlp.down
    w = layer.weight.detach().clone().requires_grad_()
    c = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    fq = FakeQuant(QuantConfig(dtype="int8"), layer)(w)
    (fq * c).sum().backward()
    scale = FakeQuant(QuantConfig(dtype="int8"), layer).scales(w)
    q = (w.detach() * (1.0 / scale)).round()  # torchao multiplies by the reciprocal
    clamped = (q > 127) | (q < -128)
    # through w * (1 / s) * s: c up to float rounding
    torch.testing.assert_close(w.grad[~clamped], c[~clamped], rtol=1e-6, atol=0)
    assert torch.all(w.grad[clamped] == 0)
    assert 0 < clamped.sum() <= w.shape[0]  # at most each channel's maximum


def test_int4_packs_two_to_a_byte():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # (3, 32), every value
    packed = _pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(_unpack_int4(packed), q)


def test_group_size_must_fit_every_shard():
    with pytest.raises(ValueError, match="--quant-group-size 48 does not divide the 64") as e:
        QuantConfig(dtype="int4", group_size=48).check_model(CFG)
    assert "\n" not in str(e.value)
    # the MLP's second GEMM under tp 2: 172 / 2 = 86 input features per rank
    with pytest.raises(ValueError, match=r"--ffn-hidden / --tp"):
        QuantConfig(dtype="int4", group_size=32).check_model(CFG.replace(ffn_hidden=172), tp=2)
    with pytest.raises(ValueError, match="choose int8 or int4"):
        QuantConfig(dtype="int2")


# --- export of trained runs ---------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("q-data")
    rng = random.Random(0)
    words = "the cat sat on a mat and then a dog ran to the big red barn".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(2500))
    (root / "t.txt").write_text(text)
    cfg = DataConfig(path=str(root / "t.txt"), tokenizer="bytes", cache_dir=str(root / "c"))
    prepare(cfg)
    return cfg


def _run(data, out: Path, *, steps: int, qat=None) -> Path:
    cfg = RunConfig(
        model=preset("tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, seq_len=32,
                     vocab_size=256),
        layout=Layout(global_batch_size=8, micro_batch_size=8),
        data=data,
        train=TrainConfig(steps=steps, lr=1e-2, warmup=2, eval_every=0, eval_batches=2,
                          progress=False, peak_tflops=1.0),
        out=str(out),
        qat=qat,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    train(cfg, topo=Topology.single())
    cfg.save(out / "config.yaml")
    return out


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    return _run(data, tmp_path_factory.mktemp("q-run"), steps=40)


def _export(run: Path, out: Path, *flags) -> dict:
    assert main(["export", "--run", str(run), "--out", str(out), *flags]) == 0
    return json.loads((out / "quantization.json").read_text())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_export_reloads_and_reports_its_perplexity(trained, tmp_path, scheme, capsys):
    """The file reloads (torchao's quantised tensors) to the logits the export measured
    with; the reported validation loss is the reloaded model's. int8 moves the perplexity
    by under 1%: per-channel rounding perturbs each weight by at most scale / 2 = max|w| /
    255, a relative RMS perturbation of about 0.3% of the weights' own spread, whose
    first-order effect on the loss of a trained model averages out (measured here
    ~0.05%); int4's groups of 32 perturb 17 times as much (reported, bounded by 25%)."""
    from plait.export import val_loss
    from plait.generate import load_model

    meta = _export(trained, tmp_path / scheme, "--quantize", scheme)
    out = capsys.readouterr().out
    assert "validation perplexity" in out and "quantized.safetensors" in out
    cfg, model = load_quantized(tmp_path / scheme)
    assert len(meta["layers"]) == 14 and meta["scheme"] == scheme
    rcfg, _, float_model = load_model(trained)
    from plait.data import val_pairs

    ds = prepare(rcfg.data)
    pairs = val_pairs(ds.val, ds.val_mask, seq_len=32, batch=8, num_batches=2)
    assert val_loss(model, pairs)[0] == pytest.approx(meta["val_loss"]["quantized"], rel=1e-6)
    assert val_loss(float_model, pairs)[0] == pytest.approx(meta["val_loss"]["float"], rel=1e-6)
    change = meta["perplexity_change"]
    assert abs(change) < (0.01 if scheme == "int8" else 0.25), change
    sizes = {p.name: p.stat().st_size for p in (tmp_path / scheme).iterdir()}
    assert sizes["quantized.safetensors"] > 0


def test_int4_weights_take_half_the_bytes_of_int8(trained, tmp_path):
    """N quantised weights: int8 stores N bytes plus a 4-byte scale and a 1-byte zero point
    per output channel; int4 N / 2 bytes plus both per group of 32."""
    from safetensors.torch import load_file

    _export(trained, tmp_path / "8", "--quantize", "int8")
    _export(trained, tmp_path / "4", "--quantize", "int4")
    n = 2 * (4 * 64 * 64 + 3 * 64 * 192)  # q, k, v, o and gate, up, down (ffn 192), 2 blocks
    rows = 2 * (4 * 64 + 2 * 192 + 64)
    for scheme, want in (("8", n + 5 * rows), ("4", n // 2 + 5 * n // 32)):
        tensors = load_file(str(tmp_path / scheme / "quantized.safetensors"))
        quantised = sum(t.numel() * t.element_size() for k, t in tensors.items()
                        if k.rsplit(".", 1)[-1] in ("qdata", "qdata_int4x2", "scale", "zero_point"))  # fmt: skip
        assert quantised == want, scheme


def test_qat_model_is_what_the_int4_export_computes(data, tmp_path):
    """A QAT run's final validation loss (its fake-quantised forward) is the exported
    int4 model's, to float rounding: the QAT scheme and the export's are one."""
    run = _run(data, tmp_path / "qat", steps=8, qat=QuantConfig(dtype="int4"))
    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    meta = _export(run, tmp_path / "hf", "--quantize", "int4")
    assert meta["group_size"] == 32
    assert meta["val_loss"]["quantized"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert meta["val_loss"]["float"] != pytest.approx(last["val_loss"], rel=1e-6)
    assert dataclasses.asdict(QuantConfig(dtype="int4"))["group_size"] == 32


def test_quant_flags_that_do_not_fit_are_one_line(tmp_path):
    from plait.commands.common import read_config_file
    from plait.commands.train import build_run_config

    with pytest.raises(ValueError, match="--quant-group-size applies to --qat int4"):
        build_run_config({"qat": "int8", "quant_group_size": 16})
    for scheme in ("int8", "int4"):  # a run's config.yaml feeds the flags back
        cfg = build_run_config({"qat": scheme, "arch": "llama", "out": str(tmp_path)})
        cfg.save(tmp_path / "config.yaml")
        again = build_run_config(read_config_file(str(tmp_path / "config.yaml")))
        assert again.qat == cfg.qat


def test_export_refuses_a_group_size_without_int4(trained, tmp_path, capsys):
    args = ["export", "--run", str(trained), "--quantize", "int8", "--quant-group-size", "16"]
    assert main([*args, "--out", str(tmp_path / "x")]) == 2
    assert "--quant-group-size applies to --quantize int4" in capsys.readouterr().err


@pytest.mark.parametrize("q", SCHEMES, ids=lambda q: q.dtype)
def test_qat_accumulates_micro_batches_through_the_steps_one_copy(q):
    """Under bf16 a step's fake-quantised weight is made once and shared by its micro-batches
    (``tensor.step_cast``); each micro-batch's backward must still reach the fp32 weight,
    straight through the rounding. Catches the shared quantiser graph whose saved tensors
    the first micro-batch's backward freed ("Trying to backward through the graph a second
    time": ``plait train --qat --dtype bf16`` with two micro-batches) and any gradient that
    differs from running each micro-batch with its own graph."""
    from plait.parallel.tensor import weight_casts

    ids = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(0))

    def grads(shared: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model = build_model(CFG, seed=0)
        apply_qat(model, q)
        losses = []
        with weight_casts() if shared else contextlib.nullcontext():
            for mb in ids:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(mb).float().logsumexp(-1).mean()
                loss.backward()
                losses.append(loss.detach())
        return losses, {n: p.grad for n, p in model.named_parameters()}

    (l_shared, g_shared), (l_own, g_own) = grads(True), grads(False)
    assert [float(x) for x in l_shared] == [float(x) for x in l_own]
    layers = quantized_layers(build_model(CFG, seed=0))
    for name, g in g_own.items():
        assert g is not None and g_shared[name] is not None, name
        # the same ops in the same order, up to the order of the two micro-batches' sums
        torch.testing.assert_close(g_shared[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert any(n.removesuffix(".weight") in layers for n in g_own)


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_a_gathered_weights_quantised_linear_is_the_plain_one(dtype):
    """A fake-quantised weight that ZeRO-3 gathers per use (``gathered_per_use``) goes
    through ``tensor.quantised_linear``, which keeps no quantised copy and re-quantises
    in its backward: its output and its gradients (input, weight, bias) equal the plain
    ``F.linear(x, quant(w), b)``'s, column- and row-parallel, under autocast and not.
    Catches a backward that forgets the straight-through clamp, the bias, or the
    autocast casts. (The memory it saves: ``tests/test_rehearse.py``.)"""
    gen = torch.Generator().manual_seed(0)
    cfg = dataclasses.replace(CFG, arch="gpt2", tied_embeddings=True)  # biases everywhere
    results = []
    for gathered in (False, True):
        model = build_model(cfg, seed=0)
        apply_qat(model, QuantConfig(dtype="int8"))
        layers = [model.blocks["0"].attn.q, model.blocks["0"].mlp.proj]
        outs = []
        for layer in layers:
            layer.weight.gathered_per_use = gathered
            x = torch.randn(3, 5, layer.weight.shape[1], generator=gen).requires_grad_()
            c = torch.randn(3, 5, layer.weight.shape[0], generator=torch.Generator().manual_seed(1))
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = layer(x)
            (y.float() * c).sum().backward()
            grads = [x.grad, layer.weight.grad] + ([layer.bias.grad] if layer.bias is not None
                                                   else [])  # fmt: skip
            outs.append((y.detach(), grads))
        results.append(outs)
        gen = torch.Generator().manual_seed(0)
    for (y0, g0), (y1, g1) in zip(*results):
        assert y0.dtype == y1.dtype and torch.equal(y0, y1)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("q", SCHEMES, ids=lambda q: q.dtype)
def test_qat_gradient_is_torchaos_bits_without_its_graph(q):
    """``FakeQuant.grad`` -- the quantiser's gradient each backward takes -- equals, bit for
    bit, what autograd gets through torchao's fake quantisation (fp32 and bf16 incoming
    gradients, scales shrunk so that the clamp cuts some weights), and holds a mask and
    one fp32 copy of the weight beyond its inputs: under 13 bytes an element with the
    weight (4) and a bf16 gradient (2), where making torchao's graph again held 26.
    Catches a gradient that passes the clamped weights, rounds differently (g s / s is
    not g in floating point), or remakes the whole graph in the backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    fq = FakeQuant.__new__(FakeQuant)  # no layer: the scales need no tp reduction here
    fq.cfg, fq.topo, fq.reduce_max = q, None, False
    gen = torch.Generator().manual_seed(0)
    for shrink, dtype in ((1.0, torch.float32), (0.6, torch.float32), (0.6, torch.bfloat16)):
        w = torch.randn(32, 128, generator=gen)
        scales = fq.scales(w) * shrink
        g = torch.randn(32, 128, generator=gen).to(dtype)
        leaf = w.clone().requires_grad_()
        (want,) = torch.autograd.grad(fq.quantize(leaf, scales), leaf, g.float())
        got = fq.grad(w, scales, g)
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert shrink == 1.0 or (want == 0).any()  # the clamp cut some
    with FakeTensorMode():
        w, g = torch.empty(1024, 1024), torch.empty(1024, 1024, dtype=torch.bfloat16)
        scales = fq.scales(w)
        tracker = MemTracker()
        with tracker:
            fq.grad(w, scales, g)
            peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    assert peak / w.numel() < 13, peak / w.numel()


@pytest.mark.parametrize("q", SCHEMES, ids=lambda q: q.dtype)
def test_qat_copy_without_a_graph_is_torchaos_bits_in_one_copy(q):
    """``FakeQuant.quantize`` where no graph is wanted (a step's quantised copy, ZeRO-3's
    per-use product) gives torchao's bits -- fp32 and bf16 weights, negative zeros and
    clamped values included -- and holds one fp32 copy of the weight beyond it: under 9
    bytes an element with the fp32 weight, where torchao's expression held 16. Catches a
    copy whose zeros or rounding differ from the graph's (the fp32 path's and the
    export's), and the forward's share of QAT's peak in the first micro-batch."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torchao.quantization.quant_primitives import _fake_quantize_affine

    fq = FakeQuant.__new__(FakeQuant)  # no layer: the scales need no tp reduction here
    fq.cfg, fq.topo, fq.reduce_max = q, None, False
    gen = torch.Generator().manual_seed(1)
    for shrink, dtype in ((1.0, torch.float32), (0.6, torch.float32), (0.6, torch.bfloat16)):
        w = torch.randn(32, 128, generator=gen).to(dtype)
        w[0, :4], w[1, :4] = -0.0, -1e-30
        scales = fq.scales(w) * shrink
        group = w.shape[1] // scales.shape[1]
        want = _fake_quantize_affine(w, (1, group), scales.to(w.dtype),
                                     torch.zeros_like(scales, dtype=torch.int8), torch.int8,
                                     q.qmin, q.qmax)  # fmt: skip
        got = fq.quantize(w, scales)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert got.dtype == want.dtype and torch.equal(got.view(bits), want.view(bits))
    with FakeTensorMode():
        w = torch.empty(1024, 1024)
        scales = fq.scales(w)
        tracker = MemTracker()
        with tracker, torch.no_grad():
            fq.quantize(w, scales)
            peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    assert peak / w.numel() < 9, peak / w.numel()
