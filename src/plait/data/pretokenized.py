"""Pre-tokenized token files, used as they are: no re-tokenising, no copy.

- nanoGPT ``.bin`` (``data/openwebtext/prepare.py``): the token ids back to back as
  little-endian uint16, each document followed by the tokenizer's end-of-text. There is no
  header, so the dtype is nanoGPT's: uint16.
- Megatron-LM indexed data, ``PREFIX.bin`` + ``PREFIX.idx`` (``tools/preprocess_data.py``;
  ``--data`` may name the .bin, the .idx or the PREFIX, as Megatron's ``--data-path`` does).
  The .idx (``megatron/core/datasets/indexed_dataset.py``), little-endian:

      b"MMIDIDX\\x00\\x00"  9 bytes    magic
      version           uint64     1
      dtype code        uint8      1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                   7 float32, 8 uint16
      sequence count S  uint64
      document count D  uint64     documents + 1
      lengths           int32 x S  tokens per sequence
      pointers          int64 x S  byte offset of each sequence in the .bin
      document indices  int64 x D  first sequence of each document, then S

  The .bin holds the sequences back to back in that dtype, so the whole file is the token
  stream. Documents carry an end-of-text only when ``--append-eod`` made them.

The stream is the file, memory-mapped: train is its head, the held-out split its tail
(``--val-fraction``, moved to a document start as for text). The vocabulary is checked
against ``--tokenizer`` once per (file, tokenizer) and remembered in the cache folder
``cache_dir/tokens-<tokenizer>-<digest>/meta.json``: the dtype must hold every id of the
vocabulary, and no id may be >= the vocabulary size (a file made with another tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.errors import DataError

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                   6: np.float64, 7: np.float32, 8: np.uint16}  # fmt: skip
NANOGPT_DTYPE = np.uint16
SCAN_TOKENS = 1 << 26  # the id check reads the file this many tokens at a time
META_FORMAT = 1


@dataclass(frozen=True)
class TokenFile:
    """A pre-tokenized file: its memory-mapped stream and what the header says."""

    kind: str  # "nanogpt" | "megatron"
    bin_path: Path
    tokens: np.ndarray  # read-only memory map, the whole stream
    num_documents: int | None  # Megatron's index knows; a nanoGPT file does not


def is_token_file(path: str) -> bool:
    """Whether ``--data`` names a .bin / .idx token file (or a Megatron PREFIX)."""
    p = Path(path).expanduser()
    if p.suffix in (".bin", ".idx") and p.is_file():
        return True
    return not p.exists() and p.with_name(p.name + ".idx").is_file()


def open_token_file(path: str) -> TokenFile:
    """Open ``--data PATH`` as a nanoGPT or Megatron token file (module docstring)."""
    p = Path(path).expanduser().resolve()
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    idx, bin_path = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if idx.is_file():
        if not bin_path.is_file():
            raise DataError(f"--data {path}: {idx.name} has no {bin_path.name} beside it")
        dtype, num_tokens, num_documents = _read_megatron_index(idx, bin_path, path)
        tokens = _memmap(bin_path, dtype, num_tokens)
        return TokenFile("megatron", bin_path, tokens, num_documents)
    size = p.stat().st_size
    if size == 0 or size % np.dtype(NANOGPT_DTYPE).itemsize:
        raise DataError(
            f"--data {path}: {size:,} bytes is not a whole number of uint16 token ids "
            "(nanoGPT's .bin); a Megatron .bin needs its .idx beside it"
        )
    tokens = _memmap(p, NANOGPT_DTYPE, size // 2)
    return TokenFile("nanogpt", p, tokens, None)


def _memmap(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def _read_megatron_index(idx: Path, bin_path: Path, shown: str) -> tuple[type, int, int]:
    """(dtype, tokens, documents) of a Megatron .idx, checked against its .bin's size."""
    with open(idx, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
            raise DataError(
                f"--data {shown}: {idx.name} is not a Megatron index (no MMIDIDX header)"
            )
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", head[9:])
        if version != 1 or code not in MEGATRON_DTYPES:
            raise DataError(f"--data {shown}: {idx.name} has version {version} and dtype code "
                            f"{code}; plait reads version 1, codes 1-8")  # fmt: skip
        lengths = np.fromfile(f, dtype="<i4", count=num_seqs)
    if len(lengths) != num_seqs:
        raise DataError(f"--data {shown}: {idx.name} is truncated ({len(lengths)} of "
                        f"{num_seqs} sequence lengths)")  # fmt: skip
    dtype = MEGATRON_DTYPES[code]
    num_tokens = int(lengths.sum(dtype=np.int64))
    expected = num_tokens * np.dtype(dtype).itemsize
    if bin_path.stat().st_size != expected:
        raise DataError(
            f"--data {shown}: {bin_path.name} has {bin_path.stat().st_size:,} bytes but its "
            f"index describes {num_tokens:,} {np.dtype(dtype).name} tokens ({expected:,} bytes)"
        )
    return dtype, num_tokens, max(num_docs - 1, 0)


def check_vocab(tf: TokenFile, tokenizer, *, shown: str, tok_name: str,
                max_id: Callable[[], int]) -> None:  # fmt: skip
    """DataError (one line) unless every id of ``tokenizer`` fits the file's dtype and the
    file's largest id (``max_id()``, computed only when the dtype fits) is below the
    vocabulary size."""
    dtype, vocab = tf.tokens.dtype, tokenizer.vocab_size
    if not np.issubdtype(dtype, np.integer):
        raise DataError(f"--data {shown}: holds {dtype.name} values, not token ids")
    if vocab - 1 > np.iinfo(dtype).max:
        fix = ("a nanoGPT .bin is uint16 by format; write the tokens as a Megatron .bin/.idx "
               "with int32" if tf.kind == "nanogpt" else "write it again with a wider dtype")  # fmt: skip
        raise DataError(
            f"--data {shown}: its {dtype.name} ids go up to {np.iinfo(dtype).max:,} but "
            f"--tokenizer {tok_name} has {vocab:,} ids; {fix}, or pass the tokenizer it was made with"
        )
    top = max_id()
    if top >= vocab:
        raise DataError(
            f"--data {shown}: holds token id {top:,} but --tokenizer {tok_name} has {vocab:,} "
            "ids; pass the tokenizer the file was made with"
        )


def scan_max_id(tokens: np.ndarray) -> int:
    """The largest id, reading SCAN_TOKENS at a time (constant memory); -1 when empty."""
    top, signed = -1, np.issubdtype(tokens.dtype, np.signedinteger)
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = np.asarray(tokens[start : start + SCAN_TOKENS])
        if signed and chunk.min() < 0:  # int32 files (Megatron's): a negative id is no token
            raise DataError(f"token {start + int(np.argmin(chunk)):,} is negative")
        top = max(top, int(chunk.max()))
    return top


def prepare(cfg, root: Path, *, log: Callable[[str], None]):
    """The Dataset of a pre-tokenized ``cfg.path``: checked once, then memory-mapped."""
    from plait.data.cache import Dataset, split_point
    from plait.data.tokenizer import ByteTokenizer, load_tokenizer

    shown = cfg.path
    if cfg.tokenizer == "bpe":
        raise DataError(
            f"--data {shown}: holds token ids, so give the tokenizer they were made with: "
            "--tokenizer path/to/tokenizer.json (or bytes)"
        )
    tokenizer = ByteTokenizer() if cfg.tokenizer == "bytes" else load_tokenizer(cfg.tokenizer)
    tf = open_token_file(shown)
    folder = root / _fingerprint(tf, cfg)
    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = None

    def max_id() -> int:
        if meta is not None:
            return meta["max_id"]
        log(f"data: checking the {len(tf.tokens):,} token ids of {shown} against the tokenizer")
        try:
            return scan_max_id(tf.tokens)
        except DataError as e:
            raise DataError(f"--data {shown}: {e}") from None

    check_vocab(tf, tokenizer, shown=shown, tok_name=cfg.tokenizer, max_id=max_id)
    if meta is None:  # remembered only once the file passed
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": META_FORMAT, "kind": tf.kind, "source": str(tf.bin_path),
                "dtype": tf.tokens.dtype.name, "num_tokens": len(tf.tokens),
                "num_documents": tf.num_documents, "max_id": max_id(),
                "vocab_size": tokenizer.vocab_size}  # fmt: skip
        tmp = meta_path.with_name(f"meta.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, meta_path)
    else:
        log(f"data: {shown} ({tf.kind}, {len(tf.tokens):,} tokens) was checked before")
    cut = split_point(tf.tokens, cfg.val_fraction, tokenizer.eot_id)
    return Dataset(
        tokenizer=tokenizer,
        train=tf.tokens[:cut],
        val=tf.tokens[cut:],
        cache_path=folder,
        fingerprint=folder.name,
        source=f"--data {shown}",
        num_documents=tf.num_documents or 0,
    )


def checked(cfg, root: Path) -> bool:
    """Whether ``cfg.path`` was checked against ``cfg.tokenizer`` before (meta.json)."""
    if cfg.tokenizer == "bpe":
        return False
    return (root / _fingerprint(open_token_file(cfg.path), cfg) / "meta.json").is_file()


def _fingerprint(tf: TokenFile, cfg) -> str:
    st = tf.bin_path.stat()
    tok = cfg.tokenizer
    if tok != "bytes":
        p = Path(tok).expanduser()
        p = p / "tokenizer.json" if p.is_dir() else p
        tok = hashlib.sha256(p.read_bytes()).hexdigest()
    key = {"format": META_FORMAT, "file": [str(tf.bin_path), st.st_size, st.st_mtime_ns],
           "tokenizer": tok}  # fmt: skip
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"tokens-{'bytes' if cfg.tokenizer == 'bytes' else 'tokfile'}-{digest}"
