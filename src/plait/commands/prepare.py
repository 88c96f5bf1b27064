"""``plait prepare``: tokenise ``--data`` into the token cache ahead of training.

    plait prepare --data fineweb/ --tokenizer llama3/tokenizer.json
    plait prepare --data web.parquet:0.7,code/:0.3 --workers 8

``plait train`` does the same on its first run with the same data flags and reuses the
cache afterwards; preparing first lets a cluster job start training at once. Tokenising
uses every core (``--workers``), streams the files and resumes an interrupted build where
it stopped (``plait.data.build``). docs/data.md has the formats and the cache layout.

Communication: none (one machine; ``plait.data.build``'s worker processes are local).
Errors a user can cause print one line and return 2.
"""

from __future__ import annotations

import argparse

from plait.commands.common import die


def add_data_flags(g) -> None:
    """The flags that say what ``--data`` is (``train`` and ``prepare``)."""
    g.add_argument("--data", help="text file or folder, JSONL, Parquet file or folder, a "
                   "datasets folder, a .bin token file, or a mixture PATH:W,PATH:W; "
                   "default: embedded corpus")  # fmt: skip
    g.add_argument("--tokenizer", help="bpe | bytes | path/to/tokenizer.json")
    g.add_argument("--text-column", metavar="NAME",
                   help="the column (JSONL field) holding the documents (default text)")  # fmt: skip
    g.add_argument("--cache-dir")
    g.add_argument("--val-fraction", type=float)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("prepare", allow_abbrev=False, help="tokenise --data into the cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g = p.add_argument_group("data")
    add_data_flags(g)
    g.add_argument("--vocab-size", type=int,
                   help="ids of the BPE trained with --tokenizer bpe (train: the model's; 4096)")  # fmt: skip
    g.add_argument("--workers", type=int, help="tokenising processes (default: every core)")
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from plait.data import DataConfig, DataError, Mixture, prepare

    fields = {"path": args.data, "tokenizer": args.tokenizer, "cache_dir": args.cache_dir,
              "val_fraction": args.val_fraction, "text_column": args.text_column,
              "vocab_size": args.vocab_size}  # fmt: skip
    if args.workers is not None and args.workers < 1:
        return die("prepare", f"--workers {args.workers}: must be 1 or more")
    try:
        cfg = DataConfig(**{k: v for k, v in fields.items() if v is not None})
        print(f"plait: preparing data ({cfg.path or 'embedded corpus'}) ...", flush=True)
        data = prepare(cfg, log=lambda m: print(f"  {m}", flush=True), workers=args.workers)
    except (ValueError, DataError) as e:
        return die("prepare", str(e).strip().splitlines()[0])
    except KeyboardInterrupt:
        return die("prepare", "interrupted (SIGINT); run it again to resume", code=130)
    parts = data.parts if isinstance(data, Mixture) else (data,)
    names = data.names if isinstance(data, Mixture) else (cfg.path or "embedded corpus",)
    for name, part in zip(names, parts):
        print(f"plait: {name}: {len(part.train):,} training + {len(part.val):,} held-out "
              f"tokens, {part.num_documents:,} documents -> {part.cache_path}")  # fmt: skip
    print(f"plait: tokenizer of {data.tokenizer.vocab_size:,} ids", flush=True)
    return 0
