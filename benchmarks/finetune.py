"""Fine-tuning a published model cheaply, and shrinking it: full fine-tuning against LoRA
(rank 8 and 16) from the same exported base on instruction data, then int8 / int4 export
and quantisation-aware training against post-training quantisation.

    python benchmarks/finetune.py [--base-steps 300] [--ft-steps 150] [--threads 2]

Everything goes through the ``plait`` command line, one worker process each:

1. a base model (``tiny`` preset, 4 x 128, BPE 4096) pretrained on the first 70% of the
   embedded corpus (the standard library's files, in sorted order), exported with
   ``plait export`` as a Hugging Face folder: the "published weights";
2. instruction data from the other 30% of the files, which the base never saw: for every
   function with a docstring, prompt = its signature and docstring, completion = its
   body (``ast``); the tail of the file is the held-out validation split;
3. fine-tuning from ``--init-hf BASE --tokenizer BASE`` with the loss on the completions
   only: full fine-tuning, LoRA r 8 and r 16 (q, k, v, o, up, down), same steps and batch;
4. ``plait export --quantize int8 / int4`` of the full fine-tune (size on disk,
   validation perplexity before and after), and the same recipe trained with
   ``--qat int4`` then exported with ``--quantize int4``.

Prints each figure it measured and a markdown table. Peak memory is the worker's peak
resident set (CPU), which includes PyTorch itself; model state is what the trainer
measures from the tensors (parameters, gradients, AdamW state). tokens/s is the median
over the steps after the first five.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["--model", "tiny", "--seq-len", "128"]  # 4 layers, hidden 128, 4 heads (gpt2)


def plait(*args, **kw) -> str:
    cmd = [sys.executable, "-m", "plait.cli", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode:
        raise SystemExit(f"plait {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def corpus_split(root: Path) -> tuple[Path, list[Path]]:
    """A folder with the first 70% of the embedded corpus (links), and the other files."""
    from plait.data.corpus import stdlib_files, stdlib_root

    files, stdlib = stdlib_files(), stdlib_root()
    cut = int(0.7 * len(files))
    base = root / "base-corpus"
    for f in files[:cut]:
        dst = base / f.relative_to(stdlib)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(f)
    return base, files[cut:]


def instructions(files: list[Path], out: Path, max_chars: int = 700) -> int:
    """docstring -> function body records from ``files``; returns how many."""
    n = 0
    with out.open("w") as f:
        for path in files:
            try:
                src = path.read_text()
                tree = ast.parse(src)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                doc = ast.get_docstring(node)
                if not doc or len(node.body) < 2:
                    continue
                head = f"def {node.name}({ast.unparse(node.args)}):\n"
                prompt = head + '    """' + doc.strip() + '"""\n'
                body = "\n".join(
                    "    " + line for s in node.body[1:] for line in ast.unparse(s).splitlines()
                )
                if len(prompt) + len(body) > max_chars:
                    continue
                f.write(json.dumps({"prompt": prompt, "completion": body + "\n"}) + "\n")
                n += 1
    return n


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def summary(run: Path, trainable: int) -> dict:
    m = metrics(run)
    tps = [r["tokens_per_s"] for r in m[5:]] or [r["tokens_per_s"] for r in m]
    val = [r["val_loss"] for r in m if "val_loss" in r]
    return {
        "val_loss_first": val[0],
        "val_loss": val[-1],
        "trainable_params": trainable,
        "model_state_mib": m[-1]["model_state_bytes"] / 2**20,
        "peak_rss_mib": max(r["peak_mem_bytes"] for r in m) / 2**20,
        "tokens_per_s": statistics.median(tps),
    }


def quantized(run: Path, out: Path, scheme: str) -> dict:
    plait("export", "--run", run, "--out", out, "--quantize", scheme)
    meta = json.loads((out / "quantization.json").read_text())
    return {
        "mib": (out / "quantized.safetensors").stat().st_size / 2**20,
        "ppl_float": meta["val_perplexity"]["float"],
        "ppl_quant": meta["val_perplexity"]["quantized"],
        "change": meta["perplexity_change"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--ft-steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", help="keep the runs in this folder")
    args = p.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="plait-ft-"))
    root.mkdir(parents=True, exist_ok=True)
    common = [*MODEL, "--threads", args.threads, "--no-progress", "--cache-dir", root / "cache"]
    t0 = time.perf_counter()
    base_corpus, held_out = corpus_split(root)
    data = root / "instructions.jsonl"
    n_examples = instructions(held_out, data)
    print(f"instruction data: {n_examples} docstring -> body examples from {len(held_out)} files")

    base_run, base_hf = root / "base", root / "base-hf"
    plait("train", *common, "--data", base_corpus, "--steps", args.base_steps,
          "--global-batch-size", 16, "--lr", 3e-3, "--warmup", 30, "--eval-every", 0,
          "--out", base_run)  # fmt: skip
    plait("export", "--run", base_run, "--out", base_hf)
    print(f"base: {args.base_steps} steps, val loss {metrics(base_run)[-1]['val_loss']:.3f} "
          f"({time.perf_counter() - t0:.0f} s so far)")  # fmt: skip

    ft = [*common, "--data", data, "--init-hf", base_hf, "--tokenizer", base_hf,
          "--val-fraction", 0.05, "--steps", args.ft_steps, "--global-batch-size", 16,
          "--warmup", 10, "--eval-every", max(args.ft_steps // 5, 1), "--eval-batches", 8]  # fmt: skip
    from plait.model.config import preset
    from plait.model.lora import LoRAConfig, num_adapter_params
    from plait.model.sizes import num_params

    cfg = preset("tiny", seq_len=128)
    targets = "q,k,v,o,up,down"
    variants = {
        "full": ([], 1e-3, num_params(cfg)),
        "lora-r8": (["--lora-rank", 8, "--lora-alpha", 16, "--lora-targets", targets], 3e-3,
                    num_adapter_params(cfg, LoRAConfig(rank=8, targets=targets))),
        "lora-r16": (["--lora-rank", 16, "--lora-alpha", 32, "--lora-targets", targets], 3e-3,
                     num_adapter_params(cfg, LoRAConfig(rank=16, targets=targets))),
        "full-qat-int4": (["--qat", "int4"], 1e-3, num_params(cfg)),
    }  # fmt: skip
    results = {}
    for name, (flags, lr, trainable) in variants.items():
        run = root / name
        plait("train", *ft, "--lr", lr, *flags, "--out", run)
        results[name] = {"lr": lr, **summary(run, trainable)}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    quant = {
        "full int8 (PTQ)": quantized(root / "full", root / "full-int8", "int8"),
        "full int4 (PTQ)": quantized(root / "full", root / "full-int4", "int4"),
        "full-qat-int4 int4": quantized(root / "full-qat-int4", root / "qat-int4", "int4"),
    }
    plait("export", "--run", root / "full", "--out", root / "full-hf")
    fp32 = (root / "full-hf" / "model.safetensors").stat().st_size / 2**20
    for name, q in quant.items():
        print(f"{name}: {json.dumps(q)}")

    print(f"\nbase val loss before fine-tuning (instruction val): "
          f"{results['full']['val_loss_first']:.3f} at the first evaluation")  # fmt: skip
    print("\n| run | lr | trainable params | val loss (completions) | model state MiB | "
          "peak RSS MiB | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['lr']:g} | {r['trainable_params']:,} | {r['val_loss']:.3f} | "
              f"{r['model_state_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['tokens_per_s']:,.0f} |")  # fmt: skip
    print(f"\nfp32 export model.safetensors: {fp32:.2f} MiB")
    print("\n| export | file MiB | val ppl float | val ppl quantised | change |")
    print("|---|---|---|---|---|")
    for name, q in quant.items():
        print(f"| {name} | {q['mib']:.2f} | {q['ppl_float']:.3f} | {q['ppl_quant']:.3f} | "
              f"{q['change']:+.2%} |")  # fmt: skip
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
