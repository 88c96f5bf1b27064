"""Corpus + tokenizer -> a token cache on disk -> the train and validation token streams.

``prepare(cfg)`` does the work once per (corpus, tokenizer) and every later call, in this
process or any other, memory-maps the result:

    cache_dir/<fingerprint>/
        tokenizer.json   the trained (or copied) tokenizer
        tokens.bin       every document's ids followed by the end-of-text id, back to back
        mask.bin         instruction data only: one uint8 per token, 1 where the loss is
                         taken (``instruct.py``)
        meta.json        written last: its presence means the folder is complete
        .lock            flock'ed while one process builds; the others wait, then reuse

While it is being built, ``tokens.bin.partial`` (``mask.bin.partial``) and
``tokens.progress.json`` hold the units tokenised so far, so a build that dies resumes where
it stopped (``build.py``); instruction data is built so too.

The fingerprint hashes the corpus identity (see ``Corpus.identity``) and the tokenizer
settings. Each file is written under a temporary name and renamed into place, so a crash
leaves either nothing or a complete file, never half of one. ``val_fraction`` is not part of
the fingerprint: the split is computed when the cache is opened, so changing it is free.

Two other kinds of ``--data`` bypass the corpus: pre-tokenized files, memory-mapped as they
are (``pretokenized.py``), and weighted mixtures of sources, each prepared as above
(``mixture.py``). A source the user got wrong (no such column, a damaged Parquet footer, a
token file the tokenizer cannot have made) is refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.data import build, instruct
from plait.data.cache import Dataset, cache_root, exclusive, split_point, write_atomically
from plait.data.corpus import DEFAULT_TEXT_COLUMN, Corpus, Unit, find_corpus
from plait.data.tokenizer import (
    EOT_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
)
from plait.errors import DataError

logger = logging.getLogger(__name__)

# Bump when the token stream for the same inputs changes (e.g. how documents are split).
CACHE_FORMAT = 1

Tokenizer = ByteTokenizer | HFTokenizer


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to train on and how to tokenise it. Read by ``prepare``."""

    # None: the embedded corpus; else a text file or folder, .jsonl, .parquet, a datasets
    # folder, a .bin token file, or a mixture "web.parquet:0.7,code/:0.3" (mixture.py)
    path: str | None = None
    tokenizer: str = "bpe"  # "bpe" | "bytes" | path to a tokenizer.json
    vocab_size: int = 4096  # for "bpe", the special token included
    val_fraction: float = 0.01  # held-out tail of the token stream (of each source)
    cache_dir: str | None = None  # None: ~/.cache/plait
    text_column: str = DEFAULT_TEXT_COLUMN  # of JSON Lines records and Parquet / Arrow tables

    def __post_init__(self) -> None:
        for name in ("path", "cache_dir"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise ValueError(f"DataConfig.{name}: expected a path, got {value!r}")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(
                f"--tokenizer {self.tokenizer!r}: use 'bpe', 'bytes' or a path to a tokenizer.json"
            )
        if self.tokenizer == "bpe" and (
            not isinstance(self.vocab_size, int) or not 257 <= self.vocab_size < 1 << 32
        ):
            raise ValueError(
                f"--vocab-size {self.vocab_size}: a byte-level BPE needs at least 257 ids "
                f"(256 bytes + {EOT_TOKEN}); try 4096"
            )
        if not isinstance(self.val_fraction, int | float) or not 0 <= self.val_fraction < 1:
            raise ValueError(
                f"--val-fraction {self.val_fraction}: must be in [0, 1); 0.01 holds out the "
                "last 1% of the tokens"
            )
        if not isinstance(self.text_column, str) or not self.text_column:
            raise ValueError(f"--text-column {self.text_column!r}: give a column name, e.g. text")
        if self.path is not None:
            from plait.data.sources import parse_sources

            parse_sources(self.path)  # a ValueError (one line) for a malformed mixture


def prepare(cfg: DataConfig, *, log: Callable[[str], None] | None = None,
            workers: int | None = None):  # fmt: skip
    """Discover, tokenise and cache the corpus once; later calls open the cache. Returns a
    Dataset, or a ``mixture.Mixture`` of them when ``cfg.path`` lists weighted sources.

    Safe to call from every worker at once: one builds under a file lock, the rest wait for
    it and reuse its result. ``workers``: tokenising processes (default: every core).
    Raises DataError (one line) for anything the user can fix.
    """
    from plait.data import mixture, pretokenized

    log = log or logger.info
    sources = mixture.parse_sources(cfg.path) if cfg.path is not None else None
    if sources is not None and len(sources) > 1:
        return mixture.prepare_mixture(cfg, sources, log=log, workers=workers,
                                       prepare_source=prepare, is_cached=cached)  # fmt: skip
    if sources is not None:  # "path:weight" of one source is that source
        cfg = dataclasses.replace(cfg, path=sources[0][0])
    if cfg.path is not None and pretokenized.is_token_file(cfg.path):
        return pretokenized.prepare(cfg, cache_root(cfg), log=log)
    corpus = find_corpus(cfg.path, cfg.text_column)
    fingerprint = _fingerprint(corpus, cfg)
    root = cache_root(cfg)
    folder = root / fingerprint
    if _complete(folder):
        log(f"data: reusing the token cache {folder}")
    else:
        units = corpus.units()  # refuses an unreadable source before anything is written
        fresh = not folder.exists()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cache folder {root}: cannot create it ({e.strerror}); set DataConfig.cache_dir "
                "to a writable folder"
            )
        with exclusive(folder / ".lock", log):
            if _complete(folder):  # another process built it while we waited
                log(f"data: reusing the token cache {folder}")
            else:
                try:
                    _build(folder, corpus, units, cfg, log, workers)
                except DataError:  # the data is wrong: keep nothing of this build
                    build.discard(folder / "tokens.bin")
                    if fresh:
                        _remove_folder(folder)
                    raise
    return _open(folder, corpus, cfg)


def cached(cfg: DataConfig) -> bool:
    """Whether ``prepare(cfg)`` of one source would only open a finished cache."""
    from plait.data import pretokenized

    try:
        if pretokenized.is_token_file(cfg.path):
            return pretokenized.checked(cfg, cache_root(cfg))
        return _complete(
            cache_root(cfg) / _fingerprint(find_corpus(cfg.path, cfg.text_column), cfg)
        )
    except (DataError, OSError):
        return False


def _remove_folder(folder: Path) -> None:
    for f in folder.iterdir():
        f.unlink(missing_ok=True)
    folder.rmdir()


def _fingerprint(corpus: Corpus, cfg: DataConfig) -> str:
    if cfg.tokenizer == "bpe":
        tok_key, tok_name = {"kind": "bpe", "vocab_size": cfg.vocab_size}, f"bpe{cfg.vocab_size}"
    elif cfg.tokenizer == "bytes":
        tok_key, tok_name = {"kind": "bytes", "eot_id": ByteTokenizer.eot_id}, "bytes"
    else:  # a tokenizer file: keyed by its content, wherever it lives
        p = Path(cfg.tokenizer).expanduser()
        p = p / "tokenizer.json" if p.is_dir() else p
        load_tokenizer(cfg.tokenizer)  # a DataError now rather than after the corpus walk
        tok_key, tok_name = {"kind": "file", "sha256": _sha256(p.read_bytes())}, "tokfile"
        if corpus.instruct and (chat := instruct.chat_template(cfg.tokenizer)):
            tok_key["chat_template"] = chat.digest  # it renders the conversations
    key = {"format": CACHE_FORMAT, "corpus": corpus.identity(), "tokenizer": tok_key}
    digest = _sha256(json.dumps(key, sort_keys=True).encode())[:16]
    return f"{corpus.kind}-{tok_name}-{digest}"  # readable in `ls ~/.cache/plait`


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _complete(folder: Path) -> bool:
    """A cache folder is usable when meta.json exists and tokens.bin has the size it states."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        if meta.get("mask") and (folder / "mask.bin").stat().st_size != meta["num_tokens"]:
            return False
        return (folder / "tokenizer.json").is_file() and (
            folder / "tokens.bin"
        ).stat().st_size == expected
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _build(folder: Path, corpus: Corpus, units: list[Unit], cfg: DataConfig,
           log: Callable[[str], None], workers: int | None) -> None:  # fmt: skip
    for leftover in folder.glob("*.tmp"):  # from a build that crashed
        leftover.unlink(missing_ok=True)
    tok_path = folder / "tokenizer.json"
    if tok_path.is_file():  # complete (it was renamed into place): a crash came after it
        tokenizer = load_tokenizer(tok_path)
    else:
        tokenizer = _make_tokenizer(corpus, cfg, log)
        write_atomically(tok_path, tokenizer.save)

    start = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    chat = instruct.chat_template(cfg.tokenizer) if corpus.instruct else None  # None: ours
    # resumable: tokens.bin.partial (and mask.bin.partial) until complete (build.py)
    counts = build.tokenise(corpus, units, tokenizer, dtype, folder / "tokens.bin",
                            workers=workers, log=log, chat=chat,
                            mask_out=folder / "mask.bin" if corpus.instruct else None)  # fmt: skip
    keys = ["num_tokens", "num_documents", "num_chars"]
    counts = {k: counts[k] for k in keys + ["num_trained_tokens"] * corpus.instruct}
    if counts["num_documents"] == 0:
        (folder / "tokens.bin").unlink()
        (folder / "mask.bin").unlink(missing_ok=True)
        raise DataError(f"{corpus.label}: no text found (every document is empty)")
    log(
        f"data: tokenised {counts['num_documents']:,} documents ({counts['num_chars'] / 1e6:.1f}M "
        f"characters) into {counts['num_tokens']:,} tokens in {time.perf_counter() - start:.1f} s"
    )
    meta = {
        "format": CACHE_FORMAT,
        "source": corpus.label,
        "tokenizer": cfg.tokenizer,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": np.dtype(dtype).name,
        "mask": corpus.instruct,
        **counts,
    }
    write_atomically(folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    log(f"data: token cache ready at {folder}")


def _make_tokenizer(corpus: Corpus, cfg: DataConfig, log: Callable[[str], None]) -> Tokenizer:
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if cfg.tokenizer != "bpe":
        return load_tokenizer(cfg.tokenizer)
    start = time.perf_counter()
    tokenizer = train_bpe(corpus.documents(), vocab_size=cfg.vocab_size)
    log(
        f"data: trained a byte-level BPE of {tokenizer.vocab_size} ids on {corpus.label} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    if tokenizer.vocab_size < cfg.vocab_size:
        log(
            f"data: the corpus only supports {tokenizer.vocab_size} of the {cfg.vocab_size} "
            "requested ids (too little text to learn more merges)"
        )
    return tokenizer


def _open(folder: Path, corpus: Corpus, cfg: DataConfig) -> Dataset:
    meta = json.loads((folder / "meta.json").read_text())
    tokenizer = load_tokenizer(folder / "tokenizer.json", flag="token cache")
    tokens = np.memmap(
        folder / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],)
    )
    cut = split_point(tokens, cfg.val_fraction, tokenizer.eot_id)
    mask = None
    if meta.get("mask"):
        mask = np.memmap(folder / "mask.bin", dtype=np.uint8, mode="r", shape=(meta["num_tokens"],))
    return Dataset(
        tokenizer=tokenizer,
        train=tokens[:cut],
        val=tokens[cut:],
        cache_path=folder,
        fingerprint=folder.name,
        source=corpus.label,
        num_documents=meta["num_documents"],
        train_mask=None if mask is None else mask[:cut],
        val_mask=None if mask is None else mask[cut:],
    )


__all__ = ["DataConfig", "Dataset", "cache_root", "cached", "prepare", "split_point"]
