"""Communication-efficient data parallelism across processes: local SGD with H = 1 and
gossip on the complete graph are plain data parallelism (with a linear optimizer); bf16
compression stays within bf16 rounding of the plain all-reduce; every algorithm runs with
tp = 2 and with pp = 2 (the replica algorithms on the very curve of their tp = pp = 1 run,
the codecs with their replicas bit-identical); ZeRO composes hierarchically; resuming
continues each family exactly; every rank's bytes per step equal ``volume.py``'s formula
exactly; export reads the replicas' average.

Two process groups train everything (``run_cases``): world 2 (dp 2 references, the
equalities, the checkpoints resumed later in the group) and world 4 (dp 2 x tp 2, dp 2 x
pp 2, dp 4 gossip, ZeRO with shard groups). Tiny model (2 x 64), 8 steps.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from distributed import place_resume_checkpoint, run_workers
from numerics import loss_tol
from test_data_parallel import (
    assert_same_curve,
    make_data,
    read_metrics,
    resume_from,
    run_config,
    tiny,
)

from plait.dp_algos import volume
from plait.dp_algos.algorithm import ResumeError, Synchronous
from plait.dp_algos.config import DPAlgoConfig, compress_group, replicas_of
from plait.layout import Layout
from plait.topology import Topology

STEPS = 8
SAVE = 4  # checkpoint step of the runs that are resumed
ALGOS = {
    "local-sgd": DPAlgoConfig(algo="local-sgd", sync_every=3),
    "diloco": DPAlgoConfig(algo="diloco", sync_every=3, outer_lr=0.8, outer_momentum=0.5),
    "gossip": DPAlgoConfig(algo="gossip", topology="one-peer-exponential"),
    "bf16": DPAlgoConfig(compress="bf16"),
    "qsgd": DPAlgoConfig(compress="qsgd:8"),
    "topk": DPAlgoConfig(compress="topk:0.1"),
    "powersgd": DPAlgoConfig(compress="powersgd:2"),
    "int8": DPAlgoConfig(compress="int8"),
    # the sync's change in int8 (draws keyed by step, replica and tensor name)
    "local-int8": DPAlgoConfig(algo="local-sgd", sync_every=3, compress="int8"),
}
REPLICA_ALGOS = ("local-sgd", "diloco", "gossip")  # deterministic, layout-independent
SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "grad_clip": 0.0}
RESUMED = ("local-sgd", "diloco", "qsgd", "topk", "powersgd", "int8", "local-int8")
WARM = 3  # --compress-warmup of the warm-up cases
LOCAL_H4 = DPAlgoConfig(algo="local-sgd", sync_every=4)
LOCAL_H4_OPT = dataclasses.replace(LOCAL_H4, sync_optimizer_state=True)
LOCAL_H4_INT8 = dataclasses.replace(LOCAL_H4, compress="int8")
DILOCO_BF16 = dataclasses.replace(ALGOS["diloco"], compress="bf16")


def case(data, root: Path, name: str, algo: DPAlgoConfig, train=None, **layout):
    train = {"steps": STEPS, **(train or {})}
    cfg = run_config(data, root / name, train=train, **layout)
    return dataclasses.replace(cfg, dp_algo=algo)


def _local_shapes(cfg, topo) -> list[tuple[int, ...]]:
    from plait.model.transformer import build_model
    from plait.parallel.pipeline.stage import build_stage

    if cfg.layout.pp > 1:
        model = build_stage(cfg.model, cfg.layout, topo=topo, seed=0, device="meta")
    else:
        model = build_model(cfg.model, topo=topo, device="meta")
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def run_cases(rank, world, cases):
    """Worker: train every config in turn on one process group; rank 0 returns metrics
    and its parameter shapes, every rank its coordinates and its parameters' (shards')
    sums as the run ended (float64: equal sums of equal tensors are equal)."""

    from plait.train import loop

    captured = {}
    close = loop.Trainer.close

    def capture(self):
        # what the optimizer updates: the parameters, or this rank's ZeRO shards of them
        captured["sums"] = [t.detach().double().sum().item() for _, _, t in self.engine.shards()]
        captured["state"] = [t.double().sum().item() for _, p, _ in self.engine.shards()
                             for t in self.engine.shard_state(p)]  # fmt: skip
        close(self)

    loop.Trainer.close = capture
    step = loop.Trainer.step

    def counted_step(self, k):
        # the collectives over every rank that the step issues: its statistics all-reduce
        before = self.topo.stats.count("world")
        rec = step(self, k)
        captured.setdefault("world", []).append(self.topo.stats.count("world") - before)
        return rec

    loop.Trainer.step = counted_step
    results = []
    for cfg in cases:
        place_resume_checkpoint(rank, cfg)
        lay = cfg.layout
        topo = Topology.build(pp=lay.pp, dp=lay.dp, tp=lay.tp)
        loop.train(cfg, topo=topo)
        results.append(
            {
                "metrics": read_metrics(cfg.out) if rank == 0 else None,
                "shapes": _local_shapes(cfg, topo) if rank == 0 else None,
                "coords": (topo.pp_rank, topo.dp_rank, topo.tp_rank),
                "sums": captured["sums"],
                "state": captured["state"],
                "world_per_step": captured.pop("world"),
            }
        )
    return results


def _w2_cases(data, root):
    cases = {
        "dp-sgd": case(data, root, "dp-sgd", DPAlgoConfig(), train=SGD, dp=2),
        "local-h1-sgd": case(data, root, "local-h1", DPAlgoConfig(algo="local-sgd", sync_every=1),
                             train=SGD, dp=2),
        "complete-sgd": case(data, root, "complete", DPAlgoConfig(algo="gossip",
                                                                  topology="complete"),
                             train=SGD, dp=2),
        "dp": case(data, root, "dp", DPAlgoConfig(), dp=2),
    }  # fmt: skip
    for name, algo in ALGOS.items():
        save = {"save_every": SAVE} if name in RESUMED else None
        cases[name] = case(data, root, name, algo, train=save, dp=2)
    # the optimizer's state averaged at each sync, and its plain counterpart (H = 4: the
    # runs end right after a sync)
    cases["local-h4"] = case(data, root, "local-h4", LOCAL_H4, dp=2)
    cases["local-h4-opt"] = case(data, root, "local-h4-opt", LOCAL_H4_OPT, dp=2)
    cases["local-h4-int8"] = case(data, root, "local-h4-int8", LOCAL_H4_INT8, dp=2)
    cases["diloco-bf16"] = case(data, root, "diloco-bf16", DILOCO_BF16, dp=2)
    for name in ("topk", "powersgd"):  # plain all-reduce steps first
        warm = dataclasses.replace(ALGOS[name], compress_warmup=WARM)
        cases[f"{name}-warm"] = case(data, root, f"{name}-warm", warm, dp=2)
    for name in RESUMED:
        step = root / name / "checkpoints" / f"step-{SAVE:08d}"
        cases[f"resume-{name}"] = resume_from(
            case(data, root, f"resume-{name}", ALGOS[name], dp=2), step
        )
    return cases


def _w4_cases(data, root):
    cases = {}
    for name, algo in ALGOS.items():
        cases[f"tp2-{name}"] = case(data, root, f"tp2-{name}", algo, dp=2, tp=2)
        cases[f"pp2-{name}"] = case(data, root, f"pp2-{name}", algo, dp=2, pp=2)
    ring = DPAlgoConfig(algo="gossip", topology="ring")
    cases["dp4-ring"] = case(data, root, "dp4-ring", ring, train={"save_every": SAVE}, dp=4)
    cases["dp4-ring-pga"] = case(
        data, root, "dp4-ring-pga", dataclasses.replace(ring, global_avg_every=4), dp=4
    )
    step = root / "dp4-ring" / "checkpoints" / f"step-{SAVE:08d}"
    cases["resume-dp4-ring"] = resume_from(case(data, root, "resume-dp4-ring", ring, dp=4), step)
    # hierarchical: ZeRO inside replicas of 2 ranks, the algorithm across the 2 replicas
    cases["zero2-diloco"] = case(data, root, "zero2-diloco", ALGOS["diloco"], dp=4, zero=2,
                                 zero_shard_group=2, micro_batch_size=1)  # fmt: skip
    cases["zero3-topk"] = case(data, root, "zero3-topk", ALGOS["topk"], dp=4, zero=3,
                               zero_shard_group=2)  # fmt: skip
    cases["zero3-int8"] = case(data, root, "zero3-int8", ALGOS["int8"], dp=4, zero=3,
                               zero_shard_group=2)  # fmt: skip
    cases["zero3-plain"] = case(data, root, "zero3-plain", DPAlgoConfig(), dp=4, zero=3,
                                zero_shard_group=2)  # fmt: skip
    cases["zero2-local-h4-opt"] = case(data, root, "zero2-local-h4-opt", LOCAL_H4_OPT, dp=4,
                                       zero=2, zero_shard_group=2, micro_batch_size=1)  # fmt: skip
    warm = dataclasses.replace(ALGOS["topk"], compress_warmup=WARM)
    cases["zero3-topk-warm"] = case(data, root, "zero3-topk-warm", warm, dp=4, zero=3,
                                    zero_shard_group=2)  # fmt: skip
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_algos")
    data = make_data(root)
    w2 = _w2_cases(data, root)
    w2_ranks = run_workers(2, run_cases, list(w2.values()))
    w4 = _w4_cases(data, root)
    w4_ranks = run_workers(4, run_cases, list(w4.values()))
    return {
        "w2": (w2, dict(zip(w2, zip(*w2_ranks)))),
        "w4": (w4, dict(zip(w4, zip(*w4_ranks)))),
    }


def _curve(ranks) -> list[dict]:
    """Rank 0's metrics records (``loss`` and ``grad_norm`` per step)."""
    return ranks[0]["metrics"]


def _losses(ranks) -> list[float]:
    return [m["loss"] for m in _curve(ranks)]


def assert_same_loss(got: list[dict], ref: list[dict], what: str) -> None:
    """The loss column within ``numerics``' float32 bound (step n: n times step 1's). For
    runs whose gradient norm means another thing: a replica's own against plain data
    parallelism's global one."""
    cfg = tiny("gpt2")
    tol = loss_tol(cfg, 8 * cfg.seq_len)
    assert len(got) == len(ref), what
    for g, r in zip(got, ref):
        a, b, n = g["loss"], r["loss"], g["step"]
        assert abs(a - b) <= n * tol * abs(b), (what, n, a, b, abs(a - b) / abs(b), n * tol)


def test_one_collective_over_every_rank_per_step(runs):
    """Every step of every algorithm and layout issues exactly one collective over the
    whole world: the statistics all-reduce (loss, bubble, each replica's |g|^2, every
    rank's peak memory), the step's one host synchronisation. Catches a second reduce for
    the replicas' own gradient norms or for peak memory (both were separate before)."""
    for world in ("w2", "w4"):
        cases, ranks = runs[world]
        for name, per_rank in ranks.items():
            for r in per_rank:
                assert set(r["world_per_step"]) == {1}, (name, r["world_per_step"])


def test_local_sgd_h1_and_complete_gossip_are_plain_data_parallelism(runs):
    """With SGD (a linear update) and no clipping, averaging the replicas after every step
    is stepping with the averaged gradient; and the complete graph mixes to the exact
    average. Same curve as plain dp 2 (DESIGN.md section 3's gate)."""
    _, res = runs["w2"]
    ref = _curve(res["dp-sgd"])
    assert ref[-1]["loss"] < ref[0]["loss"]
    for name in ("local-h1-sgd", "complete-sgd"):
        assert_same_loss(_curve(res[name]), ref, name)
        sums = [r["sums"] for r in res[name]]
        assert sums[0] == sums[1], name  # replicas equal bit for bit


def test_bf16_compression_within_bf16_rounding(runs):
    """The only difference from plain dp 2 is each gradient rounded to bfloat16 (unit
    roundoff u = 2^-8) before the sum and the sum rounded again: step 1's loss is
    identical (computed before any update), and the curves part by no more than the
    update's rounding allows: AdamW's update per element changes by at most ~2u relative
    to its size lr, so after t steps each weight is within 2 u lr t of the plain run;
    with the loss's Lipschitz constant over the weights L1 = |grad|_1 <= sqrt(n) |grad|
    the loss moves by at most L1 x that. We check the loss within 2u relative at every
    step (far looser than that bound needs here, far tighter than the codecs' own
    effect: QSGD's 8 levels move it by more)."""
    _, res = runs["w2"]
    ref, bf16, qsgd = _losses(res["dp"]), _losses(res["bf16"]), _losses(res["qsgd"])
    assert bf16[0] == ref[0]
    u = 2.0**-8
    for step, (a, b) in enumerate(zip(bf16, ref), start=1):
        assert abs(a - b) <= 2 * u * abs(b), (step, a, b)
    assert max(abs(a - b) for a, b in zip(qsgd, ref)) > max(abs(a - b) for a, b in zip(bf16, ref))


def test_int8_gradients_nearer_the_plain_curve_than_qsgd(runs):
    """``--compress int8`` on the per-step gradient: step 1's loss is the plain run's
    (computed before any update); after it the curve moves, but by less than QSGD with
    8 levels: both are unbiased, and int8's grid (the block's largest share over the
    ranks / 63 levels) is finer than QSGD's (the block's norm / 8)."""
    _, res = runs["w2"]
    ref, int8, qsgd = _losses(res["dp"]), _losses(res["int8"]), _losses(res["qsgd"])
    assert int8[0] == ref[0] and int8 != ref
    gap = max(abs(a - b) for a, b in zip(int8, ref))
    assert 0 < gap < max(abs(a - b) for a, b in zip(qsgd, ref))


def _expected_sent(cfg, shapes, step: int) -> float:
    if cfg.dp_algo.grad_codec is not None:
        n, _ = compress_group(cfg.layout)
    else:
        n, _ = replicas_of(cfg.layout)
        if cfg.dp_algo.algo == "allreduce":
            n = cfg.layout.dp
    return volume.step_volume(cfg.dp_algo, step=step, shapes=shapes, n=n).sent


@pytest.mark.parametrize("world", ["w2", "w4"])
def test_bytes_per_step_equal_the_formulas(runs, world):
    """Rank 0's ``dp_bytes_sent`` at every step equals ``volume.step_volume`` for its own
    tensors (its tp shards, its pipeline stage): exactly (groups of 2 and 4 ranks make the
    ring factors dyadic). ZeRO runs also move bytes inside their shard groups, which
    ``test_zero.py`` counts; they are left out here."""
    cases, res = runs[world]
    checked = 0
    for name, cfg in cases.items():
        if cfg.layout.zero:
            continue
        ranks = res[name]
        shapes = ranks[0]["shapes"]
        for m in ranks[0]["metrics"]:
            want = _expected_sent(cfg, shapes, m["step"] - 1)
            assert m["dp_bytes_sent"] == want, (name, m["step"], m["dp_bytes_sent"], want)
        checked += 1
    assert checked >= 14
    # the codecs send what they promise: >= 10x fewer bytes than the plain all-reduce
    _, w2 = runs["w2"]
    plain = w2["dp"][0]["metrics"][0]["dp_bytes_sent"]
    for name, ratio in (("bf16", 2), ("powersgd", 10), ("topk", 2.5), ("int8", 3.5)):
        assert w2[name][0]["metrics"][0]["dp_bytes_sent"] * ratio <= plain, name


def test_every_algorithm_with_tp2_and_pp2(runs):
    """The replica algorithms give the curve of their dp 2 run under tp 2 and pp 2 (the
    layout does not change their arithmetic). The codecs work on each rank's own tensors
    (a tp shard is compressed as a tensor of its own, QSGD draws per shard), so their
    curves are their own; for them: every dp rank of a (pp, tp) position ends with the
    same parameters bit for bit, and the loss falls."""
    w2_cases, w2 = runs["w2"]
    _, w4 = runs["w4"]
    for name in ALGOS:
        for lay in ("tp2", "pp2"):
            ranks = w4[f"{lay}-{name}"]
            curve = _losses(ranks)
            assert all(math.isfinite(x) for x in curve) and curve[-1] < curve[0], (lay, name)
            if name in REPLICA_ALGOS or (name, lay) == ("local-int8", "pp2"):
                # int8's draws and blocks follow whole tensors, which a pipeline cut keeps
                assert_same_curve(_curve(ranks), _curve(w2[name]), f"{lay}-{name}")
            elif name == "local-int8":  # tp shards are tensors of their own: own draws
                continue
            else:
                by_place = {}
                for r in ranks:
                    pp, _, tp = r["coords"]
                    by_place.setdefault((pp, tp), []).append(r["sums"])
                for place, sums in by_place.items():
                    assert all(s == sums[0] for s in sums), (lay, name, place)


def test_replicas_differ_between_synchronisations_and_meet_at_them(runs):
    """Consensus distance (at the last step): zero right after a local SGD / DiLoCo sync or
    a Gossip-PGA average, positive otherwise; the one-peer graph on 2 replicas is the exact
    average every step."""
    _, w2 = runs["w2"]
    _, w4 = runs["w4"]
    last = {name: r[0]["metrics"][-1] for name, r in {**w2, **w4}.items()}
    assert last["local-sgd"]["consensus_distance"] > 0  # step 8: 2 steps after a sync
    assert last["diloco"]["consensus_distance"] > 0
    assert last["gossip"]["consensus_distance"] == 0
    assert last["dp4-ring"]["consensus_distance"] > 0
    assert last["dp4-ring-pga"]["consensus_distance"] == 0  # step 8 averages
    assert "consensus_distance" not in last["bf16"]  # replicas identical: not measured
    # per-replica clipping: the replicas' parameters differ under local SGD between syncs
    sums = [r["sums"] for r in w2["local-sgd"]]
    assert sums[0] != sums[1]


def test_sync_optimizer_state_averages_adamw_moments_at_each_sync(runs):
    """``--sync-optimizer-state``: right after a sync (step 8, H = 4) the replicas hold the
    same parameters *and* the same AdamW moments, bit for bit (every rank divides the same
    all-reduced sum by R); without it only the parameters meet. Averaging the moments
    changes the next steps, so the curves part after the first sync (steps 1-5 equal:
    step 5's loss is computed before any step from averaged moments). Under ZeRO 2
    inside replicas of 2 ranks, the moments are this rank's shard of them: the same curve
    as on 2 plain replicas."""
    _, w2 = runs["w2"]
    _, w4 = runs["w4"]
    plain, opt = w2["local-h4"], w2["local-h4-opt"]
    assert plain[0]["sums"] == plain[1]["sums"] and opt[0]["sums"] == opt[1]["sums"]
    assert opt[0]["state"] == opt[1]["state"]
    assert plain[0]["state"] != plain[1]["state"]
    got, ref = _losses(opt), _losses(plain)
    assert got[:5] == ref[:5] and got[5:] != ref[5:]
    assert_same_curve(_curve(w4["zero2-local-h4-opt"]), _curve(opt), "zero2-local-h4-opt")


def test_compressed_syncs_meet_exactly_and_stay_near_the_fp32_sync(runs):
    """``--compress int8`` / ``bf16`` on local SGD / DiLoCo's sync. Local SGD H = 4, int8:
    steps 1-4 are local SGD's bit for bit (the first sync comes after step 4's loss), the
    replicas end bit-equal right after the sync of step 8 (every rank decodes the same
    all-reduced levels onto the same anchor), and the curve leaves the fp32 sync's after
    it, but stays near it: each sync moves every element by at most 1/s of its block's
    largest change (s = 127 // 2 = 63), so two syncs move the loss by about 2/63 of what
    the steps between them did; we allow 1/10 of the run's whole loss drop (3x that, for
    the loss's curvature). DiLoCo with its outer gradient in bf16: steps 1-3 equal, then
    within the bf16 test's bound (2u relative, u = 2^-8: here only the outer gradient, a
    small change, is rounded, not the weights)."""
    _, w2 = runs["w2"]
    int8, fp32 = w2["local-h4-int8"], w2["local-h4"]
    got, ref = _losses(int8), _losses(fp32)
    assert got[:4] == ref[:4] and got[4:] != ref[4:]
    assert int8[0]["sums"] == int8[1]["sums"]
    assert abs(got[-1] - ref[-1]) < abs(ref[-1] - ref[0]) / 10  # near it, still training
    got, ref = _losses(w2["diloco-bf16"]), _losses(w2["diloco"])
    assert got[:3] == ref[:3] and got != ref
    u = 2.0**-8
    assert all(abs(a - b) <= 2 * u * abs(b) for a, b in zip(got, ref)), (got, ref)


def test_zero_inside_replicas_the_algorithm_across(runs):
    """dp 4 = 2 replicas of 2 ZeRO-2 ranks running DiLoCo across: the curve of DiLoCo on
    2 plain replicas (each replica's batch and arithmetic are the same). ZeRO-3 with top-k
    across its shard groups: every group's ranks end equal to the other group's."""
    _, w2 = runs["w2"]
    _, w4 = runs["w4"]
    assert_same_curve(_curve(w4["zero2-diloco"]), _curve(w2["diloco"]), "zero2-diloco")
    for name in ("zero3-topk", "zero3-int8"):
        ranks = w4[name]
        curve = _losses(ranks)
        assert curve[-1] < curve[0], name
        by_shard = {}
        for r in ranks:  # dp ranks 0, 2 hold shard 0; 1, 3 shard 1
            by_shard.setdefault(r["coords"][1] % 2, []).append(r["sums"])
        for sums in by_shard.values():
            assert sums[0] == sums[1], name


def test_compress_warmup_is_the_plain_all_reduce_then_the_codec(runs):
    """``--compress-warmup 3``: steps 1-3 all-reduce the gradient as the plain run does
    (the same buffers summed by the same all-reduce), so the losses of steps 1-4 -- step
    4's computed after three plain updates -- equal the plain run's bit for bit, and step
    4's gradient is compressed: from step 5 on the curve leaves the plain one. Also across
    ZeRO-3 shard groups (``Across``), against the plain hierarchical run. The bytes of
    every step are checked against ``volume.py`` in ``test_bytes_per_step_...``."""
    _, w2 = runs["w2"]
    _, w4 = runs["w4"]
    for warm, plain, codec in ((w2["topk-warm"], w2["dp"], w2["topk"]),
                               (w2["powersgd-warm"], w2["dp"], w2["powersgd"]),
                               (w4["zero3-topk-warm"], w4["zero3-plain"], w4["zero3-topk"])):  # fmt: skip
        got, ref, cold = _losses(warm), _losses(plain), _losses(codec)
        assert got[: WARM + 1] == ref[: WARM + 1]
        assert cold[1] != ref[1]  # without the warm-up, step 1 is already compressed
        assert all(a != b for a, b in zip(got[WARM + 1 :], ref[WARM + 1 :]))
    sent = [m["dp_bytes_sent"] for m in _curve(w2["powersgd-warm"])]
    plain_sent = _curve(w2["dp"])[0]["dp_bytes_sent"]
    assert sent[:WARM] == [plain_sent] * WARM and max(sent[WARM:]) * 10 <= plain_sent


TIMING = ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_mem_bytes")


def test_resume_equals_uninterrupted(runs):
    """Saved at step 4 (replicas apart: local SGD and DiLoCo mid-period, the ring
    mid-mixing), resumed: steps 5-8 are the uninterrupted run's bit for bit -- every
    record but its timings, and every rank's parameters and optimizer state at the end --
    since the layout, the processes and the arithmetic are the same: every replica's
    parameters, optimizer, outer momentum and anchor, error-feedback buffers, PowerSGD's
    Q and QSGD's random stream come back. Catches any of them restored approximately
    (cast, re-derived, or redrawn), which the cross-layout tolerance would let through."""
    _, w2 = runs["w2"]
    _, w4 = runs["w4"]
    for name, res in [*((n, w2) for n in RESUMED), ("dp4-ring", w4)]:
        resumed, whole = res[f"resume-{name}"], res[name]
        got = [{k: v for k, v in m.items() if k not in TIMING} for m in _curve(resumed)]
        want = [{k: v for k, v in m.items() if k not in TIMING} for m in _curve(whole)[SAVE:]]
        assert [m["step"] for m in got] == list(range(SAVE + 1, STEPS + 1)), name
        assert got == want, name
        for key in ("sums", "state"):
            assert [r[key] for r in resumed] == [r[key] for r in whole], (name, key)


def test_checkpoint_keeps_every_replica_and_export_reads_their_average(runs):
    """A local SGD checkpoint taken between syncs holds both replicas under their own names
    and their mean under ``model/``, which ``plait export`` / ``generate`` load; the
    checkpoint verifies like any other."""
    import torch.distributed.checkpoint as dcp

    from plait.generate import load_model
    from plait.train import checkpoint

    cases, _ = runs["w2"]
    run = Path(cases["local-sgd"].out)
    cases["local-sgd"].save(run / "config.yaml")  # as plait train writes it
    path = checkpoint.latest(run / "checkpoints")
    assert checkpoint.verify(path) is None
    _, _, model = load_model(run)
    meta = checkpoint.read_meta(path)
    assert meta["dp_algo"]["algo"] == "local-sgd" and meta["dp_algo"]["replicas"] == 2
    differ = 0
    for name, p in model.named_parameters():
        keys = [f"replica-{r}/model/{name}" for r in range(2)]
        state = {k: torch.empty(p.shape) for k in keys}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        a, b = (state[k] for k in keys)
        assert torch.equal(p.detach(), (a + b) / 2), name
        differ += not torch.equal(a, b)
    assert differ > 0


def test_resuming_replicas_as_plain_data_parallelism_is_refused():
    algo = Synchronous(DPAlgoConfig(), topo=Topology.single(), layout=Layout())
    with pytest.raises(ResumeError) as e:
        algo.resume({"dp_algo": {"algo": "diloco", "replicas": 4}})
    assert "--dp-algo diloco" in str(e.value) and "\n" not in str(e.value)
    assert algo.resume({"dp_algo": {"algo": "allreduce"}}) == {"prefix": "", "extra": {}}
