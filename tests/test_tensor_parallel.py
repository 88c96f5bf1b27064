"""Tensor and sequence parallelism against the single-process reference.

Three kinds of checks, each multi-process group started once per world size:

- layers (2 and 4 ranks): every tp layer against its plain ``torch.nn`` counterpart built
  from the same full weights, both in float64 -- outputs, input gradients and weight
  gradients equal up to float64 rounding (``LAYER_TOL``; max-abs error over max-abs value),
  and the collectives each pass issues;
- the whole model (both flavours): the training loop's loss and gradient-norm curves at
  tp 2 and 4, with and without sequence parallelism, and combined with dp 2, against the
  single-process curves (within the float32 bounds of ``numerics``); collective counts and
  bytes of a whole forward and backward against the module docstring's formulas; dropout
  streams;
- errors a user can cause, and the sharding arithmetic (no processes).
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from numerics import assert_same_run, grad_norm_tol, loss_tol
from torch import nn

from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model.config import ModelConfig, preset
from plait.model.transformer import MLP, Attention, apply_rotary, build_model, rotary_tables
from plait.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TPGradSync,
    VocabParallelEmbedding,
    full_shape,
    local_size,
    shard_spec,
    tp_gather,
    tp_shard,
    tp_shard_rng,
    vocab_parallel_cross_entropy,
    vocab_spec,
)
from plait.topology import Topology
from plait.train import checkpoint
from plait.train.config import RunConfig, TrainConfig

B, T = 2, 16  # layer tests: batch, sequence
STEPS = 20
# The layer checks claim equality, so they run in float64 on both sides: what is left is
# rounding in another summation order. Higham's bound for a sum of n terms, n u (u = 2^-53),
# over the longest chain here -- a forward of at most 64 terms per reduction (the 48- and
# 64-wide features, T = 16 keys) and its backward, ~6 reductions deep, plus the gathered
# and reduce-scattered partial sums -- is below 6 * 64 * 2^-53 ~ 4e-14 of the values the
# sums run over; 1e-12 leaves room for those sums' cancellation (a few x) and is still a
# thousand times below float32 rounding, so a float32 shortcut would fail it. (In float32
# the same comparison shows ~1e-6 and depends on the CPU's vector width.)
LAYER_TOL = 1e-12
# ...except the vocabulary-parallel cross-entropy, which computes in float32 by design
# (``tensor.vocab_parallel_cross_entropy``): its log-sum-exp sums at most 51 logits plus
# the tp all-reduce, n u = 64 * 2^-24 ~ 4e-6, times 4 for the exponentials' and the
# logarithm's own rounding.
CE_TOL = 4 * 64 * 2**-24
# The rotary embedding (llama attention) computes in the wider of its input's dtype and
# its fp32 tables' (``transformer.apply_rotary``): float64 here, so its layers are held to
# LAYER_TOL like the rest (until 2026-11-28 it cast to float32, and took 4 x 4 u).


def _layer_tol(key: str) -> float:
    return CE_TOL if key.startswith("ce") else LAYER_TOL


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Max-abs error relative to the max-abs value of the reference (or of ``scale``)."""
    scale = (b if scale is None else scale).double().abs().max().clamp_min(1e-30)
    return ((a.double() - b.double()).abs().max() / scale).item()


def _split(t: torch.Tensor, how: str, topo: Topology, vocab: int | None = None) -> torch.Tensor:
    """This rank's part of a full tensor: 'rep' replicated, 'seq' sequence shard (dim 1),
    'last' split along the last dim (padded to a multiple of tp when ``vocab`` is given)."""
    if how == "rep":
        return t
    if how == "seq":
        return t.chunk(topo.tp, dim=1)[topo.tp_rank]
    spec = ShardSpec(dim=t.dim() - 1, size=vocab)
    return tp_shard(t, spec, tp_rank=topo.tp_rank, tp=topo.tp)


# --- plain torch.nn references -------------------------------------------------------------


class RefMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, self.arch = cfg.hidden, cfg.ffn_hidden, cfg.arch
        if cfg.arch == "gpt2":
            self.fc, self.proj = nn.Linear(h, f), nn.Linear(f, h)
        else:
            self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
            self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        if self.arch == "gpt2":
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class RefAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, h, bias = cfg, cfg.hidden, cfg.biases
        self.q, self.o = nn.Linear(h, h, bias=bias), nn.Linear(h, h, bias=bias)
        self.k, self.v = nn.Linear(h, cfg.kv_dim, bias=bias), nn.Linear(h, cfg.kv_dim, bias=bias)

    def forward(self, x, rope=None):
        b, t, _ = x.shape
        d, a, k = self.cfg.head_dim, self.cfg.n_heads, self.cfg.n_kv_heads
        q = self.q(x).view(b, t, a, d).transpose(1, 2)
        kk = self.k(x).view(b, t, k, d).transpose(1, 2)
        v = self.v(x).view(b, t, k, d).transpose(1, 2)
        if rope is not None:
            q, kk = apply_rotary(q, *rope), apply_rotary(kk, *rope)
        y = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=k != a)
        return self.o(y.transpose(1, 2).reshape(b, t, a * d))


def _randomise(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


# --- layer checks (inside the workers) ----------------------------------------------------


def _check_layer(topo, name, layer, ref, x, *, x_split, out_split, vocab=None, extra=()):
    """Load ``ref``'s full weights into ``layer`` through tp_shard; run both on ``x``; return
    {name/what: relative error} and the collectives of the forward and of the backward."""
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(tp_shard(full[n].detach(), shard_spec(p), tp_rank=topo.tp_rank, tp=topo.tp))
    x_ref = x.clone().requires_grad_(x.is_floating_point())
    out_ref = ref(x_ref, *extra)
    grad_out = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7))
    out_ref.backward(grad_out)

    x_loc = _split(x, x_split, topo).clone().requires_grad_(x.is_floating_point())
    topo.stats.reset()
    out = layer(x_loc, *extra)
    fwd = dict(topo.stats.calls), dict(topo.stats.bytes)
    topo.stats.reset()
    out.backward(_split(grad_out, out_split, topo, vocab))
    bwd = dict(topo.stats.calls), dict(topo.stats.bytes)
    TPGradSync(list(layer.parameters()), topo=topo).finish()

    errs = {f"{name}/out": _rel(out, _split(out_ref.detach(), out_split, topo, vocab))}
    if x.is_floating_point():
        errs[f"{name}/dx"] = _rel(x_loc.grad, _split(x_ref.grad, x_split, topo))
    for n, p in layer.named_parameters():
        # the key bias's true gradient is zero (softmax ignores a shift shared by a row):
        # measure its rounding noise against the key weight's gradient instead
        scale = full["k.weight"].grad if n == "k.bias" else None
        got = tp_gather(p.grad, shard_spec(p), topo=topo)
        errs[f"{name}/d{n}"] = _rel(got, full[n].grad, scale)
    return errs, {name: (fwd, bwd)}


def _layers_worker(rank, world):
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)  # equality is the claim: see LAYER_TOL
    try:
        return _layers(world)
    finally:
        torch.set_default_dtype(torch.float32)


def _layers(world):
    topo = Topology.build(pp=1, dp=1, tp=world)
    g = torch.Generator().manual_seed(1)
    h = 32
    x = torch.randn(B, T, h, generator=g)
    errs, comms = {}, {}

    def check(*args, **kw):
        e, c = _check_layer(topo, *args, **kw)
        errs.update(e)
        comms.update(c)

    for sp in (False, True):
        s = "sp" if sp else "tp"
        xs = "seq" if sp else "rep"
        ref = nn.Linear(h, 48)
        _randomise(ref, 2)
        layer = ColumnParallelLinear(h, 48, topo=topo, bias=True, sequence_parallel=sp)
        check(f"column-{s}", layer, ref, x, x_split=xs, out_split="last")
        ref = nn.Linear(48, h)
        _randomise(ref, 3)
        layer = RowParallelLinear(48, h, topo=topo, bias=True, sequence_parallel=sp)
        x48 = torch.randn(B, T, 48, generator=g)
        check(f"row-{s}", layer, ref, x48, x_split="last", out_split=xs)
        for vocab in (48, 51):  # 51: padded to a multiple of tp
            ref = nn.Embedding(vocab, h)
            _randomise(ref, 4)
            layer = VocabParallelEmbedding(vocab, h, topo=topo, sequence_parallel=sp)
            ids = torch.randint(0, vocab, (B, T), generator=g)
            check(f"embedding{vocab}-{s}", layer, ref, ids, x_split="rep", out_split=xs)
        for arch in ("gpt2", "llama"):
            cfg = ModelConfig(arch=arch, n_layers=2, hidden=h, n_heads=4, ffn_hidden=64, seq_len=T)
            ref = RefMLP(cfg)
            _randomise(ref, 5)
            layer = MLP(cfg, topo=topo, sequence_parallel=sp)
            check(f"mlp-{arch}-{s}", layer, ref, x, x_split=xs, out_split=xs)
            if sp:  # one sequence: its shards lie in rank order, gathered and scattered
                # without a copy (``comm.joined``), where two sequences interleave them
                ref.zero_grad(set_to_none=True)
                layer = MLP(cfg, topo=topo, sequence_parallel=sp)
                check(f"mlp-{arch}-b1-{s}", layer, ref, x[:1], x_split=xs, out_split=xs)
        # attention: multi-head (gpt2), GQA split (kv 4), GQA replicated when kv < tp
        # (kv 2 on 4 ranks), multi-query (kv 1: replicated on every rank)
        for arch, kv in (("gpt2", 8), ("llama", 4), ("llama", 2), ("llama", 1)):
            cfg = ModelConfig(arch=arch, n_layers=2, hidden=h, n_heads=8, n_kv_heads=kv, seq_len=T)
            ref = RefAttention(cfg)
            _randomise(ref, 6)
            layer = Attention(cfg, topo=topo, selective_recompute=False, sequence_parallel=sp)
            rope = rotary_tables(cfg, T, "cpu") if arch == "llama" else None
            name = f"attention-{arch}-kv{kv}-{s}"
            check(name, layer, ref, x, x_split=xs, out_split=xs, extra=(rope,))

    # the column-parallel output gathered, with a padded vocabulary stripped again
    for out_features, spec in ((48, None), (51, vocab_spec(51))):
        ref = nn.Linear(h, out_features, bias=False)
        _randomise(ref, 8)
        layer = ColumnParallelLinear(
            h, out_features, topo=topo, bias=False, spec=spec, gather_output=True
        )
        check(f"column-gather{out_features}", layer, ref, x, x_split="rep", out_split="rep")

    # the vocabulary head's product with its rows padded to a multiple of 128 (on by
    # default on CUDA, forced here): the same logits slice and gradients as unpadded
    import plait.parallel.tensor as tensor_module

    plain = tensor_module.vocab_linear
    tensor_module.vocab_linear = functools.partial(plain, align=True)
    try:
        ref = nn.Linear(h, 51, bias=False)
        _randomise(ref, 9)
        layer = ColumnParallelLinear(h, 51, topo=topo, bias=False, spec=vocab_spec(51))
        check("column-aligned51", layer, ref, x, x_split="rep", out_split="last", vocab=51)
    finally:
        tensor_module.vocab_linear = plain

    # cross-entropy over vocabulary-split logits, with and without padding, and (51nc) as
    # the padded head hands them over: a view cut from wider rows
    for vocab, wide in ((48, False), (51, False), (51, True)):
        logits = torch.randn(B * T, vocab, generator=g) * 3
        targets = torch.randint(0, vocab, (B * T,), generator=g)
        ref_logits = logits.clone().requires_grad_()
        ref_loss = F.cross_entropy(ref_logits, targets, reduction="none")
        w = torch.rand(B * T, generator=g)
        (ref_loss * w).sum().backward()
        loc = _split(logits, "last", topo, vocab).clone()
        leaf = torch.cat([loc, torch.zeros(loc.shape[0], 128 - loc.shape[1])], -1) if wide else loc
        leaf.requires_grad_()
        loc = leaf.narrow(-1, 0, loc.shape[1])
        name = f"ce{vocab}{'nc' if wide else ''}"
        topo.stats.reset()
        loss = vocab_parallel_cross_entropy(loc, targets, topo=topo, valid_vocab=vocab)
        comms[name] = (dict(topo.stats.calls), dict(topo.stats.bytes)), ({}, {})
        (loss * w).sum().backward()
        errs[f"{name}/loss"] = _rel(loss, ref_loss.detach())
        got = leaf.grad.narrow(-1, 0, loc.shape[1])
        errs[f"{name}/dlogits"] = _rel(got, _split(ref_logits.grad, "last", topo, vocab))
        if wide:
            assert not leaf.grad[:, loc.shape[1] :].any(), "gradient in the cut columns"
    return errs, comms


def _expected_layer_comms(name: str, tp: int) -> tuple[dict, dict]:
    """(forward, backward) collectives of one layer: {(axis, op): (calls, bytes)}."""
    # every activation collective moves one (B, T, C) float64 tensor (-b1-: one sequence)
    act = (1 if "-b1-" in name else B) * T * 32 * 8
    sp = name.endswith("-sp")
    f_in, g_out = ("all_gather", "reduce_scatter") if sp else (None, "all_reduce")
    f_back, g_back = ("reduce_scatter", "all_gather") if sp else ("all_reduce", None)

    def one(*ops):
        out: dict = {}
        for op in ops:
            if op is not None:
                calls, nbytes = out.get(("tp", op), (0, 0))
                out[("tp", op)] = (calls + 1, nbytes + act)
        return out

    # sequence parallelism: the backward gathers a column group's input again (its ops
    # saved this rank's shard: tensor.keeping_shard)
    regather = "all_gather" if sp else None

    if name.startswith("column-gather"):
        out = int(name.removeprefix("column-gather"))
        padded = local_size(out, vocab_spec(out), tp) * tp
        return {("tp", "all_gather"): (1, B * T * padded * 8)}, one("all_reduce")
    if name.startswith("column"):
        return one(f_in), one(f_back, regather)
    if name.startswith("row"):
        return one(g_out), one(g_back)
    if name.startswith("embedding"):
        return one(g_out), one(g_back)
    if name.startswith(("mlp", "attention")):
        return one(f_in, g_out), one(f_back, g_back, regather)
    if name.startswith("ce"):  # the max, then the target logit and the sum of exponentials
        return {("tp", "all_reduce"): (2, B * T * 4 * 3)}, {}  # float32 by design
    raise AssertionError(name)


@pytest.mark.parametrize("world", [2, 4])
def test_layers_match_torch_nn(world, request):
    errs, comms = request.getfixturevalue(f"tp{world}")[0]["layers"]
    bad = {k: v for k, v in errs.items() if not v <= _layer_tol(k)}
    assert not bad, f"relative errors above the bounds at tp={world}: {bad}"
    assert any("/dk.weight" in k for k in errs) and "ce51/dlogits" in errs
    assert "column-aligned51/dweight" in errs and "ce51nc/dlogits" in errs
    for name, ((fc, fb), (bc, bb)) in comms.items():
        want_f, want_b = _expected_layer_comms(name, world)
        got_f = {k: (fc[k], fb[k]) for k in fc}
        got_b = {k: (bc[k], bb[k]) for k in bc}
        assert got_f == want_f, f"{name} forward at tp={world}"
        # replicated kv heads and sequence-parallel biases add TPGradSync's one all-reduce
        # per step -- not per pass -- so the backward pass itself is exactly as listed
        assert got_b == want_b, f"{name} backward at tp={world}"


# --- whole-model runs ----------------------------------------------------------------------


def _model_cfg(arch: str) -> ModelConfig:
    # vocabularies that 2 and 4 do not divide: the padding is part of every run
    return preset(
        "tiny",
        arch=arch,
        n_layers=2,
        hidden=64,
        n_heads=4,
        n_kv_heads=2 if arch == "llama" else None,  # split at tp 2, replicated at tp 4
        vocab_size=257 if arch == "gpt2" else 259,
        seq_len=32,
    )


def _run_cfg(arch: str, data: DataConfig, out: Path, *, mb: int = 4, **layout) -> RunConfig:
    return RunConfig(
        model=_model_cfg(arch),
        layout=Layout(micro_batch_size=mb, global_batch_size=8, **layout),
        data=data,
        train=TrainConfig(steps=STEPS, warmup=5, eval_every=0, eval_batches=1, progress=False),
        out=str(out),
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small byte-level corpus, prepared once here so the workers only open the cache;
    and the single-process reference run of each flavour."""
    root = tmp_path_factory.mktemp("tp")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly ships"
    words = words.split()
    lines = (" ".join(rng.choice(words) for _ in range(12)) for _ in range(800))
    (root / "corpus.txt").write_text("\n".join(lines))
    data = DataConfig(
        path=str(root / "corpus.txt"),
        tokenizer="bytes",
        cache_dir=str(root / "cache"),
        val_fraction=0.05,
    )
    prepare(data)
    from plait.train.loop import train

    refs = {}
    for arch in ("gpt2", "llama"):
        out = root / f"ref-{arch}"
        out.mkdir()
        train(_run_cfg(arch, data, out), topo=Topology.single())
        refs[arch] = out
    return root, data, refs


def _count_worker_model(topo, arch: str, sp: bool) -> dict:
    """One whole forward and backward: its collectives, those of TPGradSync, the loss and
    the full gradients."""
    cfg = _model_cfg(arch)
    model = build_model(cfg, seed=0, topo=topo, sequence_parallel=sp)
    ids = torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    topo.stats.reset()
    loss = model(ids[:, :-1], ids[:, 1:]).sum()
    fwd = {k: (topo.stats.calls[k], topo.stats.bytes[k]) for k in topo.stats.calls}
    topo.stats.reset()
    loss.backward()
    bwd = {k: (topo.stats.calls[k], topo.stats.bytes[k]) for k in topo.stats.calls}
    topo.stats.reset()
    TPGradSync(list(model.parameters()), topo=topo).finish()
    sync = {k: (topo.stats.calls[k], topo.stats.bytes[k]) for k in topo.stats.calls}
    grads = {n: tp_gather(p.grad, shard_spec(p), topo=topo) for n, p in model.named_parameters()}
    return {"fwd": fwd, "bwd": bwd, "sync": sync, "loss": loss.item(), "grads": grads}


def _dropout_worker(topo) -> dict:
    """Dropout streams at tp > 1: per-shard inside tp regions, shared outside."""
    out = {}
    torch.manual_seed(5)
    with tp_shard_rng(topo):
        out["inside"] = torch.rand(8)
    out["after"] = torch.rand(8)  # the default stream, resumed in lockstep
    cfg = _model_cfg("gpt2").replace(dropout=0.2)
    ids = torch.randint(0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=0, topo=topo, post=False)  # returns the residual stream
    torch.manual_seed(6)
    out["hidden"] = model(ids[:, :-1]).detach()
    # recomputation replays the same masks, also the per-shard ones (sequence parallel)
    for recompute in ("none", "full"):
        model = build_model(cfg, seed=0, topo=topo, recompute=recompute, sequence_parallel=True)
        torch.manual_seed(7)
        model(ids[:, :-1], ids[:, 1:]).mean().backward()
        out[f"grads-{recompute}"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def _group_worker(rank, world, root, data, layouts):
    """Everything one group of ``world`` processes checks: the layers at tp=world, then
    each training layout for STEPS steps, whole-model collective counts at tp=world, and
    (world 2) the dropout streams."""
    from plait.train.loop import train

    result = {"layers": _layers_worker(rank, world), "runs": {}}
    for name, arch, kw in layouts:
        kw = dict(kw)
        topo = Topology.build(pp=1, dp=kw.get("dp", 1), tp=kw.get("tp", 1))
        out = Path(root) / f"{name}-{arch}"
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
        torch.distributed.barrier()
        train(_run_cfg(arch, data, out, **kw), topo=topo)
        result["runs"][(name, arch)] = str(out)
    topo = Topology.build(pp=1, dp=1, tp=world)
    for arch in ("gpt2", "llama"):
        for sp in (False, True):
            result[("count", arch, sp)] = _count_worker_model(topo, arch, sp)
    if world == 2:
        result["dropout"] = _dropout_worker(topo)
    return result


LAYOUTS = {
    2: [
        (f"tp2{'-sp' if sp else ''}", arch, dict(tp=2, sequence_parallel=sp))
        for arch in ("gpt2", "llama")
        for sp in (False, True)
    ],
    # Four processes share two cores: a crossed design (each flavour, each sequence-parallel
    # setting, at tp 4 and at dp 2 x tp 2) rather than the full product, and one
    # micro-batch a step at tp 4. The layer checks cover the full product at tp 4.
    4: [
        ("tp4", "gpt2", dict(tp=4, mb=8)),
        ("tp4-sp", "llama", dict(tp=4, mb=8, sequence_parallel=True)),  # + replicated kv
        ("dp2-tp2-sp", "gpt2", dict(dp=2, tp=2, sequence_parallel=True)),
        ("dp2-tp2", "llama", dict(dp=2, tp=2)),
    ],
}


@pytest.fixture(scope="module")
def tp2(corpus):
    root, data, _ = corpus
    return run_workers(2, _group_worker, str(root), data, LAYOUTS[2], timeout=900)


@pytest.fixture(scope="module")
def tp4(corpus):
    root, data, _ = corpus
    return run_workers(4, _group_worker, str(root), data, LAYOUTS[4], timeout=900)


def _expected_model_comms(cfg: ModelConfig, tp: int, sp: bool, b: int) -> dict:
    """The module docstring's formulas for one micro-batch of b sequences (fp32)."""
    s, h, n_layers = cfg.seq_len, cfg.hidden, cfg.n_layers
    act = b * s * h * 4
    ce = {("tp", "all_reduce"): (2, 12 * b * s)}
    if not sp:
        fwd = {("tp", "all_reduce"): (2 * n_layers + 1 + 2, (2 * n_layers + 1) * act + 12 * b * s)}
        bwd = {("tp", "all_reduce"): (2 * n_layers + 1, (2 * n_layers + 1) * act)}
        return {"fwd": fwd, "bwd": bwd}
    n = 2 * n_layers + 1  # per layer two, plus the embedding (reduce-scatter) / head (gather)
    fwd = {("tp", "all_gather"): (n, n * act), ("tp", "reduce_scatter"): (n, n * act), **ce}
    # backward: the same reversed, and each column group's saved input (two a layer, and
    # the head's) gathered again from the shard its ops kept
    g = 2 * n
    bwd = {("tp", "all_gather"): (g, g * act), ("tp", "reduce_scatter"): (n, n * act)}
    return {"fwd": fwd, "bwd": bwd}


def _sync_bytes(cfg: ModelConfig, tp: int, sp: bool) -> int:
    """TPGradSync: 4 (R + K) bytes (module docstring)."""
    h = cfg.hidden
    replicated = 0
    if sp:  # norms, row-parallel biases and (gpt2) learned positions, whole on every rank
        norm = 2 * h if cfg.arch == "gpt2" else h
        row_bias = 2 * h if cfg.biases else 0
        replicated = cfg.n_layers * (2 * norm + row_bias) + norm
        replicated += cfg.seq_len * h if cfg.arch == "gpt2" else 0
    kv_full = 0
    if cfg.n_kv_heads < tp:  # k and v weights (and biases) held by tp / kv ranks each
        kv_full = cfg.n_layers * 2 * (cfg.kv_dim * h + (cfg.kv_dim if cfg.biases else 0))
    return 4 * (replicated + kv_full)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_runs(result: dict, corpus) -> None:
    """Loss and gradient norm of every step against the single-process run, within the
    float32 bounds of ``numerics`` (8 sequences a step, ``_run_cfg``)."""
    _, _, refs = corpus
    assert result["runs"]
    for (name, arch), out in result["runs"].items():
        ref, got = _metrics(refs[arch]), _metrics(Path(out))
        assert len(got) == len(ref) == STEPS
        cfg = _model_cfg(arch)
        assert_same_run(got, ref, cfg, 8 * cfg.seq_len, f"{name} {arch}")


def _check_counts(result: dict, tp: int) -> None:
    for arch in ("gpt2", "llama"):
        cfg = _model_cfg(arch)
        for sp in (False, True):
            got = result[("count", arch, sp)]
            want = _expected_model_comms(cfg, tp, sp, b=2)
            assert got["fwd"] == want["fwd"], (arch, sp, "forward")
            assert got["bwd"] == want["bwd"], (arch, sp, "backward")
            sync = _sync_bytes(cfg, tp, sp)
            assert got["sync"] == ({("tp", "all_reduce"): (1, sync)} if sync else {}), (arch, sp)


def _check_checkpoint(ref_out: Path, out: Path, arch: str) -> None:
    """The tp run's final checkpoint holds unpadded full tensors (it loads into a tp=1 model)
    and that model computes the single-process run's final loss. (Weights are compared
    through the loss: AdamW turns the rounding noise of near-zero gradients -- the key
    bias's is exactly zero in theory -- into steps that differ per layout.)"""
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for run in (ref_out, out):
        model = build_model(_model_cfg(arch), seed=1)
        path = checkpoint.latest(run / "checkpoints")
        checkpoint.load(path, state=checkpoint.model_state(model), topo=Topology.single())
        with torch.no_grad():
            losses.append(model(ids[:, :-1], ids[:, 1:]).mean().item())
    cfg = _model_cfg(arch)  # the final weights: STEPS steps of the curve's bound apart
    tol = STEPS * loss_tol(cfg, 8 * cfg.seq_len) + loss_tol(cfg, 4 * cfg.seq_len)
    assert abs(losses[1] - losses[0]) <= tol * abs(losses[0]), (arch, losses)


@pytest.mark.parametrize("world", [2, 4])
def test_loss_curves_match_single_process(world, request, corpus):
    """tp 2 and 4, with and without sequence parallelism, and dp 2 x tp 2; both flavours."""
    _check_runs(request.getfixturevalue(f"tp{world}")[0], corpus)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_docstring_formulas(world, request):
    _check_counts(request.getfixturevalue(f"tp{world}")[0], tp=world)


@pytest.mark.parametrize("world", [2, 4])
def test_model_loss_and_gradients_match_single_process(world, request):
    """One forward and backward of the whole model (after TPGradSync), both flavours, with
    and without sequence parallelism, against the single-process model."""
    result = request.getfixturevalue(f"tp{world}")[0]
    for arch in ("gpt2", "llama"):
        cfg = _model_cfg(arch)
        ref = build_model(cfg, seed=0)
        ids = torch.randint(
            0, 256, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0)
        )
        loss = ref(ids[:, :-1], ids[:, 1:]).sum()
        loss.backward()
        tokens = 2 * cfg.seq_len  # float32 bounds of one forward and backward (numerics)
        for sp in (False, True):
            got = result[("count", arch, sp)]
            assert abs(got["loss"] - loss.item()) <= loss_tol(cfg, tokens) * abs(loss.item())
            for name, p in ref.named_parameters():
                if name.endswith("attn.k.bias"):  # zero up to rounding (see _check_layer)
                    continue
                err = _rel(got["grads"][name], p.grad)
                assert err <= grad_norm_tol(cfg, tokens), (arch, sp, name, err)


def test_tp_checkpoint_is_unpadded_and_loads_at_tp1(tp2, corpus):
    root, _, refs = corpus
    for arch in ("gpt2", "llama"):
        _check_checkpoint(refs[arch], root / f"tp2-{arch}", arch)


def test_dropout_streams(tp2):
    d0, d1 = (r["dropout"] for r in tp2)
    assert not torch.equal(d0["inside"], d1["inside"]), "tp regions need per-shard masks"
    torch.testing.assert_close(d0["after"], d1["after"], rtol=0, atol=0)
    # the residual stream is replicated: identical dropout masks on both tp ranks
    torch.testing.assert_close(d0["hidden"], d1["hidden"], rtol=0, atol=0)
    # full recomputation redraws the same masks (per-shard ones included): the same
    # computation, run again inside the backward, so within one backward's float32 bound
    cfg = _model_cfg("gpt2")
    for d in (d0, d1):
        for name, g in d["grads-none"].items():
            assert _rel(d["grads-full"][name], g) <= grad_norm_tol(cfg, 2 * cfg.seq_len), name


# --- no processes ------------------------------------------------------------------------


def test_joined_rows_are_their_concatenation_and_a_view_at_one_sequence():
    """``comm.joined``: rows a collective stacked, (n, B, T / n, C), as their concatenation
    along T -- equal to ``torch.cat`` always, and at one sequence (B = 1) the rows'
    own storage, no copy (sequence parallelism's gathers at micro-batch 1 made a T x C
    copy per call before). Catches a view taken where the rows do not lie in order
    (B > 1: the values would interleave sequences) and a copy where they do."""
    from plait import comm

    for b in (1, 2):
        rows = torch.arange(4 * b * 3 * 5, dtype=torch.float32).view(4, b, 3, 5)
        got = comm.joined(rows, 1)
        assert torch.equal(got, torch.cat(rows.unbind(0), dim=1))
        assert (got.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()) == (b == 1)
    rows = torch.zeros(2, 3, 5)
    assert comm.joined(rows, 0).data_ptr() == rows.data_ptr()


def test_padded_vocabulary_sharding_round_trip():
    full = torch.arange(257 * 3, dtype=torch.float32).view(257, 3)
    spec = vocab_spec(257)
    for tp in (1, 2, 4, 8):
        shards = [tp_shard(full, spec, tp_rank=r, tp=tp) for r in range(tp)]
        assert {s.shape[0] for s in shards} == {-(-257 // tp)}
        assert full_shape(shards[0].shape, spec, tp) == (257, 3)
        cat = torch.cat(shards)
        torch.testing.assert_close(cat[:257], full, rtol=0, atol=0)
        assert not cat[257:].any()  # the padding is zeros


def test_replicated_kv_sharding():
    full = torch.arange(8.0).view(2, 4)  # two kv heads of one row each
    spec = ShardSpec(dim=0, replicas=2)  # tp 4: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    shards = [tp_shard(full, spec, tp_rank=r, tp=4) for r in range(4)]
    assert [s.tolist() for s in shards] == [[[0, 1, 2, 3]]] * 2 + [[[4, 5, 6, 7]]] * 2
    assert full_shape(shards[0].shape, spec, 4) == (2, 4)


def test_tp1_padded_model_equals_unpadded_reference():
    """Padding lives only in the shards: at tp=1 the vocabulary is the configured one."""
    cfg = _model_cfg("llama")
    model = build_model(cfg, seed=0)
    assert model.head.weight.shape == (259, 64)


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        (dict(n_heads=4), 3, "--tp 3 does not divide --heads 4"),
        (dict(hidden=48, n_heads=6, n_kv_heads=3), 2, "--tp 2 and --kv-heads 3"),
        (dict(n_heads=4, ffn_hidden=90), 4, "--tp 4 does not divide --ffn-hidden 90"),
    ],
)
def test_layout_errors_are_one_line(overrides, tp, message):
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=64, vocab_size=256, seq_len=16)
    cfg = cfg.replace(**overrides)
    with pytest.raises(ValueError) as e:
        build_model(cfg, topo=Topology(tp=tp), device="meta")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_shard_rng_is_the_default_stream_at_tp1():
    torch.manual_seed(0)
    with tp_shard_rng(Topology.single()):
        a = torch.rand(4)
    torch.manual_seed(0)
    torch.testing.assert_close(a, torch.rand(4))
