"""Communication-efficient data parallelism, pure logic (no processes): the codecs (QSGD
unbiased within its variance bound, top-k with EF21 conserving the residual, PowerSGD
exact on low-rank gradients), the gossip graphs (doubly stochastic, spectral gaps in the
expected order, one-peer exponential exact in log2 n rounds) and their point-to-point
batches under NCCL's semantics, the byte formulas, and the one-line refusals.

The multi-process checks (equalities with plain data parallelism, tp / pp, resume, bytes
per step) are in ``test_dp_algos_train.py``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from plait.dp_algos import graphs, volume
from plait.dp_algos.compression import (
    QSGD,
    QSGD_BLOCK,
    Int8Sum,
    PowerSGD,
    TopK,
    orthonormalise,
)
from plait.dp_algos.config import DPAlgoConfig, parse_compress
from plait.layout import Layout
from plait.topology import CommStats

# --- codecs --------------------------------------------------------------------------------


def test_qsgd_is_unbiased_with_variance_inside_the_bound():
    """Alistarh et al. 2017, Lemma 3.1: E[Q(v)] = v and E|Q(v) - v|^2 <= min(d/s^2,
    sqrt(d)/s) |v|^2 per block of d elements. T draws: each element's mean is within 6
    standard errors (its variance is at most (|v_block| / s)^2 / 4)."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(3 * QSGD_BLOCK + 100, generator=gen) * torch.linspace(0.1, 3, 1636)
    draws = 3000
    for s in (1, 4, 16):
        codec = QSGD(s)
        total = torch.zeros_like(v, dtype=torch.float64)
        sq_err = 0.0
        for t in range(draws):
            g = codec.generator("w", t, 0, "cpu")
            q = codec.decode(*codec.encode(v, gen=g), v.numel())
            total += q.double()
            sq_err += (q - v).double().pow(2).sum().item()
        mean = total / draws
        blocks = torch.nn.functional.pad(v, (0, 4 * QSGD_BLOCK - v.numel())).view(4, -1)
        norm = torch.linalg.vector_norm(blocks, dim=1).repeat_interleave(QSGD_BLOCK)[: v.numel()]
        stderr = (norm.double() / s) / 2 / math.sqrt(draws)
        assert ((mean - v.double()).abs() <= 6 * stderr + 1e-7).all(), s
        d = QSGD_BLOCK
        bound = min(d / s**2, math.sqrt(d) / s) * v.double().pow(2).sum().item()
        assert sq_err / draws <= bound, (s, sq_err / draws, bound)
    # one byte per element plus one fp32 norm per block
    norms, levels = QSGD(8).encode(v, gen=torch.Generator().manual_seed(1))
    assert levels.dtype == torch.int8 and norms.numel() == 4
    assert levels.abs().max() <= 8


def test_int8_sum_is_unbiased_exact_in_the_sum_and_inside_its_error_bound():
    """``Int8Sum`` on R = 4 replicas (s = 127 // 4 = 31 levels): the shared scale of a
    block is the largest |v_i| over the replicas, so every level is within -s..s and the
    R levels' sum fits a signed byte; decoding the summed levels equals the sum of the
    decoded ones exactly (one multiplication of an exact integer); each element's error is
    at most a / s, and over T draws its mean is within 6 standard errors of v (variance at
    most (a / s)^2 / 4). Blocks restart at each tensor."""
    r = 4
    codec = Int8Sum(r)
    assert codec.levels == 31
    gen = torch.Generator().manual_seed(0)
    vs = [torch.randn(2 * QSGD_BLOCK + 37, generator=gen) * (i + 1) for i in range(r)]
    vs[2][5] = 40.0  # one replica's outlier sets block 0's scale for all
    scales = torch.stack([codec.scales(v) for v in vs]).amax(dim=0)
    assert scales.numel() == 3 and scales[0] == 40.0
    grid = scales.repeat_interleave(QSGD_BLOCK)[: vs[0].numel()] / codec.levels
    draws, total = 2000, [torch.zeros_like(v, dtype=torch.float64) for v in vs]
    for t in range(draws):
        levels = [codec.encode(v, scales, gen=codec.generator("w", t, i, "cpu"))
                  for i, v in enumerate(vs)]  # fmt: skip
        assert all(lv.dtype == torch.int8 and lv.abs().max() <= codec.levels for lv in levels)
        summed = torch.stack(levels).sum(dim=0)  # what the int8 all-reduce computes
        assert summed.abs().max() <= 127
        decoded = [codec.decode(lv, scales) for lv in levels]
        assert torch.equal(codec.decode(summed.to(torch.int8), scales),
                           summed.float() * grid)  # fmt: skip
        for i, (q, v) in enumerate(zip(decoded, vs)):
            assert ((q - v).abs() <= grid * (1 + 1e-6)).all()
            total[i] += q.double()
    stderr = grid.double() / 2 / math.sqrt(draws)
    for tot, v in zip(total, vs):
        assert ((tot / draws - v.double()).abs() <= 6 * stderr + 1e-7).all()
    with pytest.raises(ValueError, match="127"):
        Int8Sum(128)


def _sends_the_k_largest(before: torch.Tensor, idx: torch.Tensor, k: int) -> None:
    """``idx``: k distinct positions, none of whose |grad - g_i| is smaller than any left
    behind (ties aside, the k largest by magnitude)."""
    idx = idx.long()
    assert idx.numel() == idx.unique().numel() == k
    rest = torch.ones_like(before, dtype=torch.bool).index_fill_(0, idx, False)
    assert before[idx].abs().min() >= before[rest].abs().max()


def test_topk_ef21_conserves_the_residual_exactly():
    """What is sent plus what remains of grad - g_i equals grad - g_i before, bit for bit,
    step after step; the sum over ranks accumulates what they sent. What is sent is the k
    largest |grad - g_i|: conservation alone holds for any choice of positions, so this
    catches another choice (the signed top-k, the first k, random ones)."""
    gen = torch.Generator().manual_seed(0)
    ranks = [TopK(0.05) for _ in range(3)]
    total = torch.zeros(1000)
    for step in range(5):
        sent_sum = torch.zeros(1000)
        for codec in ranks:
            grad = torch.randn(1000, generator=gen)
            before = grad - codec.local["w"] if "w" in codec.local else grad.clone()
            values, idx = codec.encode("w", grad)
            assert values.numel() == idx.numel() == 50
            _sends_the_k_largest(before, idx, 50)
            sent = torch.zeros(1000).index_put_((idx.long(),), values)
            after = grad - codec.local["w"]
            assert torch.equal(sent + after, before), step  # nothing lost, nothing made up
            assert (after[idx.long()] == 0).all()
            sent_sum += sent
            for other in ranks:  # every rank adds every sender's message
                other.add_to_total("w", values, idx, 1000)
        total += sent_sum
        for codec in ranks:
            assert torch.allclose(codec.result("w"), total, atol=1e-5)


@pytest.mark.parametrize("warm_start", [True, False])
def test_topk_ef21_after_a_plain_warm_up_conserves_the_residual(warm_start):
    """Plain warm-up steps (what ``--compress-warmup`` drives: each rank's gradient to
    ``follow_local``, the all-reduced sum to ``follow_total``) leave g_i and g at the last
    plain gradients, or at zero with ``--ef21-start zero``; the compressed steps after
    them conserve the residual bit for bit, sending the k largest |grad - g_i|, and g stays
    the sum of the g_i."""
    gen = torch.Generator().manual_seed(1)
    ranks = [TopK(0.05, warm_start=warm_start) for _ in range(3)]
    for _ in range(2):  # warm-up steps
        grads = [torch.randn(1000, generator=gen) for _ in ranks]
        for codec, grad in zip(ranks, grads):
            codec.follow_local("w", grad)
        for codec in ranks:
            codec.follow_total("w", sum(grads))
    for codec, grad in zip(ranks, grads):
        want = grad if warm_start else torch.zeros(1000)
        assert torch.equal(codec.local.get("w", torch.zeros(1000)), want)
    for step in range(4):  # compressed steps
        for codec in ranks:
            grad = torch.randn(1000, generator=gen)
            before = grad - codec.local["w"] if "w" in codec.local else grad.clone()
            values, idx = codec.encode("w", grad)
            _sends_the_k_largest(before, idx, 50)
            sent = torch.zeros(1000).index_put_((idx.long(),), values)
            assert torch.equal(sent + (grad - codec.local["w"]), before), step
            for other in ranks:
                other.add_to_total("w", values, idx, 1000)
        local_sum = sum(codec.local["w"] for codec in ranks)
        for codec in ranks:  # g = sum_i g_i, up to fp32 rounding of the two sums' orders
            assert torch.allclose(codec.result("w"), local_sum, atol=1e-5)


def test_powersgd_is_exact_on_low_rank_gradients_and_keeps_its_error():
    gen = torch.Generator().manual_seed(0)
    cols = torch.randn(40, 2, generator=gen)  # both ranks' gradients in one rank-2 space
    grads = [cols @ torch.randn(2, 30, generator=gen) for _ in "ab"]
    codecs = [PowerSGD(2, seed=7) for _ in grads]
    ps = [c.first("w", g) for c, g in zip(codecs, grads)]
    p_sum = sum(ps)
    outs = [c.second("w", p_sum) for c in codecs]
    q_sum = sum(q for _, q in outs)
    approx = [c.finish("w", p_hat, q_sum) for c, (p_hat, _) in zip(codecs, outs)]
    assert torch.allclose(approx[0], grads[0] + grads[1], atol=1e-4)
    assert torch.equal(approx[0], approx[1])  # the same bits on every rank
    # rank 1 of a rank-2 sum: the error feedback keeps exactly what was not sent
    c = PowerSGD(1, seed=7)
    g = grads[0] + torch.randn(40, 30, generator=gen)
    p_hat, q = c.second("v", c.first("v", g))
    sent = c.finish("v", p_hat, q)
    assert torch.allclose(sent + c.error["v"], g, atol=1e-5)
    assert c.matrix_shape((8,)) is None and c.matrix_shape((2, 2)) is None  # whole
    assert c.matrix_shape((64, 3, 4)) == (64, 12)
    o = orthonormalise(torch.randn(50, 3, generator=gen))
    assert torch.allclose(o.T @ o, torch.eye(3), atol=1e-5)


def test_powersgd_approaches_the_best_rank_r_approximation():
    """The low-rank part PowerSGD sends is close to the truncated SVD's, and closer each
    step as Q warm-starts the next power iteration. ``sent + error == g`` holds for any
    rank-r part; this catches a part that is not the dominant subspace's (Q not carried
    over, P^ not orthonormal, the wrong factor sent, no compression at all).

    The bound (subspace iteration, Golub & Van Loan section 8.2.4): the sum M of the
    ranks' gradients has singular values s_1 >= s_2 >= ...; after t steps on a fixed M
    (error feedback cleared, so M does not change), P^ spans M (M^T M)^(t-1) Q_0, whose
    largest principal angle with M's top-r left singular vectors U_r satisfies
    tan(theta_t) <= (s_(r+1) / s_r)^(2t-1) tan(theta_0), where tan(theta_0) =
    |V_perp^T Q_0 (V_r^T Q_0)^-1|_2 for the random Q_0. What is sent is P^ P^^T M; the
    parts of M - P^ P^^T M along V_r and along V_perp are orthogonal, so
    |M - sent|_F^2 <= sin^2(theta_t) |M_r|_F^2 + |M - M_r|_F^2, with M_r the truncated SVD
    (Eckart-Young: |M - M_r|_F is also the least any rank-r part can leave) and
    sin(theta_t) <= min(tan(theta_t), 1). Slack: fp32 arithmetic, 1e-5 of |M|_F."""
    gen = torch.Generator().manual_seed(0)
    rows, cols, r = 40, 30, 2
    # a spectrum with a gap after r: s_3 / s_2 = 1/3
    s = torch.tensor([4.0, 3.0] + [0.8**i for i in range(cols - r)], dtype=torch.float64)
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    part = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    grads = [part.float(), (u @ torch.diag(s) @ v.T - part).float()]  # two ranks
    m = grads[0].double() + grads[1].double()
    u, s, vh = torch.linalg.svd(m)
    best = torch.linalg.matrix_norm(m - u[:, :r] @ torch.diag(s[:r]) @ vh[:r]).item()
    slack = 1e-5 * torch.linalg.matrix_norm(m).item()
    codecs = [PowerSGD(r, seed=7) for _ in grads]
    for t in range(1, 5):
        for c in codecs:
            c.error.pop("w", None)
        ps = [c.first("w", g) for c, g in zip(codecs, grads)]
        if t == 1:
            q0 = codecs[0].q["w"].double()
            tan0 = torch.linalg.matrix_norm(
                vh[r:] @ q0 @ torch.linalg.inv(vh[:r] @ q0), ord=2
            ).item()
        outs = [c.second("w", sum(ps)) for c in codecs]
        q_sum = sum(q for _, q in outs)
        sent = [c.finish("w", p_hat, q_sum) for c, (p_hat, _) in zip(codecs, outs)]
        assert torch.equal(sent[0], sent[1])
        err = torch.linalg.matrix_norm(m - sent[0].double()).item()
        tan_t = (s[r] / s[r - 1]).item() ** (2 * t - 1) * tan0
        bound = math.sqrt(best**2 + (min(tan_t, 1.0) * s[:r].norm().item()) ** 2)
        assert best - slack <= err <= bound + slack, (t, err, best, bound)
    assert err <= best * (1 + 1e-4)  # after 4 steps (the bound's 3e-5 here): the SVD's error


# --- gossip graphs ---------------------------------------------------------------------------

GRAPHS = ("ring", "torus", "exponential", "complete", "one-peer-exponential")


@pytest.mark.parametrize("topology", GRAPHS)
def test_mixing_matrices_are_doubly_stochastic(topology):
    for n in range(2, 18):
        for step in range(3):
            w = graphs.mixing_matrix(topology, n, step)
            assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1), (n, step)
            assert (w >= 0).all()
            if topology != "one-peer-exponential":
                assert np.allclose(w, w.T)  # Metropolis-Hastings: symmetric
            for i in range(n):  # only neighbours get weight
                recv, _ = graphs.neighbours(topology, n, i, step)
                assert set(np.flatnonzero(w[i])) <= {i, *recv}


def test_spectral_gap_ordering_and_one_peer_exact_average():
    for n in (16, 36, 64):
        gaps = [graphs.spectral_gap(graphs.mixing_matrix(t, n)) for t in GRAPHS[:3]]
        assert gaps[0] < gaps[1] < gaps[2], (n, gaps)
        assert graphs.spectral_gap(graphs.mixing_matrix("complete", n)) == pytest.approx(1)
    for n in (2, 4, 8, 16, 32):
        rounds = int(math.log2(n))
        assert graphs.rounds_to_average("one-peer-exponential", n) == rounds
        prod = np.eye(n)
        for step in range(rounds):
            prod = graphs.mixing_matrix("one-peer-exponential", n, step) @ prod
        assert np.allclose(prod, np.full((n, n), 1 / n), atol=1e-15)
        if n > 2:  # one round short is not the average
            short = np.eye(n)
            for step in range(rounds - 1):
                short = graphs.mixing_matrix("one-peer-exponential", n, step) @ short
            assert not np.allclose(short, 1 / n)
    assert graphs.rounds_to_average("one-peer-exponential", 6) == 0


def _posted_by_mix(topology: str, n: int, steps: int, monkeypatch) -> list[list[list]]:
    """[replica][batch] -> the (kind, peer) list ``Gossip.mix`` posts over ``steps`` rounds
    of two chunks each, recorded through ``comm.batch_p2p`` (no process group: each
    replica's ``Gossip`` holds only what ``mix`` reads; peer ranks are replica indices)."""
    from types import SimpleNamespace

    from plait import comm
    from plait.dp_algos.gossip import Gossip
    from plait.topology import Axis

    posted = [[] for _ in range(n)]

    def batch_p2p(ops, *, topo, axis):
        posted[topo.rank].append([(kind, peer) for kind, _, peer in ops])
        return []

    monkeypatch.setattr(comm, "batch_p2p", batch_p2p)
    monkeypatch.setattr(comm, "wait", lambda works, **kw: None)
    for i in range(n):
        gossip = object.__new__(Gossip)
        gossip.num_replicas, gossip.index = n, i
        gossip.cfg = DPAlgoConfig(algo="gossip", topology=topology)
        gossip.topo = SimpleNamespace(device="cpu")
        gossip.across = SimpleNamespace(rank=i, group_ranks={Axis.DP: list(range(n))})
        gossip.shards, gossip.chunk_bytes = [torch.zeros(4), torch.zeros(4)], 16  # 2 chunks
        gossip.engine = SimpleNamespace(shards_changed=lambda: None)
        for step in range(steps):
            gossip.mix(step)
    return posted


@pytest.mark.parametrize("topology", GRAPHS)
def test_gossip_batches_cannot_deadlock_under_nccl(topology, monkeypatch):
    """Every replica count 2..17, six rounds (the one-peer graph cycles its peers): the
    batches ``Gossip.mix`` posts complete under NCCL's semantics; the same messages
    posted one at a time deadlock wherever the graph has a cycle."""
    from plait.nccl_p2p import P2PDeadlock

    for n in range(2, 18):
        posted = _posted_by_mix(topology, n, 6, monkeypatch)
        assert graphs.run_p2p(posted) == 6 * 2 * n
    with pytest.raises(P2PDeadlock, match="deadlock"):
        graphs.run_p2p(graphs.one_at_a_time("ring", 5, 1))
    with pytest.raises(P2PDeadlock, match="no receive"):
        graphs.run_p2p([[[("send", 1)]], [[]]])


def test_graph_degrees():
    assert graphs.degree("ring", 2) == 1 and graphs.degree("ring", 8) == 2
    assert graphs.torus_shape(16) == (4, 4) and graphs.degree("torus", 16) == 4
    assert graphs.degree("exponential", 16) == 7  # +-1, +-2, +-4, 8
    assert graphs.degree("one-peer-exponential", 16) == 1
    assert graphs.degree("complete", 5) == 4


# --- bytes ------------------------------------------------------------------------------------


def test_byte_formulas():
    shapes = [(64, 32), (32,), (256, 64)]
    e = 4 * (64 * 32 + 32 + 256 * 64)
    plain = volume.step_volume(DPAlgoConfig(), step=0, shapes=shapes, n=4)
    assert plain.counted == {"all_reduce": e} and plain.sent == 1.5 * e
    local = DPAlgoConfig(algo="local-sgd", sync_every=4, local_warmup=2)
    sent = [volume.step_volume(local, step=s, shapes=shapes, n=4).sent for s in range(10)]
    assert sent == [1.5 * e, 1.5 * e, 0, 0, 0, 1.5 * e, 0, 0, 0, 1.5 * e]
    assert volume.mean_volume(local, shapes=shapes, n=4).sent == 1.5 * e / 4
    # --sync-optimizer-state: the state tensors travel at a sync (AdamW 2, SGD momentum 1)
    opt = dataclasses.replace(local, sync_optimizer_state=True)
    sent = [volume.step_volume(opt, step=s, shapes=shapes, n=4).sent for s in range(6)]
    assert sent == [1.5 * e, 1.5 * e, 0, 0, 0, 3 * 1.5 * e]
    sgd = volume.step_volume(opt, step=5, shapes=shapes, n=4, state_tensors=1)
    assert sgd.counted == {"all_reduce": 2 * e}
    assert volume.mean_volume(opt, shapes=shapes, n=4).sent == 3 * 1.5 * e / 4
    ring = volume.step_volume(DPAlgoConfig(algo="gossip"), step=0, shapes=shapes, n=4)
    assert ring.counted == {"send": 2 * e, "recv": 2 * e} and ring.sent == 2 * e
    pga = DPAlgoConfig(algo="gossip", topology="one-peer-exponential", global_avg_every=3)
    sent = [volume.step_volume(pga, step=s, shapes=shapes, n=4).sent for s in range(3)]
    assert sent == [e, e, 1.5 * e]
    topk = volume.step_volume(DPAlgoConfig(compress="topk:0.01"), step=0, shapes=shapes, n=4)
    k = math.ceil(0.01 * 2048) + math.ceil(0.01 * 32) + math.ceil(0.01 * 16384)
    assert topk.counted == {"all_gather": 4 * 8 * k} and topk.sent == 3 * 8 * k
    psgd = volume.step_volume(DPAlgoConfig(compress="powersgd:4"), step=0, shapes=shapes, n=2)
    assert psgd.counted == {"all_reduce": 4 * (4 * 96 + 32 + 4 * 320)}
    qsgd = volume.step_volume(DPAlgoConfig(compress="qsgd:8"), step=0, shapes=[(1000,)], n=2)
    assert qsgd.counted == {"all_gather": 2 * (1000 + 8)}
    # int8 gradients: the block scales and the levels, each all-reduced
    int8 = volume.step_volume(DPAlgoConfig(compress="int8"), step=0, shapes=[(1000,)], n=4)
    assert int8.counted == {"all_reduce": 1000 + 8} and int8.sent == 1.5 * (1000 + 8)
    # a compressed local SGD / DiLoCo sync: the change in bf16, or int8 levels + scales
    blocks = 4 + 1 + 32  # per tensor: ceil(2048 / 512), ceil(32 / 512), ceil(16384 / 512)
    for algo in ("local-sgd", "diloco"):
        int8 = DPAlgoConfig(algo=algo, sync_every=4, compress="int8")
        sent = [volume.step_volume(int8, step=s, shapes=shapes, n=4).counted for s in range(4)]
        assert sent == [{}, {}, {}, {"all_reduce": e // 4 + 4 * blocks}]
        bf16 = dataclasses.replace(int8, compress="bf16")
        assert volume.mean_volume(bf16, shapes=shapes, n=4).sent == 1.5 * e / 2 / 4


def test_comm_stats_sent_bytes():
    stats = CommStats()
    stats.record("dp", "all_reduce", 100, 150.0)
    stats.record("dp", "send", 40, 40.0)
    stats.record("tp", "all_reduce", 100, 100.0)
    assert stats.sent_bytes("dp") == 190.0 and stats.sent_bytes() == 290.0
    stats.reset()
    assert stats.sent_bytes() == 0


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, layout, words",
    [
        (dict(algo="diloco", sync_every=10), dict(dp=4, zero=3, global_batch_size=8),
         "--zero-shard-group"),
        (dict(algo="local-sgd", sync_every=2), dict(dp=1), "--dp 2"),
        (dict(compress="powersgd:4"), dict(dp=4, zero=2, zero_shard_group=2,
                                           global_batch_size=8), "qsgd, topk or bf16"),
        (dict(compress="qsgd:8"), dict(dp=4, zero=3, global_batch_size=8), "--zero-shard-group"),
        (dict(algo="gossip"), dict(dp=2, dtype="fp16"), "bf16"),
        (dict(algo="gossip", topology="torus"), dict(dp=2), "at least 4"),
        (dict(algo="local-sgd", sync_every=2, compress="int8"), dict(dp=128, global_batch_size=128), "bf16"),
        # the gradients are summed over dp x cp (a check on dp alone passed, then the
        # build raised)
        (dict(compress="int8"), dict(dp=64, cp=2, global_batch_size=64), "sums 128 ranks"),
    ],
)  # fmt: skip
def test_pairs_that_mean_nothing_are_refused_in_one_line(cfg, layout, words):
    with pytest.raises(ValueError) as e:
        DPAlgoConfig(**cfg).check_layout(Layout(**layout))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(algo="diloco"), "--sync-every"),
        (dict(algo="gossip", sync_every=3), "--sync-every applies"),
        (dict(algo="local-sgd", sync_every=2, compress="qsgd:8"), "use bf16 or int8"),
        (dict(algo="diloco", sync_every=2, compress="powersgd:4"), "use bf16 or int8"),
        (dict(compress="int8:4"), "takes no argument"),
        (dict(algo="gossip", compress="bf16"), "drop one"),
        (
            dict(algo="local-sgd", sync_every=2, compress="int8", sync_optimizer_state=True),
            "--sync-optimizer-state",
        ),
        (
            dict(algo="local-sgd", sync_every=2, compress="int8", compress_warmup=3),
            "--local-warmup",
        ),
        (dict(algo="diloco", sync_every=2, local_warmup=3), "--local-warmup"),
        (dict(algo="diloco", sync_every=2, sync_optimizer_state=True), "--sync-optimizer-state"),
        (dict(algo="gossip", sync_optimizer_state=True), "--sync-optimizer-state"),
        (dict(compress="qsgd:300"), "1..127"),
        (dict(compress="topk:2"), "(0, 1]"),
        (dict(compress="zip"), "qsgd:LEVELS"),
        (dict(algo="gossip", topology="star"), "--topology"),
        (dict(algo="diloco", sync_every=2, outer_momentum=1.0), "--outer-momentum"),
        (dict(compress_warmup=10), "--compress-warmup applies"),
        (dict(compress="powersgd:4", compress_warmup=-1), "--compress-warmup"),
        (dict(compress="topk:0.01", ef21_start="zero"), "--ef21-start zero applies"),
        (dict(compress="powersgd:4", compress_warmup=2, ef21_start="zero"), "--ef21-start"),
        (dict(compress="topk:0.01", compress_warmup=2, ef21_start="last"), "--ef21-start"),
    ],
)
def test_config_errors_are_one_line(kwargs, words):
    with pytest.raises(ValueError) as e:
        DPAlgoConfig(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert parse_compress("powersgd:4") == ("powersgd", 4)


# --- the simulator's price -----------------------------------------------------------------


def _sim(algo, **layout):
    from plait.model.config import preset
    from plait.sim.hardware import get_hardware
    from plait.sim.simulate import simulate

    model = preset("gpt2-124m")
    lay = Layout(**{"dp": 16, "global_batch_size": 64, "dtype": "bf16", **layout})
    return simulate(model, lay, get_hardware("a100-80gb"), runtime="plait", dp_algo=algo)


def test_simulator_prices_each_algorithm_from_the_byte_formulas():
    """Bytes sent are the runtime's formulas (``volume``) for the rank's own tensors
    (``rank_shapes`` covers exactly its parameters); all-reduce priced as before; local SGD
    and DiLoCo cost 1/H of an average per step; gossip's one-peer graph sends half an
    all-reduce; the compressed all-reduces send what their codecs promise."""
    from plait.model.config import preset
    from plait.sim import dp_algos as sim_dp
    from plait.sim.memory import stage_params

    model = preset("gpt2-124m")
    lay = Layout(dp=16, global_batch_size=64, tp=2, pp=2)
    params = stage_params(model, lay, 6, True, False)
    shapes = sim_dp.rank_shapes(model, lay, [(6, True, False)], params)
    assert sum(math.prod(s) for s in shapes) == params
    plain, none = _sim(DPAlgoConfig()), _sim(None)
    assert plain.iter_time_s == none.iter_time_s and none.dp_algo is None
    e = 4 * plain.dp_algo["bytes_sent"] / (2 * 15 / 16 * 4)  # 4N
    times = {}
    for h in (1, 10, 100):
        res = _sim(DPAlgoConfig(algo="diloco", sync_every=h))
        assert res.dp_algo["bytes_sent"] == pytest.approx(2 * 15 / 16 * e / h)
        times[h] = res.iter_time_s
    assert times[1] > times[10] > times[100]
    # AdamW's two moments travel with the parameters under --sync-optimizer-state
    local = DPAlgoConfig(algo="local-sgd", sync_every=10)
    bare, opt = _sim(local), _sim(dataclasses.replace(local, sync_optimizer_state=True))
    assert opt.dp_algo["bytes_sent"] == pytest.approx(3 * bare.dp_algo["bytes_sent"])
    assert opt.iter_time_s > bare.iter_time_s
    # a compressed sync: a half (bf16) or about a quarter (int8) of the bytes; on a 10 Gb/s
    # network, where the bytes dominate, less time (on the DGX's 200 Gb/s the codec's own
    # streams cost about what it saves: no faster there)
    from plait.sim.hardware import Link, get_hardware
    from plait.sim.simulate import simulate

    slow_hw = get_hardware("a100-80gb")
    slow_hw = slow_hw.replace(inter_node=Link(bandwidth=1.25e9, latency=1e-5))
    lay16 = Layout(dp=16, global_batch_size=64, dtype="bf16")

    def slow(algo):
        return simulate(model, lay16, slow_hw, runtime="plait", dp_algo=algo).iter_time_s

    for spec, ratio in (("bf16", 0.5), ("int8", 0.25 * (1 + 4 / 512))):
        packed = dataclasses.replace(local, compress=spec)
        got = _sim(packed).dp_algo["bytes_sent"]
        assert got == pytest.approx(ratio * bare.dp_algo["bytes_sent"], rel=1e-3), spec
        assert slow(packed) < slow(local), spec
    one_peer = _sim(DPAlgoConfig(algo="gossip", topology="one-peer-exponential"))
    assert one_peer.dp_algo["bytes_sent"] == pytest.approx(e) and one_peer.dp_algo["messages"] == 1
    for spec, below in (("bf16", 0.51), ("powersgd:4", 0.1), ("topk:0.01", 0.2), ("int8", 0.26)):
        res = _sim(DPAlgoConfig(compress=spec))
        assert res.dp_algo["bytes_sent"] < below * plain.dp_algo["bytes_sent"], spec
    with pytest.raises(ValueError, match="--zero-shard-group"):
        _sim(DPAlgoConfig(algo="diloco", sync_every=4), zero=1)


def test_plan_keeps_to_layouts_the_algorithm_runs_on():
    """Gossip runs across replicas: plain ones (ZeRO 0) or groups of sharded ones (HSDP,
    a shard group smaller than dp), and every plan the planner offers is one of them.
    Catches the planner ranking a layout ``check_layout`` refuses."""
    from plait.model.config import preset
    from plait.sim.hardware import get_hardware
    from plait.sim.search import PlanRequest, search

    algo = DPAlgoConfig(algo="gossip", topology="ring")
    req = PlanRequest(model=preset("gpt2-124m"), hardware=get_hardware("a100-80gb"), n_devices=16,
                      global_batch_size=64, top_k=3, dp_algo=algo)  # fmt: skip
    plan = search(req)
    for entry in plan.entries:
        lay = entry.layout
        assert lay.dp >= 2 and (lay.zero == 0 or (lay.zero_shard_group or lay.dp) < lay.dp)
        assert entry.result.dp_algo["label"] == "gossip ring"


def test_a_replica_divides_by_its_own_rows_trained_targets():
    """Replicas that differ each step on their own mean loss: replica b of R holds rows
    [b G/R, (b+1) G/R) of the global batch, so it divides by the trained targets of those
    rows (masked instruction data), which sum over the replicas to the global count."""
    from plait.data import GlobalBatchSampler
    from plait.dp_algos.algorithm import DPAlgorithm, Replicas

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=2000)
    mask = rng.random(2000) < 0.3  # about 30% of the targets take a loss
    sampler = GlobalBatchSampler(tokens, seq_len=16, global_batch=8, seed=0, mask=mask)
    plain = GlobalBatchSampler(tokens, seq_len=16, global_batch=8, seed=0)
    for step in range(3):
        total = sampler.target_count(step)
        counts = []
        for b in range(4):
            algo = object.__new__(Replicas)  # no process group: only what loss_tokens reads
            algo.num_replicas, algo.index = 4, b
            counts.append(algo.loss_tokens(sampler, step, total))
            windows = sampler.window_ids(step)[2 * b : 2 * b + 2]
            want = sum(int(mask[w * 16 + 1 : w * 16 + 17].sum()) for w in windows)
            assert counts[-1] == want, (step, b)
            assert algo.loss_tokens(plain, step, 8 * 16) == 2 * 16
        assert sum(counts) == total and len(set(counts)) > 1
        assert object.__new__(DPAlgorithm).loss_tokens(sampler, step, total) == total


def test_lora_with_another_dp_algorithm_is_refused_in_one_line():
    from plait.data import DataConfig
    from plait.model.config import preset
    from plait.model.lora import LoRAConfig
    from plait.train.config import RunConfig, TrainConfig

    def run(algo):
        return RunConfig(model=preset("tiny"), layout=Layout(dp=2), data=DataConfig(),
                         train=TrainConfig(), out="x", lora=LoRAConfig(rank=4), dp_algo=algo)  # fmt: skip

    assert run(DPAlgoConfig()).lora.rank == 4  # the plain all-reduce: fine
    for algo in (DPAlgoConfig(compress="bf16"), DPAlgoConfig(algo="local-sgd", sync_every=4)):
        with pytest.raises(ValueError) as e:
            run(algo)
        assert "--lora-rank" in str(e.value) and "\n" not in str(e.value)


def test_fault_tolerance_with_another_dp_algorithm_is_refused_in_one_line():
    """Recovery copies identical replicas' parameters and AdamW state; replicas that differ
    (local SGD, DiLoCo, gossip), codec state (--compress) and SGD are not that."""
    from plait.data import DataConfig
    from plait.model.config import preset
    from plait.resilience.config import ResilienceConfig
    from plait.train.config import RunConfig, TrainConfig

    def run(algo, train=None):
        return RunConfig(model=preset("tiny"), layout=Layout(dp=2), data=DataConfig(),
                         train=train or TrainConfig(), out="x", dp_algo=algo,
                         resilience=ResilienceConfig(fault_tolerance=1))  # fmt: skip

    assert run(DPAlgoConfig()).resilience.fault_tolerance == 1  # plain all-reduce: fine
    bad = [(DPAlgoConfig(compress="powersgd:4"), TrainConfig()),
           (DPAlgoConfig(algo="diloco", sync_every=4), TrainConfig()),
           (DPAlgoConfig(), TrainConfig(optimizer="sgd"))]  # fmt: skip
    for algo, train in bad:
        with pytest.raises(ValueError) as e:
            run(algo, train)
        assert "--fault-tolerance" in str(e.value) and "\n" not in str(e.value)


def test_orthonormalise_never_asks_the_host():
    """Gram-Schmidt runs on the device without reading a value back: under fake tensors
    (no values: any ``if norm > 0`` raises) it completes, and a zero column stays zero
    while the others come out orthonormal. Catches a per-column host synchronisation --
    r per matrix per step under PowerSGD on a GPU -- which also made ``plait rehearse``
    of ``--compress powersgd`` fail."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert orthonormalise(torch.randn(50, 3)).shape == (50, 3)
    p = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    p[:, 1] = 0
    o = orthonormalise(p)
    assert torch.equal(o[:, 1], torch.zeros(40))
    kept = o[:, [0, 2]]
    assert torch.allclose(kept.T @ kept, torch.eye(2), atol=1e-5)


def test_powersgd_forms_m_prime_in_its_error_with_the_same_bits():
    """Two steps of PowerSGD on one matrix: P, the kept M' = M + e and the next error equal
    the out-of-place formulas bit for bit, and M' lives in the error's own storage (as
    does the next error). Catches a separate M' -- a second fp32 copy of every compressed
    gradient held from the backward to ``finish()`` (x1.061 of a rank's peak in
    ``plait rehearse``) -- and an in-place update that changes the arithmetic."""
    codec = PowerSGD(2, seed=3)
    gen = torch.Generator().manual_seed(1)
    codec.error["w"] = torch.zeros(16, 24)
    for _ in range(2):
        grad = torch.randn(16, 24, generator=gen)
        e = codec.error["w"]
        want_m = grad + e
        q = codec.q["w"].clone() if "w" in codec.q else codec._q("w", 24, 2, "cpu").clone()
        p = codec.first("w", grad)
        assert codec._m["w"].data_ptr() == e.data_ptr()  # M' in the error's storage
        assert torch.equal(codec._m["w"], want_m) and torch.equal(p, want_m @ q)
        p_hat, q_new = codec.second("w", p)
        assert torch.equal(q_new, want_m.T @ p_hat)
        assert torch.equal(codec.error["w"], want_m - p_hat @ q_new.T)
        assert codec.error["w"].data_ptr() == e.data_ptr()
        codec.finish("w", p_hat, q_new)


@pytest.mark.parametrize("codec", ["qsgd:4", "topk:0.25", "bf16"])
def test_codec_messages_in_flight_stay_within_the_window(codec):
    """One rank (gloo, world 1), eight linear layers, a bucket each: as the backward
    launches them, a windowed codec holds at most ``in_flight`` buckets' messages (weak
    references to each), and its gradients equal those of every message decoded at
    ``finish()``, bit for bit. Catches messages kept until ``finish()`` -- the whole
    model's, n + 1 bytes an element under QSGD (16x the fp32 gradients at n = 64) -- and
    an early decode that changes a bit or skips a bucket."""
    import weakref

    import torch.distributed as dist

    from plait.dp_algos import compressed_grads as cg
    from plait.parallel.data_parallel import DataParallelConfig
    from plait.topology import Topology

    def run(in_flight: int, monkeypatch):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(8)])
        names = {id(p): n for n, p in model.named_parameters()}
        comp = cg.Compression(DPAlgoConfig(compress=codec), seed=0, names=names,
                              sender="dp0.tp0")  # fmt: skip
        topo = Topology.build(pp=1, dp=1, tp=1)
        cfg = DataParallelConfig(bucket_mb=32 * 32 * 4 / 2**20)
        reducer = comp.reducer(model, topo=topo, cfg=cfg)
        reducer.in_flight = in_flight
        messages, most = [], [0]

        def tracked(start):
            def call(self, *args):
                most[0] = max(most[0], sum(m() is not None for m in messages))
                out = start(self, *args)
                messages.append(weakref.ref(out[1]))  # the gathered messages / the wire
                return out

            return call

        monkeypatch.setattr(cg._Wire, "gather_start", tracked(cg._Wire.gather_start))
        monkeypatch.setattr(cg._Wire, "bf16_start", tracked(cg._Wire.bf16_start))
        grads = []
        for step in range(2):  # the second: top-k's estimates carried from the first
            comp.set_step(step)
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
            model(x).square().sum().backward()
            assert reducer.launched_by_hooks == 8
            reducer.finish()
            grads.append([p.grad.clone() for p in model.parameters()])
            reducer.zero_grad()
        monkeypatch.undo()
        return grads, most[0]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            windowed, most = run(2, mp)
        with pytest.MonkeyPatch.context() as mp:
            whole, most_whole = run(100, mp)
    finally:
        dist.destroy_process_group()
    assert most == 1  # alive as a new one is made: the one launched before it
    assert most_whole == 7  # the check sees them all when nothing is decoded early
    for a, b in zip(windowed, whole):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_codecs_encode_and_decode_a_chunk_at_a_time():
    """QSGD's and int8's encode and decode of a 64M-element gradient (fake tensors, no
    storage; PyTorch's MemTracker) hold the tensor, their outputs and one chunk's working
    set: under 8 bytes an element in all, where encoding the tensor whole held 21 (three
    fp32 copies of it and more) -- 16 GiB at a 1B-parameter table's gradient, in the
    backward. Catches an encode or decode of the whole tensor at once."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from plait.dp_algos.compression import ENCODE_CHUNK

    n = 64 * 2**20
    assert n >= 16 * ENCODE_CHUNK

    def peak(run) -> float:
        tracker = MemTracker()
        with tracker:
            run()
            snap = tracker.get_tracker_snapshot("peak")
        return sum(v["Total"] for v in snap.values()) / n

    with FakeTensorMode():
        x = torch.empty(n)
        qsgd, int8 = QSGD(4), Int8Sum(4)
        out = {}
        encode = peak(lambda: out.update(q=qsgd.encode(x, gen=torch.Generator().manual_seed(0))))
        decode = peak(lambda: qsgd.add_decoded(x, *out["q"]))

        def both():
            scales = int8.scales_of([x])
            int8.decode_into(int8.encode(x, scales, gen=torch.Generator()), scales, [x])

        summed = peak(both)
    assert encode < 8 and decode < 8 and summed < 8, (encode, decode, summed)
