"""Bytes plait's eager step moves through memory-bound kernels, counted from the code that
runs, against the performance model's count for the same micro-batch.

    python benchmarks/stream_bytes.py [--model llama1b|gpt2] [--micro-batch 4]

One micro-batch's forward and backward of plait's model under bf16 autocast and the step's
weight casts, on fake tensors (no memory, no arithmetic: any size runs here), with every
operator PyTorch dispatches counted: the bytes of its tensor inputs and outputs, by
operator, views and metadata left out, matrix products and attention counted apart. The
RMSNorm takes CUDA's path (PyTorch's fused kernels; their meta functions serve the fake
tensors); everything else is the CPU's dispatch, which for these operators is CUDA's
too. Printed: the counted bytes against the model's (``LayerCost.kinds``' memory time for
every layer, the head's and the embedding's, times the hardware's elementwise bandwidth,
which is how the model turns bytes into seconds). With a GPU profile of the same step's
memory-bound time (``benchmarks/gpu_profile.py``), bytes over time is the bandwidth those
kernels reached.

The model's ``plait`` runtime now prices plait's blocks from this count
(``costs.stream_bytes``, ``layer_kernels`` "plait"): measured 2026-11-26, counted / model
1.01 for the ~1B llama (132.6 GB against 131.7) and 1.14 for GPT-2 (41.1 against 36.1: the
negative log-likelihood is charged its whole input here where its kernel reads one logit a
row, and the tied embedding's gradient sum). Before, the model counted one fused pass per
operation: x3.32 and x2.75.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import plait.model.transformer as transformer
from plait.layout import Layout
from plait.model.config import preset
from plait.parallel.tensor import weight_casts
from plait.sim import costs, get_hardware
from plait.sim.runtime import PROFILES
from plait.train.profiling import StreamBytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default="llama1b", choices=("llama1b", "gpt2"))
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--hardware", default="h200")
    args = ap.parse_args(argv)
    cfg = {"llama1b": preset("llama3.2-1b", vocab_size=256, seq_len=2048),
           "gpt2": preset("gpt2-124m", vocab_size=50304)}[args.model]  # fmt: skip
    transformer._fused_rms = lambda x: True  # CUDA's RMSNorm kernels, as a GPU runs them
    model = transformer.build_model(cfg, device="meta")
    count = StreamBytes()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        x = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.seq_len))
        with weight_casts(), torch.autocast("cpu", dtype=torch.bfloat16), count:
            model(x, x).mean().backward()
    memory = {k: v for k, v in count.bytes.items() if k not in ("gemm", "attention")}
    counted = sum(memory.values())
    layout = Layout(global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch,
                    dtype="bf16")  # fmt: skip
    hw, rt = get_hardware(args.hardware), PROFILES["plait"]
    seconds = dict(costs.layer_cost(cfg, layout, hw, rt).kinds)["memory"] * cfg.n_layers
    seconds += dict(costs.head_cost(cfg, layout, hw, rt).kinds)["memory"]
    seconds += dict(costs.embedding_cost(cfg, layout, hw).kinds)["memory"]
    model_bytes = seconds * hw.elementwise_bw
    print(f"{args.model}, one micro-batch of {args.micro_batch} x {cfg.seq_len} tokens, bf16: "
          f"memory-bound bytes counted {counted / 1e9:.1f} GB, the model's {model_bytes / 1e9:.1f} GB "
          f"(counted / model {counted / model_bytes:.2f})")  # fmt: skip
    for kind, b in sorted(memory.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {kind:32s} {b / 1e9:8.2f} GB in {count.calls[kind]:4d} calls")
    print(
        f"  (apart: GEMM operands {count.bytes['gemm'] / 1e9:.1f} GB, attention "
        f"{count.bytes['attention'] / 1e9:.1f} GB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
