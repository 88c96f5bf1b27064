"""Mixture of experts (plait/model/moe.py) and expert-parallel dispatch
(plait/parallel/expert.py): routing, capacity, the aux losses' gradient, sizes, training,
and every distributed path against one process."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from numerics import assert_same_run

from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model import moe, sizes
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.topology import Axis, Topology
from plait.train.config import RunConfig, TrainConfig

STEPS = 4


def _cfg(arch="llama", **kw):
    base = dict(n_layers=2, hidden=64, n_heads=4, seq_len=32, vocab_size=259, moe_experts=4,
                moe_top_k=2, moe_ffn_hidden=64)  # fmt: skip
    return preset("tiny", arch=arch, **{**base, **kw})


def _moe(model) -> moe.MoE:
    return moe.moe_layers(model)[0]


# --- single process -----------------------------------------------------------------------


def _naive(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the routed MLP as its definition reads."""
    r = layer.route(x)
    ex, out = layer.experts, torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(r.idx.shape[1]):
            if r.keep is not None and not r.keep[t, k]:
                continue
            e = int(r.idx[t, k])
            if ex.arch == "gpt2":
                h = torch.nn.functional.gelu(x[t] @ ex.w_fc[e].T + ex.b_fc[e], approximate="tanh")
                y = h @ ex.w_proj[e].T + ex.b_proj[e]
            else:
                h = torch.nn.functional.silu(x[t] @ ex.w_gate[e].T) * (x[t] @ ex.w_up[e].T)
                y = h @ ex.w_down[e].T
            out[t] += r.weights[t, k] * y
    if layer.shared is not None:
        out = out + layer.shared(x, [x.shape[0]])
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_routed_mlp_matches_its_definition_dropless_and_with_capacity(arch, router):
    """The sorted, looped, index-added layer equals the token-by-token definition, dropless
    and with a capacity factor; catches a permutation or weighting bug, a lost token."""
    for factor in (None, 0.75):
        cfg = _cfg(arch, moe_shared_experts=1, moe_router=router, moe_capacity_factor=factor)
        model = build_model(cfg, seed=3).double()
        layer = _moe(model)
        x = torch.randn(64, cfg.hidden, dtype=torch.float64)
        got = layer(x[None])[0]
        torch.testing.assert_close(got, _naive(layer, x), rtol=1e-12, atol=1e-12)
        r = layer.route(x)
        if factor is None:
            assert r.keep is None
        else:  # no expert over capacity; every expert kept its best-scoring assignments
            cap = moe.capacity(cfg, 64)
            kept = torch.bincount(r.idx[r.keep], minlength=4)
            assert kept.max() <= cap and (~r.keep).any()


def test_capacity_keeps_the_best_and_breaks_ties_by_token():
    """Per expert the ``cap`` highest scores survive, equal scores go to the earlier token:
    deterministic whatever the device or layout (a random or unstable tie-break fails)."""
    idx = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 1]])
    score = torch.tensor([[0.5, 0.1], [0.5, 0.3], [0.9, 0.2], [0.1, 0.3]])
    keep = moe.capacity_keep(idx, score, num_experts=3, cap=2)
    # expert 0: tokens 2 (0.9), then 0 and 1 tie at 0.5 -> token 0; expert 1: 0.3, 0.3 -> tokens 1, 3
    assert keep.tolist() == [[True, False], [False, True], [True, True], [False, True]]


def test_aux_loss_gradient_arrives_scaled_without_the_loss():
    """With the language-model loss multiplied by zero, the router's gradient is exactly
    the aux losses' (coef x Switch + coef x z), and ``aux_loss_scale(s)`` scales it by s:
    catches an aux loss that does not reach the gradient, or reaches it mis-scaled."""
    cfg = _cfg("llama", moe_every=2, moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1)  # block 1
    ids = torch.randint(0, 259, (2, 33), generator=torch.Generator().manual_seed(0))
    grads, seen = [], []
    for scale in (1.0, 0.25):
        model = build_model(cfg, seed=1)
        layer = _moe(model)
        layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
        with moe.aux_loss_scale(scale):
            (0 * model(ids[:, :-1], ids[:, 1:]).sum()).backward()
        grads.append(layer.router.weight.grad.clone())
    want = build_model(cfg, seed=1)
    _moe(want).route(seen[0].reshape(-1, cfg.hidden)).aux.backward()
    torch.testing.assert_close(grads[0], _moe(want).router.weight.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[1], 0.25 * grads[0], rtol=1e-6, atol=0)
    assert grads[0].abs().sum() > 0


def test_experts_with_no_tokens_and_stats():
    """Every token forced to expert 0 (router weights zero but one bias): the layer runs,
    the idle experts get zero (not missing) gradients, the statistics count it (imbalance
    E, min 0) and a recomputed forward is not counted twice."""
    cfg = _cfg("llama", moe_bias_rate=0.01, moe_top_k=1)
    model = build_model(cfg, seed=1, recompute="full")
    layer = _moe(model)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.expert_bias.copy_(torch.tensor([1.0, 0, 0, 0]))
    ids = torch.randint(0, 259, (2, 33), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:]).mean().backward()
    g = layer.experts.w_down.grad
    assert g is not None and g[1:].abs().sum() == 0 and g[0].abs().sum() > 0
    st = moe.moe_stats(model, reset=False)
    assert st["moe_tokens_max"] == 64 and st["moe_tokens_min"] == 0
    assert st["moe_imbalance"] == 4.0 and st["moe_dropped"] == 0.0
    moe.update_expert_bias(model, model.topo)  # overloaded expert 0 down, the others up
    assert layer.expert_bias.tolist() == pytest.approx([0.99, 0.01, 0.01, 0.01])


def test_sizes_count_every_parameter_and_flops_count_the_active():
    """``num_params`` equals the built model's count (both flavours, shared experts, dense
    layers between MoE ones); FLOPs count K of E experts: a wrong formula fails."""
    for arch in ("gpt2", "llama"):
        cfg = _cfg(arch, n_layers=4, moe_every=2, moe_shared_experts=2, moe_ffn_hidden=96)
        built = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
        assert sizes.num_params(cfg) == built
        one_expert = (2 if arch == "gpt2" else 3) * cfg.hidden * 96
        # two MoE blocks, E - K = 2 idle experts each (gpt2: with their two biases)
        extra = 2 * (4 - 2) * (one_expert + (96 + 64 if arch == "gpt2" else 0))
        assert sizes.num_params(cfg) - sizes.active_params(cfg) == extra
        dense = cfg.replace(moe_experts=0)
        active_mlp = (2 + 2) * one_expert + 4 * cfg.hidden
        dense_mlp = (2 if arch == "gpt2" else 3) * cfg.hidden * cfg.ffn_hidden
        diff = sizes.model_flops_per_token(cfg) - sizes.model_flops_per_token(dense)
        assert diff == 6 * 2 * (active_mlp - dense_mlp)


def test_flags_and_one_line_errors(capsys):
    """``plait info`` shows total and active parameters; bad MoE flags are one line."""
    from plait.cli import main

    assert main(["info", "--moe-experts", "8", "--moe-top-k", "2", "--arch", "llama"]) == 0
    out = capsys.readouterr().out
    assert "active per token" in out and "top-2 of 8 experts in 4 of 4 blocks" in out
    assert main(["info"]) == 0
    assert "moe_" not in capsys.readouterr().out  # a dense listing is unchanged
    for flags, msg in (
        (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k must be between 1 and"),
        (["--moe-experts", "4", "--moe-capacity-factor", "0"], "--moe-capacity-factor must"),
        (["--moe-experts", "4", "--moe-every", "9"], "--moe-every must be between 1"),
    ):
        assert main(["info", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1


def test_zero3_under_ep_splits_each_moe_block_into_a_dense_and_an_expert_unit():
    """``ExpertDataParallel`` at ZeRO-3 (one process: dp 1, edp 1): the dense engine's units
    are the embedding + head and every block without its experts, the experts' one unit per
    MoE block (none for a dense block); forward and backward gather a MoE block's dense unit
    before its expert unit (the order every rank keeps: ``expert_engine`` docstring), a
    unit over a group of one holds its parameters in its row (no copy), and the loss and
    every gradient equal the model's without the engine. Fails if a unit holds both sets
    (then one of the two groups would gather the other's parameters), the order flips, a
    parameter is dropped from both, or a group of one gathers copies."""
    import functools

    from plait.parallel.engine import DataParallelConfig
    from plait.parallel.expert_engine import ExpertDataParallel, is_expert
    from plait.train import optim

    cfg = _cfg("llama", **CFGS["llama"])  # block 0 dense, block 1 MoE
    topo = Topology.single()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    ref = build_model(cfg, seed=3, topo=topo, ep=(topo, Axis.DP))
    ref(ids, ids).sum().backward()
    model = build_model(cfg, seed=3, topo=topo, ep=(topo, Axis.DP))
    engine = ExpertDataParallel(model, topo=topo, edp_topo=topo, cfg=DataParallelConfig(zero=3),
                                make_optimizer=functools.partial(optim.build_optimizer,
                                                                 cfg=TrainConfig()))  # fmt: skip
    units = {"dense": engine.dense.units, "experts": engine.experts.units}
    assert [u.name for u in units["dense"].units] == ["embed", "blocks.0", "blocks.1", "head"]
    assert [u.name for u in units["experts"].units] == ["blocks.1"]
    for which, pu in units.items():
        for u in pu.units:
            assert all(is_expert(p) == (which == "experts") for p in u.params), (which, u.name)
    held = {id(p) for pu in units.values() for u in pu.units for p in u.params}
    assert held == {id(p) for p in model.parameters()}
    # a group of one (ep == dp's edp): the parameters live in the row, never copied
    for u in units["experts"].units:
        assert u.resident and u.gathered
        assert all(p.untyped_storage().data_ptr() == u.row.untyped_storage().data_ptr()
                   for p in u.params)  # fmt: skip
    order = []

    def recorded(which, inner):
        def gather(unit):  # (every hook's call: at n == 1 the units are resident)
            order.append((which, unit.name))
            inner(unit)

        return gather

    for which, pu in units.items():
        pu.gather = recorded(which, pu.gather)
    loss = model(ids, ids).sum()
    loss.backward()
    engine.finish()
    blk1 = [("dense", "blocks.1"), ("experts", "blocks.1")]
    forward = [("dense", "embed"), ("dense", "blocks.0"), *blk1, ("dense", "head")]
    backward = [("dense", "head"), *blk1, ("dense", "blocks.0"), ("dense", "embed")]
    assert order == forward + backward, order
    torch.testing.assert_close(loss, ref(ids, ids).sum().detach(), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(engine.grad(p).view(q.shape), q.grad, rtol=0, atol=0, msg=name)
    engine.close()
    # bf16 units: the dense engine finds the linear weights on the whole model (not on
    # its subset, which has no modules); the experts' stacked weights, which only
    # ``F.linear`` reads, are gathered in bf16 too (``Experts.autocast_params``: gathered in
    # fp32, the step's one cast of each was a new tensor held to the step's end)
    model = build_model(cfg, seed=3, topo=topo, ep=(topo, Axis.DP))
    engine = ExpertDataParallel(model, topo=topo, edp_topo=topo,
                                cfg=DataParallelConfig(zero=3, gather_dtype="bf16"),
                                make_optimizer=functools.partial(optim.build_optimizer,
                                                                 cfg=TrainConfig()))  # fmt: skip
    held = {u.name: {b.dtype for b in u.buffers} for u in engine.dense.units.units}
    assert held["blocks.1"] == {torch.bfloat16, torch.float32}, held
    [experts] = engine.experts.units.units
    assert not experts.resident and {b.dtype for b in experts.buffers} == {torch.bfloat16}
    engine.close()


# --- training -----------------------------------------------------------------------------

CFGS = {  # gpt2: every block MoE, a shared expert; llama: dense + MoE, capacity, bias
    "gpt2": dict(vocab_size=257, moe_shared_experts=1, moe_aux_loss_coef=0.1,
                 moe_z_loss_coef=1e-3),
    "llama": dict(n_kv_heads=2, moe_every=2, moe_capacity_factor=1.0, moe_aux_loss_coef=0.1,
                  moe_bias_rate=1e-3),
}  # fmt: skip


def _run_cfg(arch, data, out, *, mb=2, steps=STEPS, save_every=0, resume=False,
             **layout) -> RunConfig:  # fmt: skip
    train = TrainConfig(steps=steps, warmup=2, eval_every=0, eval_batches=1, progress=False,
                        save_every=save_every, resume=resume)  # fmt: skip
    return RunConfig(
        model=_cfg(arch, **CFGS[arch]),
        layout=Layout(micro_batch_size=mb, global_batch_size=8, **layout),
        data=data,
        train=train,
        out=str(out),
    )


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small byte-level corpus and the single-process reference run of each flavour."""
    from plait.train.loop import train

    root = tmp_path_factory.mktemp("moe")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly ships"
    lines = (" ".join(rng.choice(words.split()) for _ in range(12)) for _ in range(800))
    (root / "corpus.txt").write_text("\n".join(lines))
    data = DataConfig(path=str(root / "corpus.txt"), tokenizer="bytes",
                      cache_dir=str(root / "cache"), val_fraction=0.05)  # fmt: skip
    prepare(data)
    refs = {}
    for arch in CFGS:
        out = root / f"ref-{arch}"
        out.mkdir()
        train(_run_cfg(arch, data, out), topo=Topology.single())
        refs[arch] = out
    return root, data, refs


def test_moe_model_trains(corpus, tmp_path):
    """Loss falls over 12 steps for both flavours (aux losses, capacity and bias on)."""
    from plait.train.loop import train

    _, data, _ = corpus
    for arch in CFGS:
        (tmp_path / arch).mkdir()
        train(_run_cfg(arch, data, tmp_path / arch, steps=12), topo=Topology.single())
        losses = [r["loss"] for r in _metrics(tmp_path / arch)]
        assert losses[-1] < losses[0] - 1.0, (arch, losses)


def test_export_of_an_expert_lora_run_writes_the_merged_experts(corpus, tmp_path, capsys):
    """``plait export --merge-lora`` of a LoRA run whose adapters sit on the experts (llama
    flavour, every block MoE: Mixtral names): the exported weights, read back, compute the trained model's
    logits, and differ from the base experts'; ``--adapter`` is one line (PEFT has no
    format for them). Catches an export that drops the expert adapters (base experts
    written), or folds them into the wrong expert's rows."""
    import dataclasses

    from plait.cli import main
    from plait.generate import load_model
    from plait.model import hf
    from plait.model.lora import LoRAConfig

    _, data, _ = corpus
    (tmp_path / "run").mkdir()
    cfg = _run_cfg("llama", data, tmp_path / "run", steps=3)
    cfg = dataclasses.replace(cfg, lora=LoRAConfig(rank=4, targets=("q", "gate", "up", "down")),
                              model=cfg.model.replace(moe_every=1, moe_capacity_factor=None,
                                                      moe_ffn_hidden=cfg.model.ffn_hidden,
                                                      moe_bias_rate=0.0),
                              train=dataclasses.replace(cfg.train, lr=3e-2))  # fmt: skip
    from plait.train.loop import train

    train(cfg, topo=Topology.single())
    cfg.save(tmp_path / "run" / "config.yaml")  # what the launcher writes
    _, _, model = load_model(tmp_path / "run")
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(1))
    assert main(["export", "--run", str(tmp_path / "run"), "--adapter"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--merge-lora" in err and len(err.splitlines()) == 1
    out = tmp_path / "merged"
    assert main(["export", "--run", str(tmp_path / "run"), "--merge-lora", "--out", str(out)]) == 0
    merged_cfg, state = hf.load(out)
    merged = build_model(merged_cfg)
    merged.load_state_dict(state)
    with torch.no_grad():
        ours, theirs = model(ids), merged.eval()(ids)
    assert (ours - theirs).abs().max().item() < 1e-5
    base = model.blocks["1"].mlp.experts.w_up.detach()
    assert (state["blocks.1.mlp.experts.w_up"] - base).abs().max() > 1e-4  # adapters folded


# --- multi-process ------------------------------------------------------------------------


def _sub_topo(rank, world, ranks, pg) -> Topology:
    """A topology whose dp axis is the group ``ranks`` (the ep group, until an ep axis)."""
    index = ranks.index(rank)
    return Topology(dp=len(ranks), rank=rank, groups={Axis.DP: pg} if pg else {},
                    place=(0, index, 0), world=world,
                    group_ranks={Axis.DP: ranks, Axis.PP: [rank], Axis.TP: [rank]})  # fmt: skip


def _tokens(rank, n, c):
    return torch.randn(n, c, generator=torch.Generator().manual_seed(100 + rank),
                       dtype=torch.float64)  # fmt: skip


def _round_trip(topo, E):
    """expert_parallel with experts that scale row r of expert e by (e + 1): each row comes
    back to its place times its global expert + 1, and its gradient likewise -- exactly.
    Cases: balanced, all rows to expert 0, and rank 3 routing nothing."""
    from plait.parallel.expert import expert_parallel

    n = topo.size(Axis.DP)
    me = topo.group_ranks[Axis.DP].index(topo.rank)
    first = me * (E // n)

    def experts(rows, per_expert):
        scale = torch.cat([torch.full((c,), float(first + e + 1), dtype=rows.dtype)
                           for e, c in enumerate(per_expert)] or [rows.new_zeros(0)])  # fmt: skip
        return rows * scale[:, None]

    errors = {}
    for case in ("balanced", "skew", "empty"):
        g = torch.Generator().manual_seed(topo.rank)
        m = 0 if case == "empty" and topo.rank == 3 else 13 + topo.rank
        expert = torch.randint(0, E, (m,), generator=g)
        if case == "skew":
            expert.zero_()
        expert = expert.sort().values
        x = torch.randn(m, 5, generator=g, dtype=torch.float64, requires_grad=True)
        y = expert_parallel(x, torch.bincount(expert, minlength=E), experts, topo=topo,
                            axis=Axis.DP)  # fmt: skip
        w = torch.randn(m, 5, generator=g, dtype=torch.float64)
        (y * w).sum().backward()
        factor = (expert + 1).double()[:, None]
        errors[case] = (torch.equal(y, x.detach() * factor), torch.equal(x.grad, w * factor))
    return errors


def _block(cfg, ep, seed=0):
    return build_model(cfg, seed=seed, layers=[0], pre=False, post=False, ep=ep).double()


def _ep_layers(topo, world):
    """One MoE block at this ep group against the whole block on the group's tokens
    (float64): output, input gradient, the experts' weight gradients this rank holds and
    the rest (the router's, with aux and z losses on, from this rank's tokens)."""
    ranks = topo.group_ranks[Axis.DP]
    me, out = ranks.index(topo.rank), {}
    for arch in ("gpt2", "llama"):
        cfg = _cfg(arch, moe_shared_experts=1, moe_z_loss_coef=1e-2)
        block, ref = _block(cfg, (topo, Axis.DP)), _block(cfg, None)
        xs = {r: _tokens(r, 16, cfg.hidden).view(2, 8, -1) for r in ranks}
        w = torch.randn(2, 8, cfg.hidden, generator=torch.Generator().manual_seed(7),
                        dtype=torch.float64)  # fmt: skip
        x = xs[topo.rank].clone().requires_grad_()
        (block(x) * w).sum().backward()
        refs = {}  # each rank's micro-batch through the whole block
        for r in ranks:
            ref.zero_grad()
            xr = xs[r].clone().requires_grad_()
            y = ref(xr)
            (y * w).sum().backward()
            refs[r] = (y.detach(), xr.grad, {n: p.grad.clone() for n, p in ref.named_parameters()})
        y_ref, dx_ref, own = refs[topo.rank]
        err = {"y": (block(xs[topo.rank]).detach() - y_ref).abs().max(),
               "dx": (x.grad - dx_ref).abs().max()}  # fmt: skip
        local = cfg.moe_experts // len(ranks)
        for n, p in block.named_parameters():
            if ".experts." in n:  # the group's tokens reach this rank's experts
                want = sum(refs[r][2][n] for r in ranks)[me * local : (me + 1) * local]
            else:
                want = own[n]
            err[n] = (p.grad - want).abs().max()
        out[arch] = {k: float(v) for k, v in err.items()}
    return out


def _token_split_aux(rank, world, pg):
    """``token_axes``: a micro-batch whose tokens are split over a group of 2 (as cp will
    split them) has the aux and z values of the whole micro-batch, and the router
    gradients summed over the group are the whole micro-batch's."""
    topo = _sub_topo(rank, world, [rank - rank % 2, rank - rank % 2 + 1], pg)
    cfg = _cfg("llama", moe_aux_loss_coef=1.0, moe_z_loss_coef=0.1)
    layer = _moe(build_model(cfg, seed=2)).double()
    split = moe.MoE(cfg, topo=Topology.single(), token_axes=(Axis.DP,)).double()
    split.load_state_dict(layer.state_dict())
    split.topo = topo
    x = torch.randn(32, cfg.hidden, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    whole = layer.route(x)
    whole.aux.backward()
    part = split.route(x.chunk(2)[rank % 2])
    part.aux.backward()
    return {"aux": (float(part.aux_value), float(whole.aux_value)),
            "z": (float(part.z_value), float(whole.z_value)),
            "router_grad": split.router.weight.grad, "whole_grad": layer.router.weight.grad}  # fmt: skip


def _group_worker(rank, world, root, data, layouts):
    import torch.distributed as dist

    from plait.train.loop import train

    result = {"round_trip": {}, "ep": {}}
    rings = {4: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]]}
    made = {n: [(r, dist.new_group(r)) for r in rs] for n, rs in rings.items()}
    for n, groups in made.items():
        ranks, pg = next((r, pg) for r, pg in groups if rank in r)
        topo = _sub_topo(rank, world, ranks, pg)
        result["round_trip"][n] = _round_trip(topo, E=8)
        topo.stats.reset()
        result["ep"][n] = _ep_layers(topo, world)
        result[("calls", n)] = dict(topo.stats.calls)
    pair = next(pg for r, pg in made[2] if rank in r)
    result["token_split"] = _token_split_aux(rank, world, pair)
    result["runs"] = {}
    for name, arch, kw in layouts:
        topo = Topology.build(pp=kw.get("pp", 1), dp=kw.get("dp", 1), tp=kw.get("tp", 1))
        out = Path(root) / f"{name}-{arch}"
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
        dist.barrier()
        train(_run_cfg(arch, data, out, **kw, save_every=2 if name in SAVES else 0), topo=topo)
        result["runs"][(name, arch)] = str(out)
    result["resumed"] = {}
    for name, source, kw in RESUMED:  # step 2 of a saved run, resumed at another ep / dp
        saved = Path(root) / f"{source}-llama"
        topo = Topology.build(pp=1, dp=kw["dp"], tp=1)
        out = Path(root) / name
        if rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            (out / "checkpoints").mkdir(parents=True)
            shutil.copytree(saved / "checkpoints" / "step-00000002",
                            out / "checkpoints" / "step-00000002")  # fmt: skip
            shutil.copy(saved / "metrics.jsonl", out / "metrics.jsonl")
        dist.barrier()
        train(_run_cfg("llama", data, out, resume=True, **kw), topo=topo)
        result["resumed"][name] = str(out)
    return result


LAYOUTS = [  # dp 4: one micro-batch per rank (the reference: 4 on one); tp 2 with and without sp
    ("dp4", "llama", dict(dp=4)),
    ("dp2-tp2", "gpt2", dict(dp=2, tp=2)),
    ("dp2-tp2-sp", "llama", dict(dp=2, tp=2, sequence_parallel=True)),
    # --ep: gpt2 dropless (a shared expert), llama with capacity and the expert bias; the
    # llama pp 2 run's first stage holds only the dense block (moe_every 2)
    ("ep2-dp2-tp2-sp", "llama", dict(dp=2, tp=2, ep=2, sequence_parallel=True)),
    ("ep2-dp4", "gpt2", dict(dp=4, ep=2)),  # edp groups of 2: experts reduced over them
    ("ep2-dp2-tp2", "gpt2", dict(dp=2, tp=2, ep=2)),
    ("ep4-dp4-zero2", "gpt2", dict(dp=4, ep=4, zero=2)),
    ("ep2-dp4-zero1", "llama", dict(dp=4, ep=2, zero=1)),
    ("ep2-dp2-pp2", "llama", dict(dp=2, pp=2, ep=2)),
    # ZeRO-3: dense units over dp, expert units over edp -- of one rank at ep 4 (whole
    # rows), of two at ep 2 (llama: a dense block with no expert unit); with tp 2, the
    # experts' tp-partial bias completed after the backward; with pp 2, a first stage
    # that builds no expert engine
    ("ep4-dp4-zero3", "llama", dict(dp=4, ep=4, zero=3)),
    ("ep2-dp4-zero3", "gpt2", dict(dp=4, ep=2, zero=3)),
    ("ep2-dp2-tp2-zero3", "gpt2", dict(dp=2, tp=2, ep=2, zero=3)),
    ("ep2-dp2-pp2-zero3", "llama", dict(dp=2, pp=2, ep=2, zero=3)),  # stage 0: no expert units
]
SAVED = "ep2-dp2-tp2-sp"  # saves at step 2: resumed at ep 1 and ep 4 (dp 4, tp 1)
SAVES = {SAVED, "ep4-dp4-zero3"}  # (llama runs)
RESUMED = [
    ("resumed-ep1-dp4", SAVED, dict(dp=4)),
    ("resumed-ep4-dp4", SAVED, dict(dp=4, ep=4, zero=1)),
    # ZeRO-3 shards (experts' over edp of one, dense over dp 4) into ZeRO-1 at ep 2
    ("resumed-ep2-dp4-zero1-from-zero3", "ep4-dp4-zero3", dict(dp=4, ep=2, zero=1)),
]


@pytest.fixture(scope="module")
def group(corpus):
    root, data, _ = corpus
    return run_workers(4, _group_worker, str(root), data, LAYOUTS, timeout=900)


def test_dispatch_round_trip_is_exact_skewed_and_empty(group):
    """Every row returns to its place from its expert, and its gradient too, bit for bit,
    at ep 2 and 4: balanced, all to one expert (ranks receiving nothing), and a rank
    routing nothing. A mis-permuted or lost row fails the equality."""
    for rank, res in enumerate(group):
        for n, cases in res["round_trip"].items():
            for case, (y_ok, grad_ok) in cases.items():
                assert y_ok and grad_ok, (rank, n, case)


def test_expert_parallel_block_equals_one_process(group):
    """The MoE block with its experts over ep 2 and 4 computes the single-process block's
    output, input gradient and every parameter gradient (float64, both flavours): a
    dispatch that loses a token, or an expert shard initialised or indexed wrongly, fails."""
    for rank, res in enumerate(group):
        for n, archs in res["ep"].items():
            for arch, errs in archs.items():
                assert max(errs.values()) < 1e-12, (rank, n, arch, errs)


def test_dispatch_collectives_match_the_docstring(group):
    """Per MoE layer forward + backward: 1 all_to_all of counts and 4 of rows (module
    docstring); 2 flavours x 2 passes of the checked block (one training, one checking)."""
    for res in group:
        for n in (2, 4):
            calls = res[("calls", n)]
            # per flavour: a forward+backward (1 + 2 + 2) and a no-grad forward (1 + 2)
            assert calls == {("dp", "all_to_all"): 2 * (5 + 3)}, (n, calls)


def test_aux_loss_of_a_token_split_micro_batch_is_the_whole_ones(group):
    """Over a token group of 2: aux and z values equal the whole micro-batch's, and the
    router gradient summed over the group equals the whole one's (fails if counts or
    probability sums are not reduced, or the share is scaled wrongly)."""
    for pair in (group[0:2], group[2:4]):
        for res in pair:
            for key in ("aux", "z"):
                got, want = res["token_split"][key]
                assert abs(got - want) <= 1e-12 * abs(want), key
        total = pair[0]["token_split"]["router_grad"] + pair[1]["token_split"]["router_grad"]
        torch.testing.assert_close(total, pair[0]["token_split"]["whole_grad"], rtol=1e-10,
                                   atol=1e-14)  # fmt: skip


def test_loss_curves_match_single_process(group, corpus):
    """dp 4 (one micro-batch per rank: the aux losses' mean over micro-batches, the expert
    bias from loads summed over dp), dp 2 x tp 2 and with sequence parallelism (capacity
    drops the same tokens), and the ep layouts at ZeRO 0-3, against one process within the
    float32 bounds. At ZeRO-3 an expert unit sharded or gathered over dp instead of its
    edp group mixes other ranks' experts into it, and the curve leaves."""
    _, _, refs = corpus
    for (name, arch), out in group[0]["runs"].items():
        cfg = _cfg(arch, **CFGS[arch])
        assert_same_run(_metrics(out), _metrics(refs[arch]), cfg, 8 * cfg.seq_len, name)


MOE_KEYS = ("moe_tokens_min", "moe_tokens_max", "moe_tokens_mean", "moe_imbalance",
            "moe_dropped", "moe_aux_loss", "moe_z_loss")  # fmt: skip


def test_every_layout_reports_the_same_routing_statistics(group, corpus):
    """Each metrics record's tokens per expert, imbalance, dropped fraction and aux / z
    losses equal the single-process run's at every layout (dp, tp, pp, ep, ZeRO): the
    statistics are summed over the ranks holding other tokens and other layers, once per
    tp group. Counting a tp group's copies twice, one rank's tokens only, or one pp
    stage's layers only fails it."""
    _, _, refs = corpus
    for (name, arch), out in group[0]["runs"].items():
        for got, ref in zip(_metrics(out), _metrics(refs[arch]), strict=True):
            for key in MOE_KEYS:
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), (name, key)
    assert _metrics(refs["llama"])[-1]["moe_dropped"] > 0  # capacity drops some: tested


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load, no_dist
def test_a_checkpoint_saved_at_ep_2_resumes_at_ep_1_and_4_on_the_curve(group, corpus):
    """Step 2 of the ep 2 x dp 2 x tp 2 run resumed at ep 1 and ep 4 (dp 4, ZeRO 1), and step 2
    of the ep 4 ZeRO-3 run resumed at ep 2 ZeRO 1: steps 3-4 stay on the single-process
    curve (an expert shard saved or loaded at the wrong rows, a ZeRO-3 expert shard placed
    as if sharded over dp instead of its edp group, or the expert bias restarted at zero,
    leaves it), and the checkpoint holds the expert bias, moved off zero, at its global
    shape."""
    import torch.distributed.checkpoint as dcp

    root, _, refs = corpus
    cfg = _cfg("llama", **CFGS["llama"])
    for name, out in group[0]["resumed"].items():
        got = _metrics(out)
        assert [r["step"] for r in got] == [1, 2, 3, 4], name
        assert_same_run(got, _metrics(refs["llama"]), cfg, 8 * cfg.seq_len, name)
    path = Path(root) / f"{SAVED}-llama" / "checkpoints" / "step-00000002"
    key = "buffers/blocks.1.mlp.expert_bias"
    assert key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    bias = {key: torch.zeros(cfg.moe_experts)}
    dcp.load(bias, checkpoint_id=str(path), no_dist=True)
    assert bias[key].abs().sum() > 0


def test_held_rows_place_an_ep_ranks_experts_in_the_global_tensor():
    """An ep rank's (E/ep, ...) experts, whole or a ZeRO range, are boxes of the (E, ...)
    tensor at its rows; a tp split still shifts its own dim. Fails if ``rows`` is ignored
    (every ep rank would write rows 0..E/ep)."""
    from plait.parallel.held import Held
    from plait.parallel.tensor import ShardSpec

    t = torch.arange(2 * 3 * 4.0).view(2, 3, 4)  # ep rank 1 of 2 of E = 4, tp 2 on dim 1
    held = Held.whole(t, ShardSpec(dim=1))
    held = type(held)(flat=held.flat, lo=0, shape=held.shape, spec=held.spec, rows=(2, 4))
    assert held.global_shape(tp=2) == (4, 6, 4)
    [(offsets, view)] = held.boxes(tp_rank=1, tp=2)
    assert offsets == (2, 3, 0) and torch.equal(view, t)
    part = Held.zero(t.reshape(-1)[12:], shape=t.shape, rank=1, n=2, spec=ShardSpec(dim=1))
    part = type(part)(flat=part.flat, lo=part.lo, shape=part.shape, spec=part.spec, rows=(2, 4))
    assert [o for o, _ in part.boxes(tp_rank=0, tp=2)] == [(3, 0, 0)]


def test_ep_refusals_are_one_line():
    """--ep with a dp algorithm, --fault-tolerance with MoE, and --cp with a capacity factor:
    one ValueError line naming the flags (a missing check would build and fail later).
    --ep with LoRA or ZeRO-3, and --cp with dropless MoE build."""
    from plait.dp_algos.config import DPAlgoConfig
    from plait.model.lora import LoRAConfig
    from plait.resilience.config import ResilienceConfig

    data = DataConfig(path="x.txt")
    capacity = _cfg(moe_capacity_factor=1.0)
    for extra, layout, msg in (
        ({"dp_algo": DPAlgoConfig(algo="diloco", sync_every=4)}, dict(dp=2, ep=2), "with --ep"),
        ({"resilience": ResilienceConfig(fault_tolerance=1)}, dict(dp=2), "--fault-tolerance"),
        ({"model": capacity}, dict(cp=2), "--moe-capacity-factor with --cp"),
    ):
        with pytest.raises(ValueError, match=msg) as err:
            lay = Layout(global_batch_size=8, **layout)
            lay.check_model(extra.get("model", _cfg()))
            RunConfig(**{"model": _cfg(), **extra}, layout=lay, data=data,
                      train=TrainConfig(), out="o")  # fmt: skip
        assert "\n" not in str(err.value)
    for extra, layout in (({"lora": LoRAConfig(rank=4, targets=("up",))}, dict(dp=2, ep=2)),
                          ({}, dict(cp=2, dp=2, ep=2)), ({}, dict(dp=2, ep=2, zero=3))):  # fmt: skip
        lay = Layout(global_batch_size=8, **layout)
        lay.check_model(_cfg())
        RunConfig(model=_cfg(), layout=lay, data=data, train=TrainConfig(), out="o", **extra)


def _fake_ep(rank: int, n: int) -> tuple[Topology, Axis]:
    """An ep group of ``n`` without a process group: enough to build a rank's share."""
    topo = Topology(dp=n, rank=rank, place=(0, rank, 0), world=n,
                    group_ranks={Axis.DP: list(range(n)), Axis.PP: [rank], Axis.TP: [rank]})  # fmt: skip
    return topo, Axis.DP


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_expert_adapters_merge_into_the_experts_and_start_alike_at_any_ep(arch):
    """LoRA on the experts (``ExpertLoRA``): with B made non-zero, the merged weights
    (W[e] + scale B[e] A[e], ``merged_state``) in a plain model give the adapted model's
    logits and loss (float64), for routed and shared experts; only adapters train (the
    router is frozen); an ep rank's adapters are its rows of the one-process ones. Catches
    a merge that folds B A of the wrong expert, transposed, or unscaled; adapters seeded
    per shard (ep layouts would start apart); a frozen or missed expert weight."""
    from plait.model.lora import LoRAConfig, apply_lora, merged_state, num_adapter_params

    cfg = _cfg(arch, moe_shared_experts=1)
    lcfg = LoRAConfig(
        rank=4, alpha=8.0, targets=("q", "up", "down", "gate")[: 4 if arch == "llama" else 3]
    )
    model = build_model(cfg, seed=3).double()
    apply_lora(model, lcfg, arch=arch, seed=3)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = ("w_fc", "w_proj") if arch == "gpt2" else ("w_gate", "w_up", "w_down")
    for i in range(cfg.n_layers):
        for part in ("experts", "shared"):
            for w in weights:
                assert {f"blocks.{i}.mlp.{part}.lora.{w}.{f}" for f in "AB"} <= trained
    assert all(".lora." in n for n in trained) and "blocks.0.mlp.router.weight" not in trained
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert num_adapter_params(cfg, lcfg) == count  # what plait info and MFU count
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if n.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    merged = build_model(cfg, seed=3).double()
    merged.load_state_dict(merged_state(model.state_dict(), lcfg))
    with torch.no_grad():
        want = model(ids[:, :-1], ids[:, 1:])
        got = merged(ids[:, :-1], ids[:, 1:])
        base = build_model(cfg, seed=3).double()(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (base - want).abs().max() > 1e-2  # the adapters do change the model
    full = build_model(cfg, seed=3)
    apply_lora(full, lcfg, arch=arch, seed=3)
    full_state = full.state_dict()
    for j in range(2):  # ep 2: rank j holds experts [2 j, 2 j + 2) and their adapters
        shard = build_model(cfg, seed=3, ep=_fake_ep(j, 2))
        apply_lora(shard, lcfg, arch=arch, seed=3)
        for n, t in shard.state_dict().items():
            if ".mlp.experts.lora." in n:
                assert torch.equal(t, full_state[n][2 * j : 2 * j + 2]), n
                assert getattr(dict(shard.named_parameters())[n], "expert_shard", None) == (
                    4,
                    2 * j,
                )
