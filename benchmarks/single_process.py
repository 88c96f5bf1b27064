"""plait's trainer against a plain PyTorch training loop, one process, same model and batch.

The plain loop is written here, nanoGPT-style: its own GPT module (fused q/k/v projection,
pre-norm blocks, tied embeddings), AdamW, gradient clipping, the same global batches. Both
run interleaved in this one process, several rounds; the figures are medians of per-step
times after warm-up. The goal is a tokens/s ratio >= 0.95 (the framework adds no overhead).

    python benchmarks/single_process.py [--rounds 3] [--steps 12] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from plait.data import DataConfig, GlobalBatchSampler, prepare
from plait.layout import Layout
from plait.model.config import preset
from plait.model.sizes import model_flops_per_token
from plait.topology import Topology
from plait.train.config import RunConfig, TrainConfig
from plait.train.loop import train
from plait.train.metrics import measure_cpu_peak_tflops


class PlainBlock(nn.Module):
    def __init__(self, h, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(
            PlainBlock(cfg.hidden, cfg.n_heads) for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plain_steps(cfg, sampler, steps, start, lr=1e-3):
    torch.manual_seed(0)
    model = PlainGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for step in range(start, start + steps):
        t0 = time.perf_counter()
        batch = sampler.batch(step)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times


def plait_steps(run_cfg: RunConfig, out: Path):
    train(run_cfg, topo=Topology.single())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records]


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="plait-bench-"))
    data_cfg = DataConfig(tokenizer="bytes")
    data = prepare(data_cfg)
    # DESIGN.md section 5's tiny GPT: 6 x 256, 2,048 tokens a step, fp32
    cfg = preset("tiny", n_layers=6, hidden=256, n_heads=8, seq_len=128,
                 vocab_size=data.tokenizer.vocab_size)  # fmt: skip
    layout = Layout(global_batch_size=16, micro_batch_size=16)
    sampler = GlobalBatchSampler(data.train, seq_len=cfg.seq_len, global_batch=16, seed=0)
    tokens = 16 * cfg.seq_len
    plait_t, plain_t = [], []
    for r in range(args.rounds):
        out = tmp / f"round{r}"
        run = RunConfig(
            model=cfg, layout=layout, data=data_cfg, out=str(out),
            train=TrainConfig(steps=args.steps, eval_every=0, eval_batches=1, progress=False,
                              save_every=0, keep_checkpoints=1, lr=1e-3, warmup=2),
        )  # fmt: skip
        out.mkdir(parents=True)
        plait_t += plait_steps(run, out)[args.warmup_steps :]
        plain_t += plain_steps(cfg, sampler, args.steps, 0)[args.warmup_steps :]
    plait_med, plain_med = statistics.median(plait_t), statistics.median(plain_t)
    flops = model_flops_per_token(cfg) * tokens
    peak = measure_cpu_peak_tflops("fp32", seconds=1.0) * 1e12
    result = {
        "threads": args.threads,
        "tokens_per_step": tokens,
        "plait_step_s": plait_med,
        "plain_step_s": plain_med,
        "plait_tokens_per_s": tokens / plait_med,
        "plain_tokens_per_s": tokens / plain_med,
        "tokens_per_s_ratio": plain_med / plait_med,
        "matmul_peak_tflops": peak / 1e12,
        "plait_mfu": flops / plait_med / peak,
        "plain_mfu": flops / plain_med / peak,
        "samples_per_impl": len(plait_t),
    }
    print(json.dumps(result, indent=1))
    print(
        f"plait {tokens / plait_med:,.0f} tok/s vs plain PyTorch {tokens / plain_med:,.0f} tok/s: "
        f"ratio {plain_med / plait_med:.3f} (goal >= 0.95); MFU plait {result['plait_mfu']:.1%} "
        f"of a measured {peak / 1e12:.3f} TFLOP/s matmul peak ({args.threads} threads)"
    )
    return 0 if math.isfinite(plait_med) else 1


if __name__ == "__main__":
    sys.exit(main())
