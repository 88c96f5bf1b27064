"""Fine-tuning across layouts: LoRA and quantisation-aware training on instruction data
under tensor, pipeline and ZeRO-3 data parallelism reproduce the single-process loss
curve; the frozen base comes out bit-identical; the base is never reduced or given
optimizer state.

One group of two workers trains every layout in turn (starting processes is the slow
part); the single-process references run in the test process.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from numerics import assert_same_run, loss_tol

from plait.data import DataConfig, prepare
from plait.layout import Layout
from plait.model.config import preset
from plait.model.lora import LoRAConfig, is_adapter
from plait.model.quant import QuantConfig
from plait.model.transformer import build_model
from plait.parallel.flat import shard_size
from plait.topology import Topology
from plait.train import checkpoint
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train

STEPS = 10
ALL = "q,k,v,o,up,down,gate"


def write_instructions(path: Path, n: int = 600, seed: int = 0) -> Path:
    """Prompt / completion pairs and chats (string tasks a tiny model can start to learn)."""
    rng = random.Random(seed)
    words = "ant bee cat dog eel fox gnu hen ibis jay kiwi lark mole newt owl".split()
    with path.open("w") as f:
        for i in range(n):
            w = [rng.choice(words) for _ in range(rng.randint(1, 3))]
            if i % 3:
                rec = {"prompt": f"reverse: {' '.join(w)}\n=> ", "completion": " ".join(w[::-1])}
            else:
                rec = {"messages": [{"role": "user", "content": f"upper {' '.join(w)}"},
                                    {"role": "assistant", "content": " ".join(w).upper()}]}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    return path


def model_cfg(arch: str):
    return preset("tiny", arch=arch, n_layers=2, hidden=32, n_heads=4, seq_len=32, vocab_size=256,
                  **({"n_kv_heads": 1} if arch == "llama" else {}))  # fmt: skip


def run_config(
    data, out: Path, arch: str, *, lora=None, qat=None, lr=2e-2, seen=False, **layout
) -> RunConfig:
    """``seen``: record traces (pipelines) and TensorBoard events, for the report."""
    dp = layout.get("dp", 1)
    Path(out).mkdir(parents=True, exist_ok=True)
    return RunConfig(
        model=model_cfg(arch),
        layout=Layout(global_batch_size=8, micro_batch_size=4 // dp, **layout),
        data=data,
        train=TrainConfig(
            steps=STEPS,
            lr=lr,
            warmup=2,
            eval_every=0,
            eval_batches=1,
            progress=False,
            peak_tflops=1.0,
            trace=seen and layout.get("pp", 1) > 1,
            tensorboard=seen,
        ),
        out=str(out),
        lora=lora,
        qat=qat,
    )


# name -> (arch, lora, qat, layout): every layout on two workers
LAYOUTS = {
    # tp: replicated kv heads (1 kv head, tp 2) and sequence parallelism, every target
    "lora-tp2-sp": ("llama", LoRAConfig(rank=4, alpha=8, targets=ALL), None,
                    dict(tp=2, sequence_parallel=True)),
    # pp: the tied embedding frozen on both ends; the zero-bubble split backward
    # (and its traces, TensorBoard events and the report drawn from them)
    "lora-pp2-zb": ("gpt2", LoRAConfig(rank=4, targets="q,v,o,up,down"), None,
                    dict(pp=2, schedule="zb-h1", seen=True)),
    # dp with ZeRO-3: adapters sharded, reduce-scattered; the base never
    "lora-dp2-z3": ("llama", LoRAConfig(rank=8, alpha=16, targets="q,v,o,down"), None,
                    dict(dp=2, zero=3)),
    # ZeRO-1 and -2: the adapters' gradients and AdamW state sharded, the base held whole
    "lora-dp2-z1": ("llama", LoRAConfig(rank=4, targets="q,k,o,gate"), None, dict(dp=2, zero=1)),
    "lora-dp2-z2": ("gpt2", LoRAConfig(rank=4, targets="v,up,down"), None, dict(dp=2, zero=2)),
    # QAT int8: a row-parallel channel's scale from both tp shards (all-reduce MAX)
    "qat8-tp2": ("llama", None, QuantConfig(dtype="int8"), dict(tp=2, lr=3e-3)),
}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("instruct")
    cfg = DataConfig(path=str(write_instructions(root / "train.jsonl")), tokenizer="bytes",
                     cache_dir=str(root / "cache"), val_fraction=0.05)  # fmt: skip
    prepare(cfg)
    return cfg


def _train_all(rank, world, runs):
    counts = {}
    for name, cfg in runs:
        lay = cfg.layout
        topo = Topology.build(pp=lay.pp, dp=lay.dp, tp=lay.tp)
        last = train(cfg, topo=topo)
        counts[name] = {
            "comm": {f"{a}.{o}": (n, topo.stats.bytes[(a, o)]) for (a, o), n in topo.stats.calls.items()},
            "state": last["model_state_bytes"],
        }  # fmt: skip
    counts["qat-shards"] = _qat_shards(world)
    return counts


def _qat_shards(tp: int) -> dict[str, float]:
    """In the workers: every block linear's fake-quantised tp shards, gathered, against
    the fake-quantised whole weight of one process (max difference per scheme)."""
    from plait.model.quant import apply_qat, quantized_layers
    from plait.parallel.tensor import shard_spec, tp_gather

    topo = Topology.build(pp=1, dp=1, tp=tp)
    out = {}
    for q in (QuantConfig(dtype="int8"), QuantConfig(dtype="int4", group_size=16)):
        cfg = model_cfg("llama")
        whole, split = build_model(cfg, seed=7), build_model(cfg, seed=7, topo=topo)
        apply_qat(whole, q)
        apply_qat(split, q)
        full, parts = quantized_layers(whole), quantized_layers(split)
        worst = 0.0
        with torch.no_grad():
            for name, layer in parts.items():
                fq = tp_gather(
                    layer.weight_quant(layer.weight), shard_spec(layer.weight), topo=topo
                )
                ref = full[name].weight_quant(full[name].weight)
                worst = max(worst, (fq - ref).abs().max().item())
        out[q.dtype] = worst
    return out


def metrics(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-runs")
    cfgs = {n: run_config(data, root / n, a, lora=lo, qat=q, **lay)
            for n, (a, lo, q, lay) in LAYOUTS.items()}  # fmt: skip
    lrs = {n: {"lr": lay["lr"]} if "lr" in lay else {} for n, (_, _, _, lay) in LAYOUTS.items()}
    # (the references record nothing: what is drawn is the parallel run)
    for cfg in cfgs.values():
        cfg.save(Path(cfg.out) / "config.yaml")  # what the launcher writes
    counts = run_workers(2, _train_all, list(cfgs.items()), timeout=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    refs = {}
    try:
        for name, (arch, lo, q, _) in LAYOUTS.items():
            ref = run_config(data, root / f"ref-{name}", arch, lora=lo, qat=q, **lrs[name])
            train(ref, topo=Topology.single())
            refs[name] = ref.out
    finally:
        torch.set_num_threads(threads)
    out = {n: (cfgs[n], [c[n] for c in counts], refs[n]) for n in LAYOUTS}
    out["qat-shards"] = [c["qat-shards"] for c in counts]
    return out


def final_state(cfg: RunConfig, out) -> dict[str, torch.Tensor]:
    from plait.model.lora import apply_lora

    model = build_model(cfg.model, seed=123)
    if cfg.lora:
        apply_lora(model, cfg.lora, arch=cfg.model.arch, seed=123)
    path = checkpoint.latest(Path(out) / "checkpoints")
    checkpoint.load(path, state=checkpoint.model_state(model), topo=Topology.single())
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(runs, name):
    """The numerics gate (``numerics.assert_same_run``: loss and gradient norm of step n
    within n times the float32 summation bound, derived from the model's reduction
    lengths). LoRA is held to it at every step (measured: under 1e-7 relative, below the
    1e-5 the issue asks for; 1e-5 itself is not derivable -- the bound for these models is
    ~6e-5 at step 1). QAT is held to it at step 1 (the same scales and fake-quantised
    weights in every layout, checked exactly below), later steps to 1e-3: rounding is
    discontinuous, so a weight that a 1e-7 summation-order difference moves across a
    rounding boundary changes by a whole quantisation step (measured: <= 1e-4 over these
    10 steps, up to 3e-2 after 20 steps at a 7x higher learning rate)."""
    cfg, _, ref = runs[name]
    got, want = metrics(cfg.out), metrics(ref)
    assert len(got) == len(want) == STEPS
    assert want[-1]["loss"] < want[0]["loss"] - 0.05, "the reference must learn something"
    tokens = cfg.layout.global_batch_size * cfg.model.seq_len  # the masked mean has fewer
    if cfg.qat is None:
        assert_same_run(got, want, cfg.model, tokens, name)
        tol = STEPS * loss_tol(cfg.model, tokens)
    else:
        assert_same_run(got[:1], want[:1], cfg.model, tokens, name)
        for g, w in zip(got[1:], want[1:]):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-3), (name, g["step"])
        tol = 1e-3
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=tol), name


@pytest.mark.slow
def test_qat_scales_are_those_of_the_whole_weight(runs):
    """Under tp 2 each shard's fake-quantised weight is exactly its slice of the whole
    weight's: int8 row-parallel channels take their maximum over both shards."""
    for per_rank in runs["qat-shards"]:
        assert per_rank == {"int8": 0.0, "int4": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith("lora")])
def test_lora_base_is_bit_identical_and_adapters_moved(runs, name):
    """Every layout's final checkpoint holds the initial base weights exactly, and
    adapters close to the single-process run's: within 1e-3 absolute (5% of the learning
    rate), because a coordinate whose gradient is near AdamW's eps -- A's gradient is
    exactly zero while B is, and tiny for a few steps after -- turns a summation-order
    difference of the gradient into an update that differs by a fraction of lr (the
    losses above agree to 1e-5; measured here: <= 3e-5)."""
    cfg, _, ref = runs[name]
    init = {
        k: v.detach() for k, v in build_model(cfg.model, seed=cfg.train.seed).named_parameters()
    }
    got, want = final_state(cfg, cfg.out), final_state(cfg, ref)
    adapters = [k for k in got if is_adapter(k)]
    assert adapters and set(got) == set(init) | set(adapters)
    for k, v in init.items():
        assert torch.equal(got[k], v), k
    assert any(
        not torch.equal(got[k], torch.zeros_like(got[k])) for k in adapters if k.endswith(".B")
    )
    for k in adapters:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-3, msg=k)


@pytest.mark.slow
def test_zero3_shards_the_base_and_reduces_only_adapters(runs):
    """ZeRO-3 with LoRA: the frozen base is sharded like the rest (each rank holds half,
    gathered per block on use) but never reduce-scattered and given no AdamW state: the
    dp reduce-scatter carries the adapters' gradients only (each padded to a multiple of
    dp) every micro-batch: at tp 1 no factor waits for a tp sum (until 2026-11-27 the
    factors beside split weights were deferred to once a step even here, fewer bytes
    than the model counts) -- and the model state is base/2 + 16 bytes x adapters/2."""
    from plait.model.lora import apply_lora

    cfg, per_rank, _ = runs["lora-dp2-z3"]
    model = build_model(cfg.model, device="meta")
    apply_lora(model, cfg.lora, arch=cfg.model.arch, seed=0)
    adapters = [p.numel() for p in model.parameters() if p.requires_grad]
    frozen = [p.numel() for p in model.parameters() if not p.requires_grad]
    for r in per_rank:
        _, nbytes = r["comm"]["dp.reduce_scatter"]
        once = STEPS * 4 * sum(2 * shard_size(n, 2) for n in adapters)
        m = cfg.layout.num_microbatches
        assert m == 2 and nbytes == m * once, (nbytes, once)
        held = 4 * sum(shard_size(n, 2) for n in frozen + adapters)  # rows, padded
        state = 4 * sum(shard_size(n, 2) for n in adapters) + 8 * sum(adapters) / 2
        assert r["state"] == pytest.approx(held + state, rel=0.01)
        # the base is gathered: every step moves at least the blocks' frozen weights twice
        _, gathered = r["comm"]["dp.all_gather"]
        assert gathered >= STEPS * 2 * 4 * sum(frozen) * 0.5


@pytest.mark.slow
def test_tp_sums_the_replicated_factors_once_per_step(runs):
    """LoRA under tp 2 (sequence parallel): besides the cross-entropy's two all-reduces per
    micro-batch, one all-reduce per step carries exactly the adapters' tp-partial factors
    (A beside column-parallel layers, B beside row-parallel ones) and the replicated key /
    value B's slots -- the frozen norms, which sequence parallelism would otherwise sum,
    are not in it. The bytes are counted from the model's sizes (lora.py's table), not
    from ``TPGradSync``'s lists: catches a sync that carries a frozen weight, misses a
    factor or sends a replicated key / value B in more slots than there are kv heads."""
    from plait.model.lora import apply_lora
    from plait.parallel.tensor import TPGradSync

    cfg, per_rank, _ = runs["lora-tp2-sp"]
    m, r = cfg.model, cfg.lora.rank
    assert len(cfg.lora.targets) == 7  # every target: q, k, v, o, up, down, gate
    assert m.n_kv_heads < cfg.layout.tp  # so each kv head is held by both tp ranks
    head_dim = m.hidden // m.n_heads
    # per block: A (r, hidden) beside each column-parallel q, k, v, up, gate; B (hidden, r)
    # beside each row-parallel o, down; and k's and v's B (head_dim, r) of a kv head both
    # ranks hold, summed in one slot per kv head
    numel = m.n_layers * (5 * r * m.hidden + 2 * m.hidden * r + 2 * m.n_kv_heads * head_dim * r)
    for tp_rank, res in enumerate(per_rank):
        topo = Topology(tp=2, rank=tp_rank)
        model = build_model(cfg.model, topo=topo, sequence_parallel=True, device="meta")
        apply_lora(model, cfg.lora, arch=cfg.model.arch, seed=0)
        sync = TPGradSync(list(model.parameters()), topo=topo)
        assert sync.partial and all(".lora." in n for n, p in model.named_parameters()
                                    if any(p is q for q in sync.partial))  # fmt: skip
        mb, tokens = 2, cfg.layout.micro_batch_size * cfg.model.seq_len  # per step, per mb
        ce_calls = 2 * mb * (STEPS + 1)  # training and the one evaluation batch
        calls, nbytes = res["comm"]["tp.all_reduce"]
        assert calls == ce_calls + STEPS
        assert nbytes == ce_calls // 2 * 12 * tokens + STEPS * 4 * numel


# --- seeing a run: TensorBoard, the report, the recorded timeline ---------------------------


def _ink(png: Path) -> float:
    """Fraction of pixels that are not (near) white: 0 for a blank image."""
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    return float((img.min(axis=-1) < 0.9).mean())


@pytest.mark.slow
def test_tensorboard_events_hold_every_metric(runs):
    """TensorBoard's own reader finds a scalar per numeric metric, per step, with the
    values of metrics.jsonl (stored as float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = runs["lora-pp2-zb"][0]
    acc = EventAccumulator(cfg.out)
    acc.Reload()
    recs = metrics(cfg.out)
    numeric = {k for r in recs for k, v in r.items()
               if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}  # fmt: skip
    assert {"loss", "val_loss", "mfu", "bubble_fraction"} <= numeric
    assert numeric <= set(acc.Tags()["scalars"])
    for key in numeric:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key


@pytest.mark.slow
def test_report_is_one_self_contained_page(runs, capsys):
    """``plait report``: one HTML file that needs nothing else (images inline, no script,
    no external link or stylesheet), with the curves, memory and collectives per rank, the
    recorded pipeline step and the config; and a PNG of the charts that is not blank."""
    import re

    from plait.cli import main

    cfg = runs["lora-pp2-zb"][0]
    assert main(["report", cfg.out]) == 0
    page = (Path(cfg.out) / "report.html").read_text()
    links = re.findall(r"(?:src|href)\s*=\s*[\"']([^\"']+)", page)
    assert len(links) == 2 and all(x.startswith("data:image/png;base64,") for x in links)
    assert "<script" not in page.lower() and "url(" not in page and "@import" not in page
    for needle in ("Pipeline timeline", "Memory per rank", "pp.send", "lora:", "zb-h1"):
        assert needle in page, needle
    assert _ink(Path(cfg.out) / "report.png") > 0.05
    assert "report.html" in capsys.readouterr().out


@pytest.mark.slow
def test_recorded_timeline_and_the_simulated_one(runs, tmp_path):
    """``plait viz timeline RUN --compare``: the recorded step holds the schedule's compute
    actions on each rank, in order, and is drawn above the simulator's step."""
    from plait.cli import main
    from plait.parallel.pipeline.schedules import build_schedule
    from plait.viz.recorded import recorded_step

    cfg = runs["lora-pp2-zb"][0]
    timeline, extras, info = recorded_step(Path(cfg.out))
    assert info["step"] == STEPS
    schedule = build_schedule("zb-h1", num_ranks=2, num_microbatches=cfg.layout.num_microbatches)
    for r in range(2):
        got = [a for a, _, _ in timeline.events[r] if a.is_compute]
        assert got == [a for a in schedule[r] if a.is_compute]
    assert any(extras.values())  # receives: time waiting on messages
    out = tmp_path / "t.png"
    assert main(["viz", "timeline", cfg.out, "--compare", "-o", str(out)]) == 0
    assert _ink(out) > 0.03
    no_traces = runs["lora-dp2-z3"][0].out
    assert main(["viz", "timeline", no_traces, "-o", str(out)]) == 2
