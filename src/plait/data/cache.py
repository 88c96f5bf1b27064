"""The token cache's building blocks, shared by every way ``--data`` is prepared
(``tokens.py`` for text, ``pretokenized.py`` for token files, ``mixture.py`` for weighted
sources): the prepared ``Dataset``, where caches live, the train / validation split, and
the file lock and atomic writes that let every worker of a run prepare at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.data.tokenizer import ByteTokenizer, HFTokenizer

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock, concurrent prepares are unsafe
    fcntl = None

Tokenizer = ByteTokenizer | HFTokenizer


@dataclass(frozen=True, eq=False)
class Dataset:
    """A prepared corpus: its tokenizer and its train / validation token streams.

    ``train`` and ``val`` are read-only memory maps (uint16 when the vocabulary fits, else
    uint32): opening a dataset costs nothing and every process shares the page cache.
    """

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    cache_path: Path
    fingerprint: str
    source: str  # how messages name the data, e.g. "--data books/"; pass as name= to samplers
    num_documents: int
    train_mask: np.ndarray | None = None  # instruction data: 1 where the loss is taken
    val_mask: np.ndarray | None = None


def cache_root(cfg) -> Path:
    """``--cache-dir``, or ~/.cache/plait (``cfg``: a ``DataConfig``)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache/plait"


@contextlib.contextmanager
def exclusive(lock_path: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold an flock on ``lock_path``. The kernel drops it if the holder dies, so a crashed
    builder never leaves the others waiting forever."""
    with open(lock_path, "a") as f:
        if fcntl is None:
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: another process is preparing {lock_path.parent}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def split_point(tokens: np.ndarray, val_fraction: float, eot_id: int | None) -> int:
    """Where validation starts: ``val_fraction`` of the tokens from the end, moved to the
    nearest document start within half the validation length so no document straddles
    the split (kept where it is when there is none, e.g. one long document).

    Worked example: 1,000 tokens, val_fraction 0.1 -> the cut is at 900; an end-of-text at
    index 880 moves it to 881 (val has 119 tokens), one at 960 would move it to 961.
    """
    n = len(tokens)
    num_val = round(n * val_fraction)
    cut = n - num_val
    if num_val == 0 or eot_id is None:
        return cut
    lo, hi = max(cut - num_val // 2, 0), min(cut + num_val // 2, n - 1)
    starts = np.flatnonzero(np.asarray(tokens[lo:hi]) == eot_id) + lo + 1
    if len(starts) == 0:
        return cut
    return int(starts[np.argmin(np.abs(starts - cut))])
