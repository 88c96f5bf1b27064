"""Mixtures of experts in the performance model and planner (plait/sim/expert.py): dispatch
bytes against parallel/expert.py's formula, the imbalance's load on the busiest rank,
memory that falls with ep as the formula says, the edp gradient group, the planner's ep
axis (its bounds stay bounds, it picks ep > 1 when the experts do not fit) and the CLI.
All pure: no processes (tests/test_moe.py counts the real dispatch under gloo)."""

import dataclasses
import random

import pytest

from plait.cli import main
from plait.layout import Layout
from plait.model import sizes
from plait.model.config import ModelConfig, preset
from plait.sim import costs
from plait.sim import expert as ep_sim
from plait.sim.hardware import get_hardware
from plait.sim.memory import stage_params
from plait.sim.runtime import get_runtime
from plait.sim.search import PlanRequest, Space, _Bounds, candidates, make_layout, search
from plait.sim.simulate import simulate

H100 = get_hardware("h100-sxm")
E, K = 8, 2


def _moe(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layers=4, hidden=64, n_heads=4, ffn_hidden=128,
                vocab_size=256, seq_len=64, moe_experts=E, moe_top_k=K)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def _layout(**kw) -> Layout:
    base = dict(dp=8, micro_batch_size=2, global_batch_size=16, dtype="bf16")
    return Layout(**{**base, **kw})


def test_bytes_per_layer_are_the_dispatch_docstring_formula():
    """parallel/expert.py: forward 8E (counts) + (M + R) h e, backward (M + R) h e counted,
    (n-1)/n of the rows sent; balanced R = M = b s K. Forgetting the counts, the return
    trip, the backward or the (n-1)/n is off by a term or a factor."""
    cfg = _moe()
    b, s, h, e = 2, 64, 64, 2
    M = b * s * K
    for n in (2, 4, 8):
        nb = ep_sim.layer_bytes(cfg, _layout(ep=n))
        assert nb.fwd_counted == 8 * E + 2 * M * h * e
        assert nb.bwd_counted == 2 * M * h * e
        assert nb.fwd_sent == pytest.approx((n - 1) / n * (8 * E + 2 * M * h * e))
        assert nb.bwd_sent == pytest.approx((n - 1) / n * 2 * M * h * e)
        assert nb.counted == 8 * E + 4 * M * h * e  # the docstring's per-layer total
    assert ep_sim.layer_bytes(cfg, _layout(ep=1)).counted == 0  # nothing at n = 1
    assert ep_sim.layer_comm(cfg, _layout(ep=1), H100, 1.0) == (0.0, 0.0)


def test_imbalance_loads_the_busiest_rank_as_documented():
    """The hottest expert routed g A / E of a rank's A assignments, every other (E - g) /
    (E - 1) A / E; the busiest ep rank holds the hottest and E/n - 1 others, from every rank
    of its group: R = M at n = 1, g A at n = E, and the group's ranks receive n A rows in all
    (the rows routed). A capacity factor keeps at most C A / E of each expert's and drops
    the rest -- not rerouted: M falls by the hottest expert's excess, and below 1 every
    expert is cut. A model that charges the mean rank, the hot expert times every expert,
    or sends dropped rows, fails."""
    cfg = _moe()
    g, A = 1.6, 2 * 64 * K
    assert ep_sim.rows(cfg, _layout(ep=1), g) == (A, A)
    assert ep_sim.rows(cfg, _layout(ep=8), g) == (A, pytest.approx(g * A))
    others = (E - g) / (E - 1) * A / E  # every other expert's rows
    for n in (2, 4):
        M, R = ep_sim.rows(cfg, _layout(ep=n), g)
        assert M == pytest.approx(A)
        assert R + (n - 1) * n * (E // n) * others == pytest.approx(n * A)
    M, R = ep_sim.rows(_moe(moe_capacity_factor=1.25), _layout(ep=8), g)
    assert (M, R) == (pytest.approx(A - (g - 1.25) * A / E), pytest.approx(1.25 * A))
    M, R = ep_sim.rows(_moe(moe_capacity_factor=0.5), _layout(ep=4), 1.0)
    assert (M, R) == (pytest.approx(0.5 * A), pytest.approx(0.5 * A))
    with pytest.raises(ValueError, match="--moe-imbalance 5"):
        ep_sim.check_imbalance(cfg, 5.0)  # beyond E / K: more than every token


def test_parameters_split_into_dense_state_and_routed_experts_exactly():
    """At tp = ep = 1 the dense part of every block plus the routed experts of the MoE
    blocks, the embedding and the head are sizes.num_params (both flavours, shared experts,
    interleaved MoE blocks): a MoE block priced as a dense one, or experts counted twice,
    miss by millions here."""
    for arch, kw in (("llama", {}), ("gpt2", dict(moe_shared_experts=1, moe_every=2))):
        cfg = _moe(arch=arch, **kw)
        lay = _layout()
        dense = stage_params(cfg, lay, cfg.n_layers, True, True, moe_layers=cfg.n_moe_layers)
        routed = cfg.n_moe_layers * ep_sim.expert_params(cfg, lay)
        assert dense + routed == sizes.num_params(cfg), arch


def test_memory_falls_with_ep_as_the_formula_says():
    """Weights (ZeRO 0) hold the dense state plus E/ep experts per MoE block: each doubling
    of ep frees half of what is left of the experts, exactly n_moe (E/ep - E/2ep) per-expert
    params x 4 bytes. Under ZeRO-1 the optimizer state is the same at every ep (experts
    / ep / edp = experts / dp); a model that shards experts over dp again would shrink it."""
    cfg = _moe(n_layers=4, moe_every=2)
    per_expert = sizes.expert_matmul_params(cfg)
    w = {n: simulate(cfg, _layout(ep=n), H100).memory.weights for n in (1, 2, 4, 8)}
    for n in (1, 2, 4):
        freed = cfg.n_moe_layers * (E / n - E / (2 * n)) * per_expert * 4
        assert w[n] - w[2 * n] == pytest.approx(freed)
    opt = {n: simulate(cfg, _layout(ep=n, zero=1), H100).memory.optimizer for n in (1, 2, 8)}
    assert opt[1] == pytest.approx(opt[2]) and opt[1] == pytest.approx(opt[8])
    assert opt[1] == pytest.approx(sizes.num_params(cfg) * 8 / 8, rel=1e-12)


def test_zero3_buffers_gather_experts_unless_their_edp_group_is_one_rank():
    """ZeRO-3's working buffers (``memory.zero3_buffer_bytes``): a MoE block's two gathered
    copies (current, prefetched) hold its E/ep experts at ep < dp; at ep == dp in fp32
    plait keeps them in place (an edp group of one: ``zero_units.Unit.resident``) and the
    buffers lose exactly those two copies; under bf16 (a cast copy) and in a runtime
    without ``zero3_in_place_alone`` they are still counted. Fails if the experts' group
    is taken for dp or the resident units are ignored."""
    from plait.sim.memory import zero3_buffer_bytes

    # a shared expert as wide as the dense MLP: the MoE block is the larger one
    cfg, rt = _moe(moe_shared_experts=1, moe_ffn_hidden=128), get_runtime("plait")
    assert ep_sim.dense_part_extra(cfg, _layout()) > 0
    alone, shared = _layout(ep=8, zero=3, dtype="fp32"), _layout(ep=4, zero=3, dtype="fp32")
    routed = {lay.ep: ep_sim.expert_params(cfg, lay) for lay in (alone, shared)}
    kept = zero3_buffer_bytes(cfg, alone, dataclasses.replace(rt, zero3_in_place_alone=False))
    assert kept - zero3_buffer_bytes(cfg, alone, rt) == pytest.approx(2 * routed[8] * 4)
    # at ep 4 (edp 2) the gathered copies hold twice as many experts as at ep 8 (E/4)
    assert zero3_buffer_bytes(cfg, shared, rt) - kept == pytest.approx(
        2 * (routed[4] - routed[8]) * 4 + (routed[4] - routed[8]) * 4
    )
    bf16 = dataclasses.replace(alone, dtype="bf16")
    assert zero3_buffer_bytes(cfg, bf16, rt) == zero3_buffer_bytes(
        cfg, bf16, dataclasses.replace(rt, zero3_in_place_alone=False)
    )


def test_expert_gradients_reduce_over_edp_ranks_ep_apart():
    """Routed experts' gradient group is dp/ep ranks, ep x tp apart (the ep ranks are
    consecutive dp ranks); dp = ep leaves nothing to reduce; 8 per node, dp 16 ep 2 tp 1:
    edp 8 ranks 2 apart span both nodes."""
    lay = _layout(dp=16, ep=2, global_batch_size=32)
    assert costs.grad_ranks(lay, experts=True) == 8 and costs.grad_stride(lay, True) == 2
    assert costs.grad_ranks(lay) == 16 and costs.grad_stride(lay) == 1
    rt = get_runtime("plait")
    assert costs.dp_comm_time(1e9, _layout(ep=8), H100, rt, experts=True)["grad"] == 0.0
    assert costs.dp_comm_time(1e9, lay, H100, rt, experts=True)["grad"] > 0.0


def test_ep_dispatch_is_exposed_and_leaves_the_node_past_it():
    """ep 8 stays on NVLink (8 per node), ep 16 crosses the network (tp 1): the same bytes
    take longer there. The dispatch shows as ep_comm and in the step; a dense model has no
    ep_comm at all."""
    cfg = _moe(moe_experts=16, hidden=1024, n_heads=8, ffn_hidden=2048, seq_len=1024)
    lay = dict(dp=16, micro_batch_size=2, global_batch_size=32, dtype="bf16")
    t8 = ep_sim.layer_comm(cfg, Layout(ep=8, **lay), H100, 1.0)
    t16 = ep_sim.layer_comm(cfg, Layout(ep=16, **lay), H100, 1.0)
    assert ep_sim.link(H100, Layout(ep=8, **lay)) is H100.intra_node
    assert ep_sim.link(H100, Layout(ep=16, **lay)) is not H100.intra_node
    assert t16[1] > t8[1] > 0
    res = simulate(cfg, Layout(ep=16, **lay), H100)
    assert res.breakdown["ep_comm"] > 0
    dense = simulate(dataclasses.replace(cfg, moe_experts=0), Layout(**lay), H100)
    assert "ep_comm" not in dense.breakdown


def test_imbalance_slows_the_step_and_fills_memory():
    """A skewed router (g = 2) makes the busiest rank's experts run and hold more rows:
    step time and activations rise above the balanced run's; the model FLOPs (active
    parameters) do not change, so MFU falls."""
    cfg = _moe(hidden=512, n_heads=8, ffn_hidden=1024, seq_len=512)
    lay = _layout(ep=8)
    even = simulate(cfg, lay, H100)
    skew = simulate(cfg, lay, H100, moe_imbalance=2.0)
    assert skew.iter_time_s > even.iter_time_s and skew.mfu < even.mfu
    assert skew.memory.activations > even.memory.activations


def test_moe_compute_counts_the_active_experts_not_all():
    """A MoE block costs about top-k experts' GEMMs, not all E: with E = 32 experts at top-1
    of a block's own width the step is far below 32 dense MLPs' and near one's."""
    base = dict(arch="llama", n_layers=4, hidden=1024, n_heads=8, ffn_hidden=4096,
                vocab_size=1024, seq_len=1024)  # fmt: skip
    lay = Layout(dp=8, micro_batch_size=4, global_batch_size=32, dtype="bf16", ep=8)
    moe = simulate(ModelConfig(**base, moe_experts=32, moe_top_k=1), lay, H100).breakdown
    dense = simulate(ModelConfig(**base), lay.replace(ep=1), H100).breakdown
    assert moe["compute"] < 2 * dense["compute"]


def _plan_request(cfg, memory_gib, **space) -> PlanRequest:
    hw = H100.replace(memory_bytes=memory_gib * 2**30)
    return PlanRequest(model=cfg, hardware=hw, n_devices=8, global_batch_size=16, top_k=3,
                       space=Space(**space))  # fmt: skip


def test_planner_picks_ep_when_the_experts_do_not_fit():
    """32 experts of Mixtral's width in 4 blocks (~23 B parameters) on 8 devices of 80 GiB,
    tp = pp = 1, ZeRO 0-2: every ep = 1 layout holds all experts' weights and gradients on
    each device (~170 GiB) and is rejected, so every plan shown has ep > 1; pinned to ep 1
    nothing fits."""
    cfg = dataclasses.replace(preset("llama2-7b"), n_layers=4, moe_experts=32, moe_top_k=2,
                              moe_ffn_hidden=14336)  # fmt: skip
    plan = search(_plan_request(cfg, 80, tp=(1,), pp=(1,), zero=(0, 1, 2)))
    assert plan.entries and all(e.candidate.ep > 1 and e.layout.ep > 1 for e in plan.entries)
    assert all(e.result.fits for e in plan.entries)
    with pytest.raises(ValueError, match="no layout fits"):
        search(_plan_request(cfg, 80, tp=(1,), pp=(1,), zero=(0, 1, 2), ep=(1,)))


def test_planner_bounds_stay_bounds_with_ep():
    """The planner's time and memory bounds for MoE layouts (ep, interleaved MoE blocks,
    ZeRO 0-3, pp) never exceed the closed-form or replayed simulation: a bound that
    forgets the experts' state or dispatch makes the search skip the optimum."""
    rng = random.Random(5)
    cfg = _moe(n_layers=6, moe_every=2, hidden=256, n_heads=4, ffn_hidden=512, seq_len=256)
    req = _plan_request(cfg, 80)
    bounds = _Bounds(req)
    cands = list(candidates(req))
    assert {c.ep for c in cands} == {1, 2, 4, 8}
    for c in rng.sample(cands, 40):
        lay = make_layout(c, req)
        closed = simulate(cfg, lay, req.hardware, exact=False)
        replay = simulate(cfg, lay, req.hardware, exact=True)
        assert bounds.time(c) <= closed.iter_time_s * (1 + 1e-12), c
        assert bounds.memory(c) <= min(closed.peak_mem_bytes, replay.peak_mem_bytes) * (
            1 + 1e-12
        ), c


def test_dense_models_search_no_ep():
    """A dense model's space is as before: ep 1 only."""
    cfg = dataclasses.replace(_moe(), moe_experts=0)
    assert {c.ep for c in candidates(_plan_request(cfg, 80))} == {1}


def test_simulate_cli_prints_ep_traffic_and_the_total_active_split(capsys):
    """``plait simulate --moe-experts 8 --moe-top-k 2 --ep 4``: the experts line (total and
    active parameters, experts per device) and the ep traffic line with the docstring's
    bytes; one-line errors for a bad --moe-imbalance."""
    args = ["simulate", "--model", "llama-7b", "--moe-experts", "8", "--moe-top-k", "2",
            "--gpus", "8", "--ep", "4", "--global-batch-size", "8", "--gpu", "h100-sxm"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "active per token" in out and "top-2 of 8" in out
    mib = (2 * 2048 * 2 * 4096 * 2) * 3 / 4 / 2**20  # (M + R) h e, M = R = b s K; 3/4 sent
    assert f"ep traffic all-to-all over 4 ranks inside a node: {mib:,.1f} MiB" in out
    assert "ep comm" in out
    assert main(args + ["--moe-imbalance", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--moe-imbalance 0.5" in err[0]
    assert main(["simulate", "--model", "tiny", "--moe-imbalance", "1.2"]) == 2
    assert "needs a mixture of experts" in capsys.readouterr().err


def test_info_shows_memory_per_device_at_ep(capsys):
    """``plait info --ep``: the model state per rank falls with ep (experts split), and the
    experts line says how many a block keeps per rank."""
    states = {}
    for ep in (1, 4):
        assert main(["info", "--model", "llama-7b", "--moe-experts", "8", "--dp", "8",
                     "--ep", str(ep)]) == 0  # fmt: skip
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("model state per rank"))
        states[ep] = float(line.split()[4])
        assert f"{8 // ep} of 8 experts per MoE block" in out
    assert states[4] < states[1] / 2
