"""Tokenising throughput and peak memory of ``plait prepare`` against ``datasets.map``.

    python benchmarks/prepare_throughput.py --mb 200 --workers 2 [--compare-datasets]
    python benchmarks/prepare_throughput.py --mb 100 --workers 2   # the memory check's other size

Generates a Parquet corpus of ``--mb`` MB (rows drawn from the standard library's own
source files, in shards of 12.5 MB) and a byte-level BPE of 4096 ids trained on 8 MB of it, then
tokenises the corpus with the same tokenizer two ways, each in a fresh process:

- ``plait``: ``prepare`` with ``--workers`` processes into a fresh cache;
- ``datasets``: ``load_dataset("parquet")`` + ``.map(batched=True, num_proc=workers)``
  calling the same ``tokenizers.Tokenizer`` (``encode_batch``), the usual recipe.

It prints tokens/s and the peak resident memory (``getrusage`` maxrss) of the process and
of its largest worker. One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_corpus(root: Path, mb: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.data.corpus import stdlib_files

    texts = [f.read_text(errors="replace") for f in stdlib_files()]
    folder = root / f"corpus{mb}"
    folder.mkdir(parents=True, exist_ok=True)
    # shards of 12.5 MB whatever the size (200 MB: 16), so a larger corpus has more shards
    # of the same size, as a real one does: memory depends on the shard, not the corpus
    target, shards, done, i = mb * 1_000_000, max(1, round(mb / 12.5)), 0, 0
    for shard in range(shards):
        rows, size = [], 0
        while size < target / shards:
            t = texts[i % len(texts)]
            rows.append(t)
            size += len(t.encode())
            i += 1
        pq.write_table(pa.table({"text": rows}), folder / f"shard-{shard:03d}.parquet",
                       row_group_size=2000)  # fmt: skip
        done += size
    return folder


def make_tokenizer(root: Path) -> Path:
    from plait.data.corpus import stdlib_files
    from plait.data.tokenizer import train_bpe

    path = root / "tokenizer.json"
    if not path.exists():
        docs, size = [], 0
        for f in stdlib_files():
            docs.append(f.read_text(errors="replace"))
            size += len(docs[-1])
            if size > 8_000_000:
                break
        train_bpe(docs, vocab_size=4096).save(path)
    return path


def run_plait(corpus: Path, tokenizer: Path, cache: Path, workers: int) -> dict:
    from plait.data import DataConfig, prepare

    t0 = time.perf_counter()
    ds = prepare(DataConfig(path=str(corpus), tokenizer=str(tokenizer), cache_dir=str(cache)),
                 workers=workers, log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    seconds = time.perf_counter() - t0
    return {"tokens": len(ds.train) + len(ds.val), "seconds": seconds}


def run_datasets(corpus: Path, tokenizer: Path, cache: Path, workers: int) -> dict:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(str(tokenizer))

    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"])]}

    t0 = time.perf_counter()
    files = sorted(str(f) for f in corpus.glob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(cache))
    out = ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"])
    tokens = sum(len(x) for b in out.iter(batch_size=10_000) for x in b["ids"])
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds}


def child(args) -> None:
    """One measurement in this (fresh) process; prints its JSON line."""
    fn = run_plait if args.how == "plait" else run_datasets
    out = fn(Path(args.corpus), Path(args.tokenizer), Path(args.cache), args.workers)
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    out.update(how=args.how, mb=args.mb, workers=args.workers,
               tokens_per_s=out["tokens"] / out["seconds"], peak_rss_mb_parent=round(me),
               peak_rss_mb_largest_worker=round(kids))  # fmt: skip
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--compare-datasets", action="store_true")
    p.add_argument("--root", default=None, help="where the corpus goes (default: a temp dir)")
    p.add_argument("--how", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.how:
        return child(args)
    root = Path(args.root or tempfile.mkdtemp(prefix="plait-prepare-bench-"))
    corpus, tokenizer = make_corpus(root, args.mb), make_tokenizer(root)
    for how in ["plait"] + (["datasets"] if args.compare_datasets else []):
        cache = Path(tempfile.mkdtemp(dir=root, prefix=f"cache-{how}-"))
        subprocess.run([sys.executable, __file__, "--how", how, "--corpus", str(corpus),
                        "--tokenizer", str(tokenizer), "--cache", str(cache), "--mb", str(args.mb),
                        "--workers", str(args.workers)], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
