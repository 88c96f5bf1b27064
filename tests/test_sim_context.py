"""Context parallelism in the performance model (plait/sim/context.py): bytes per layer
against parallel/context.py's formulas and against what the real exchanges count under
gloo, memory and compute that fall with cp, the dp x cp gradient group, and the CLI."""

import pytest
import torch
from distributed import run_workers

from plait.layout import Layout
from plait.model.config import ModelConfig
from plait.sim import context as cp_sim
from plait.sim import costs
from plait.sim.hardware import get_hardware
from plait.sim.runtime import get_runtime
from plait.sim.simulate import simulate

B, H, K, D, S = 2, 8, 4, 8, 64  # GQA: two query heads per key/value head


def _model(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layers=4, hidden=H * D, n_heads=H, n_kv_heads=K,
                ffn_hidden=4 * H * D, vocab_size=256, seq_len=S)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def _layout(cp, mode, **kw) -> Layout:
    return Layout(cp=cp, cp_mode=mode, micro_batch_size=B, global_batch_size=B, dtype="fp32", **kw)


def test_bytes_per_layer_are_context_docstring_formulas():
    """Each mode's sent bytes per layer and micro-batch, written out from
    parallel/context.py's Communication paragraph (b s k e terms): a mode that forgets the
    fp32 dK/dV, the (N-1)/N of a collective, or the head split of a2a is off by a factor."""
    cfg = _model(seq_len=1024)
    b, s, e, k, h = B, 1024, 2, K * D, H * D
    for N in (2, 4, 8):
        ring = cp_sim.layer_bytes(cfg, _layout(N, "ring").replace(dtype="bf16"))
        assert ring.fwd_sent == (N - 1) * 2 * b * s * k * e / N
        assert ring.bwd_sent == (N - 1) * 2 * b * s * k * e / N + 2 * b * s * k * 4
        ag = cp_sim.layer_bytes(cfg, _layout(N, "allgather").replace(dtype="bf16"))
        assert ag.fwd_counted == 2 * b * s * k * e
        assert ag.bwd_counted == 2 * b * s * k * e + 2 * b * s * k * 4
        assert ag.sent == pytest.approx((N - 1) / N * ag.counted)
        a2a = cp_sim.layer_bytes(cfg, _layout(N, "a2a").replace(dtype="bf16"))
        assert a2a.fwd_counted == pytest.approx(b * s * (h + 2 * k) * e / N + b * s * h * e / N
                                                + b * s * H * 4 / N)  # fmt: skip
        assert a2a.sent == pytest.approx((N - 1) / N * a2a.counted)
    assert cp_sim.layer_bytes(cfg, _layout(1, "ring")).counted == 0


def _count_exchanges(rank, world):
    """One attention layer per mode on this rank's shard, loss on the output only (as the
    model uses it); the bytes comm.py counted and sent per mode."""
    import torch.distributed as dist

    from plait.parallel.context import ContextLayout, context_attention, shard
    from plait.topology import Axis, Topology

    pg = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (H, K, K))
    out = {}
    for mode in ("ring", "allgather", "a2a"):
        topo = Topology(dp=world, rank=rank, groups={Axis.DP: pg}, place=(0, rank, 0),
                        group_ranks={Axis.DP: list(range(world)), Axis.PP: [rank],
                                     Axis.TP: [rank]}, world=world)  # fmt: skip
        ql, kl, vl = (shard(x, cp=world, index=rank, dim=2).requires_grad_() for x in (q, k, v))
        o, _ = context_attention(ql, kl, vl, layout=ContextLayout(cp=world, seq_len=S),
                                 topo=topo, axis=Axis.DP, mode=mode)  # fmt: skip
        o.sum().backward()
        out[mode] = (sum(topo.stats.bytes.values()), topo.stats.sent_bytes())
    return out


def test_bytes_per_layer_equal_what_the_real_attention_counts():
    """cp 4 under gloo: comm.py's counted and sent bytes of one layer's forward + backward,
    every mode, equal ``layer_bytes`` on every rank (catches a formula that drifts from the
    exchange it prices: a missing dK/dV hop, an all-to-all the model does not issue)."""
    per_rank = run_workers(4, _count_exchanges)
    cfg = _model()
    for mode in ("ring", "allgather", "a2a"):
        nb = cp_sim.layer_bytes(cfg, _layout(4, mode))
        for counts in per_rank:
            counted, sent = counts[mode]
            assert counted == pytest.approx(nb.counted), mode
            assert sent == pytest.approx(nb.sent), mode


def test_activations_fall_with_cp_as_the_formula_says():
    """Activation bytes at cp N are those of s / N tokens with no scores kept: exactly
    1/N of cp 1's fused-attention figure (a simulator that ignores cp keeps them flat; one
    that divides the s^2 term by N^2 undercounts)."""
    cfg = _model(seq_len=4096)
    hw = get_hardware("a100-80gb")
    acts = {}
    for N in (1, 2, 4, 8):
        res = simulate(cfg, _layout(N, "ring").replace(dtype="bf16"), hw)
        acts[N] = res.memory.activations
    for N in (2, 4, 8):
        assert acts[N] == pytest.approx(acts[1] / N, rel=1e-9)
    assert acts[4] / acts[1] <= 0.30  # the bar


def test_unfused_attention_activations_drop_the_score_matrix():
    """A runtime without fused attention keeps s x s scores at cp 1 but none at cp > 1
    (the cp functions save Q, K, V, out, LSE): cp 4 holds far less than a quarter, while
    plait's math path holds each block's fp32 scores only while the layer runs."""
    cfg = _model(seq_len=2048)
    cpu = get_hardware("cpu")
    one = simulate(cfg, _layout(1, "ring"), cpu, runtime="megatron-lm").memory.activations
    four = simulate(cfg, _layout(4, "ring"), cpu, runtime="megatron-lm").memory
    assert four.activations < one / 4
    c = 2048 / 8  # a query chunk against a block of two chunks, 3 fp32 matrices
    held = 2 * 2 * B * 2048 / 4 * K * D * 8
    math = cp_sim.math_attention(_layout(4, "ring"), get_runtime("megatron-lm"))
    assert math and cp_sim.buffer_bytes(cfg, _layout(4, "ring"), not math) == (
        held + 3 * 4 * B * H * c * 2 * c
    )


def test_mode_buffers_follow_their_formulas():
    """What one layer's exchange holds (fused attention, so no scores): ring two K/V blocks
    and two fp32 dK/dV blocks of s / N tokens, allgather the whole sequence's K/V and its
    fp32 gradient, a2a the head-sharded Q/K/V/out and their fp32 gradients."""
    cfg = _model(seq_len=1024)
    b, s, k, h, e, N = B, 1024, K * D, H * D, 2, 4
    lay = _layout(N, "ring").replace(dtype="bf16")
    assert cp_sim.buffer_bytes(cfg, lay, True) == 2 * 2 * b * s / N * k * (e + 4)
    lay = lay.replace(cp_mode="allgather")
    assert cp_sim.buffer_bytes(cfg, lay, True) == 2 * b * s * k * (e + 4)
    lay = lay.replace(cp_mode="a2a")
    assert cp_sim.buffer_bytes(cfg, lay, True) == b * s * (2 * h + 2 * k) / N * (e + 4)


def test_attention_flops_per_rank_fall_by_cp_and_the_ring_hides_behind_them():
    """Fused attention: the layer's compute at cp N is ~1/N of cp 1's (head-tail balance);
    a ring on NVLink whose block compute outlasts its message exposes only the last dK/dV
    hop, and the block compute's slowdown beside its N - 1 messages
    (``Hardware.overlap_slowdown``); on a slow link it exposes the difference."""
    cfg = _model(n_layers=2, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=11008,
                 seq_len=32768)  # fmt: skip
    hw = get_hardware("h100-sxm")
    lay = Layout(micro_batch_size=1, global_batch_size=1, dtype="bf16")
    one = costs.layer_cost(cfg, lay, hw, _rt())
    for N in (2, 4, 8):
        lc = costs.layer_cost(cfg, lay.replace(cp=N), hw, _rt())
        assert lc.fwd == pytest.approx(one.fwd / N, rel=0.02)
        link = cp_sim.link(hw, lay.replace(cp=N))
        kv = cp_sim.p2p_time(2 * 32768 / N * 8 * 128 * 2, link)
        dkv = cp_sim.p2p_time(2 * 32768 / N * 8 * 128 * 4, link)
        k = hw.overlap_slowdown
        assert lc.fwd_cp == pytest.approx((N - 1) * k * kv)
        assert lc.bwd_cp == pytest.approx((N - 1) * k * (kv + dkv) + dkv)
    slow = hw.replace(intra_node=hw.inter_node, devices_per_node=1)
    lc = costs.layer_cost(cfg, lay.replace(cp=8), slow, _rt())
    assert lc.fwd_cp > 0
    from plait.sim.runtime import get_runtime

    # plait runs CUDA's fused kernels, but math attention in fp32 on document-masked blocks
    plait = get_runtime("plait")
    fused = costs.layer_cost(cfg, lay.replace(cp=8), hw, plait).fwd
    assert fused == pytest.approx(costs.layer_cost(cfg, lay, hw, plait).fwd / 8, rel=0.02)
    docs = lay.replace(cp=8, document_mask=True)
    assert costs.layer_cost(cfg, docs, hw, plait).fwd > 2 * fused


def _rt():
    """A runtime whose cp attention is fused (Megatron-Core / Transformer Engine)."""
    from plait.sim.runtime import get_runtime

    return get_runtime("megatron-core")


def test_gradients_reduce_over_dp_times_cp():
    """With cp the gradient all-reduce and ZeRO's shard group span dp x cp ranks
    (Topology.grad_view): dp 2 cp 4 costs what dp 8 costs, and ZeRO shards over 8."""
    hw = get_hardware("h100-sxm")
    lay = Layout(dp=2, cp=4, tp=1, global_batch_size=8, zero=1)
    plain = Layout(dp=8, tp=1, global_batch_size=8, zero=1)
    rt = _rt()
    assert costs.dp_groups(lay) == (8, 1)
    assert costs.dp_comm_time(1e9, lay, hw, rt) == costs.dp_comm_time(1e9, plain, hw, rt)


def test_cp_ring_link_is_inside_a_node_until_tp_times_cp_exceeds_it():
    """cp sits between dp and tp: tp 2 x cp 4 = 8 fits one 8-GPU node (NVLink), tp 4 x
    cp 4 does not (the ring crosses nodes)."""
    hw = get_hardware("h100-sxm")
    assert cp_sim.link(hw, Layout(cp=4, tp=2)) == hw.intra_node
    assert cp_sim.link(hw, Layout(cp=4, tp=4)).bandwidth < hw.intra_node.bandwidth


def test_simulate_cli_prints_cp_lines(capsys):
    """``plait simulate --cp 4 --cp-mode ring`` prints the cp traffic and memory lines and
    counts the cp ranks in --gpus (dp = gpus / (tp pp cp))."""
    from plait.cli import main

    rc = main(["simulate", "--model", "llama2-7b", "--seq-len", "32768", "--gpus", "8",
               "--tp", "2", "--cp", "4", "--cp-mode", "ring", "--global-batch-size", "8"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "dp=1 cp=4 ring tp=2" in out
    assert "cp traffic ring over 4 ranks" in out and "cp memory  activations of 8,192" in out
    assert "cp comm" in out


def test_recomputation_exchanges_again():
    """Selective recomputation checkpoints the attention core and full recomputation the
    whole layer: either runs the cp exchange's forward again in the backward, so a step's
    cp bytes are the layer's counted bytes plus its forward's, per layer and micro-batch
    (what ``plait rehearse`` counts: gpt3-125m at cp 2, 0.422 GiB without and 0.492 with,
    both equal to this). Catches selective recomputation priced as if the exchange ran
    once (LLaMA-3 8B at 32k tokens and cp 4: 14.0 simulated vs 17.0 GiB rehearsed)."""
    from plait.sim.runtime import get_runtime
    from plait.sim.traffic import bytes_per_axis

    cfg = _model()
    for mode in ("ring", "allgather", "a2a"):
        nb = cp_sim.layer_bytes(cfg, _layout(2, mode))
        for recompute, extra in (("none", 0.0), ("selective", 1.0), ("full", 1.0)):
            lay = _layout(2, mode, recompute=recompute)
            got = bytes_per_axis(cfg, lay, get_runtime("plait"), [cfg.n_layers], 0)["cp"]
            assert got == pytest.approx(cfg.n_layers * (nb.counted + extra * nb.fwd_counted))
