"""Tokenising throughput and peak memory of ``plait prepare`` against ``datasets.map``.

    python benchmarks/prepare_throughput.py --mb 200 --workers 2 [--compare-datasets]
    python benchmarks/prepare_throughput.py --mb 100 --workers 2   # the memory check's other size
    python benchmarks/prepare_throughput.py --mb 50 --workers 2 --rounds 3   # interleaved
    nice -n 10 python benchmarks/prepare_throughput.py --mb 4000 --bytes     # memory at 4 GB

``--rounds N`` measures on a shared machine: N rounds of plait and datasets.map on the
same slice (at least 40 MB: below 32 MB plait tokenises in one process), alternating
which goes first, and prints the ratio of the medians of their
tokens/s (and of their tokens per CPU-second of the whole process tree, which the other
jobs on the machine disturb less). ``--bytes`` tokenises with plait's bytes tokenizer
instead (plait only): the same streaming pipeline several times faster, for the memory
check at sizes the BPE cannot reach in the time.

Generates a Parquet corpus of ``--mb`` MB (rows drawn from the standard library's own
source files, in shards of 12.5 MB) and a byte-level BPE of 4096 ids trained on 8 MB of it, then
tokenises the corpus with the same tokenizer two ways, each in a fresh process:

- ``plait``: ``prepare`` with ``--workers`` processes into a fresh cache;
- ``datasets``: ``load_dataset("parquet")`` + ``.map(batched=True, num_proc=workers)``
  calling the same ``tokenizers.Tokenizer`` (``encode_batch``), the usual recipe.

It prints tokens/s, the CPU seconds of the process tree, the 1-minute load average before
and after, and peak memory: ``getrusage`` maxrss of the process and of its largest worker,
and, sampled from /proc every 0.2 s by the launching process, the VmHWM of the process and
of each worker and the largest sum of VmRSS over the tree. One JSON line per measurement
on stdout. Each measurement's cache is deleted after it; the corpus too unless ``--root``
was given (where an existing corpus of that size is reused).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def make_corpus(root: Path, mb: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.data.corpus import stdlib_files

    texts = [f.read_text(errors="replace") for f in stdlib_files()]
    folder = root / f"corpus{mb}"
    if (folder / "DONE").exists():
        return folder
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
    (folder / "DONE").touch()
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


def run_plait(corpus: Path, tokenizer: Path | str, cache: Path, workers: int) -> dict:
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
    tokenizer = args.tokenizer if args.tokenizer == "bytes" else Path(args.tokenizer)
    out = fn(Path(args.corpus), tokenizer, Path(args.cache), args.workers)
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    out.update(how=args.how, mb=args.mb, workers=args.workers,
               tokens_per_s=out["tokens"] / out["seconds"], peak_rss_mb_parent=round(me),
               peak_rss_mb_largest_worker=round(kids))  # fmt: skip
    print(json.dumps(out), flush=True)


class TreeMemory:
    """Samples /proc every ``period`` s: the VmHWM of ``pid`` and of each descendant (its
    peak so far, so a sample just before a process exits holds nearly all of it) and the
    largest sum of VmRSS over the tree."""

    def __init__(self, pid: int, period: float = 0.2):
        self.pid, self.period, self.hwm, self.tree_peak = pid, period, {}, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            total = 0
            for p in self._tree():
                try:
                    status = Path(f"/proc/{p}/status").read_text().splitlines()
                except OSError:
                    continue
                kb = {k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in status)
                      if k in ("VmHWM", "VmRSS")}  # fmt: skip
                if "VmHWM" in kb:
                    self.hwm[p] = max(self.hwm.get(p, 0), kb["VmHWM"])
                    total += kb["VmRSS"]
            self.tree_peak = max(self.tree_peak, total)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        workers = sorted((kb for p, kb in self.hwm.items() if p != self.pid), reverse=True)
        return {"vmhwm_mb_parent": round(self.hwm.get(self.pid, 0) / 1024),
                "vmhwm_mb_workers": [round(kb / 1024) for kb in workers[:8]],
                "peak_tree_rss_mb": round(self.tree_peak / 1024)}  # fmt: skip


def measure(how: str, corpus: Path, tokenizer: Path | str, root: Path, args) -> dict:
    """One measurement in a fresh process, with its CPU time, load and memory; its cache is
    deleted afterwards."""
    cache = Path(tempfile.mkdtemp(dir=root, prefix=f"cache-{how}-"))
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen([sys.executable, __file__, "--how", how, "--corpus", str(corpus),
                             "--tokenizer", str(tokenizer), "--cache", str(cache),
                             "--mb", str(args.mb), "--workers", str(args.workers)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    memory = TreeMemory(proc.pid)
    line = proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"the {how} measurement failed (exit {proc.returncode})")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(line.strip().splitlines()[-1])
    out["cpu_s"] = round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)
    out["tokens_per_cpu_s"] = round(out["tokens"] / out["cpu_s"])
    out.update(memory.finish(), load_before=round(load0, 1), load_after=round(os.getloadavg()[0], 1),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--compare-datasets", action="store_true")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleave plait and datasets.map this many rounds (module docstring)")  # fmt: skip
    p.add_argument("--bytes", action="store_true", help="plait with the bytes tokenizer only")
    p.add_argument("--root", default=None,
                   help="where the corpus goes, kept and reused (default: a temp dir, deleted)")  # fmt: skip
    p.add_argument("--how", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.how:
        return child(args)
    if args.bytes and (args.compare_datasets or args.rounds):
        p.error("--bytes measures plait alone; leave out --compare-datasets and --rounds")
    root = Path(args.root or tempfile.mkdtemp(prefix="plait-prepare-bench-"))
    try:
        corpus = make_corpus(root, args.mb)
        tokenizer = "bytes" if args.bytes else make_tokenizer(root)
        if args.rounds:
            return interleaved(corpus, tokenizer, root, args)
        for how in ["plait"] + (["datasets"] if args.compare_datasets else []):
            measure(how, corpus, tokenizer, root, args)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


def interleaved(corpus: Path, tokenizer: Path, root: Path, args) -> None:
    """Rounds of plait and datasets.map on the same slice, alternating the order."""
    runs = {"plait": [], "datasets": []}
    for r in range(args.rounds):
        for how in ("plait", "datasets") if r % 2 == 0 else ("datasets", "plait"):
            runs[how].append(measure(how, corpus, tokenizer, root, args))
    med = {how: {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "tokens_per_cpu_s")}
           for how, rs in runs.items()}  # fmt: skip
    print(json.dumps({"rounds": args.rounds, "mb": args.mb, "workers": args.workers,
                      "median_tokens_per_s": {h: round(m["tokens_per_s"]) for h, m in med.items()},
                      "ratio_of_medians_tokens_per_s": round(
                          med["plait"]["tokens_per_s"] / med["datasets"]["tokens_per_s"], 2),
                      "ratio_of_medians_tokens_per_cpu_s": round(
                          med["plait"]["tokens_per_cpu_s"] / med["datasets"]["tokens_per_cpu_s"], 2),
                      "loads": [[x["load_before"], x["load_after"]] for rs in runs.values() for x in rs]}),
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
