"""Weighted mixtures of sources: ``--data web.parquet:0.7,code/:0.2,chat.jsonl:0.1``.

Each source is any ``--data`` of its own (a file or folder of text, JSON Lines, Parquet, a
``datasets`` folder, a token file), prepared on its own (its own token cache, its own
held-out tail) with one tokenizer for all. Weights are positive numbers, normalised to sum
to 1. A training sequence is a window of seq_len + 1 tokens of one source, cut as in
``sampler.py``; the mixed stream is a sequence of positions p = 0, 1, 2, ... and step k
takes positions [kG, (k+1)G), as the single-source sampler takes its permutation entries.

Which source position p reads: positions come in blocks of MIX_BLOCK = 65,536. Block b
holds exactly q_s positions of source s -- q is the largest-remainder apportionment of
MIX_BLOCK by the weights -- in the order of a permutation drawn from
``default_rng([seed, MIX_SALT, b])``. Over every whole block the shares are the weights to
within 1/65,536; over the first n < 65,536 positions of a block source s's count is
hypergeometric, spread no wider than binomial(n, w_s).

Which window: the c-th position of source s (c = b * q_s + its rank within block b) takes
entry c of that source's epoch permutations laid end to end, drawn from
``default_rng([seed, 1 + s, epoch])`` over its windows; a small source simply goes through
more epochs than a large one.

Worked example: weights 0.7 / 0.3 -> q = (45875, 19661). If block 0 begins with sources
1, 0, 0, 1, ..., position 0 is source 1's sequence 0, positions 1 and 2 source 0's
sequences 0 and 1, position 3 source 1's sequence 1; source 0's sequence c is window
perm_0,epoch(c // W_0)[c % W_0] of its W_0 windows.

Every row is a pure function of (seed, weights, the sources' token counts, seq_len,
position): no iterator state, so resuming is the step number, and the rows do not depend
on dp, tp or pp (only on how the global batch is cut, as in ``sampler.py``). The tokens
seen per source through a step are computed the same way (``tokens_seen``) and go to
``metrics.jsonl``.

Validation: the ``batch x num_batches`` evaluation rows are apportioned by the weights;
each source's rows are spread evenly over its own held-out tail (``val_batches``) and all
rows are interleaved in one fixed order.

Tokenizer: ``--tokenizer bpe`` (the default) trains one BPE on every text source, one
after another in the order listed, cached as ``cache_dir/mixbpe<V>-<digest>/tokenizer.json``;
the sources' caches are keyed by that file. Token-file sources need the tokenizer they
were made with (``--tokenizer PATH``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plait.data.sampler import (
    GlobalBatchSampler,
    _check_positive,
    _windows,
    dp_rows,
    val_pairs,
    with_targets,
)
from plait.data.sources import EXAMPLE, MIX_BLOCK, parse_sources  # noqa: F401 (and callers)
from plait.errors import DataError

MIX_SALT = 0x6D6978  # b"mix": keeps the block draws apart from the windows' draws


def apportion(n: int, weights) -> np.ndarray:
    """``n`` split by ``weights`` (summing to 1): floors, then one more each for the largest
    remainders (ties to the earlier source). apportion(10, [0.55, 0.45]) -> [6, 4]."""
    exact = np.asarray(weights, dtype=np.float64) * n
    out = np.floor(exact).astype(np.int64)
    short = n - int(out.sum())
    if short > 0:
        order = sorted(range(len(out)), key=lambda s: (-(exact[s] - out[s]), s))
        out[order[:short]] += 1
    return out


@dataclass(frozen=True, eq=False)
class Mixture:
    """Prepared sources and their weights (module docstring); what ``prepare`` returns for
    a mixture. ``train_sampler`` / ``val_set`` build the batches."""

    parts: tuple  # a tokens.Dataset per source
    names: tuple[str, ...]  # each source as the user wrote it
    weights: tuple[float, ...]  # normalised
    source: str  # "--data SPEC", for messages

    @property
    def tokenizer(self):
        return self.parts[0].tokenizer

    @property
    def num_documents(self) -> int:
        return sum(p.num_documents for p in self.parts)


class MixtureSampler:
    """The global batch of any step of a mixture, or a share of its rows: the interface of
    ``GlobalBatchSampler`` (module docstring), plus ``sources`` and ``tokens_seen``."""

    def __init__(self, parts, weights, *, seq_len: int, global_batch: int, seed: int,
                 names: tuple[str, ...]):  # fmt: skip
        _check_positive(seq_len=seq_len, global_batch=global_batch)
        if seed < 0:
            raise ValueError(f"--seed {seed}: must be >= 0")
        self.tokens = [p.train for p in parts]
        masks = [p.train_mask for p in parts]
        self.mask = None if all(m is None for m in masks) else tuple(masks)
        self.names, self.seq_len, self.global_batch, self.seed = names, seq_len, global_batch, seed
        self.num_windows = np.array([(len(t) - 1) // seq_len for t in self.tokens])
        for name, t, n in zip(names, self.tokens, self.num_windows):
            if n < 1:
                raise DataError(
                    f"--data source {name}: its training split has {len(t):,} tokens but a step "
                    f"needs seq_len+1 = {seq_len + 1}; use more text or a smaller --seq-len"
                )
        self.quota = apportion(MIX_BLOCK, weights)
        self._first = np.concatenate([[0], np.cumsum(self.quota)[:-1]])
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # memo only
        self._perms: dict[tuple[int, int], np.ndarray] = {}  # memo only

    def sources(self, step: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The source of each of rows [lo, hi) of step ``step``, shape (hi - lo,)."""
        return self._locate(step, lo, self.global_batch if hi is None else hi)[0]

    def batch(self, step: int) -> torch.Tensor:
        """Step ``step``'s global batch, (G, seq_len + 1) int64 (unmasked)."""
        return self._gather(*self._locate(step, 0, self.global_batch), masks=False)[0]

    def local_batch(self, step: int, *, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this dp rank's rows, as ``GlobalBatchSampler.local_batch``."""
        return self.rows(step, *dp_rows(self.global_batch, dp_rank, dp))

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of rows [lo, hi) of step ``step``; targets hold IGNORE_INDEX
        where a source's loss mask (instruction data) says no loss."""
        if not 0 <= lo <= hi <= self.global_batch:
            raise ValueError(f"rows [{lo}, {hi}) outside a global batch of {self.global_batch}")
        src, win = self._locate(step, lo, hi)
        rows, mask = self._gather(src, win, masks=self.mask is not None)
        return with_targets(rows, mask)

    def target_count(self, step: int) -> int:
        """Targets of step ``step``'s whole global batch that take a loss."""
        if self.mask is None:
            return self.global_batch * self.seq_len
        _, targets = self.rows(step, 0, self.global_batch)
        return int((targets >= 0).sum())

    def tokens_seen(self, step: int) -> dict[str, int]:
        """Tokens (seq_len per row) each source gave steps 0..``step``, by source name."""
        end = (step + 1) * self.global_batch
        block, offset = divmod(end, MIX_BLOCK)
        counts = block * self.quota
        if offset:
            counts = counts + np.bincount(self._block(block)[0][:offset], minlength=len(self.quota))
        return {n: int(c) * self.seq_len for n, c in zip(self.names, counts)}

    def _locate(self, step: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of rows [lo, hi) of step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        blocks, offsets = np.divmod(np.arange(step * self.global_batch + lo,
                                              step * self.global_batch + hi), MIX_BLOCK)  # fmt: skip
        src = np.empty(len(blocks), dtype=np.int64)
        seq = np.empty(len(blocks), dtype=np.int64)  # the source's own sequence number
        for b in np.unique(blocks):
            here = blocks == b
            labels, rank = self._block(int(b))
            src[here] = labels[offsets[here]]
            seq[here] = int(b) * self.quota[src[here]] + rank[offsets[here]]
        win = np.empty_like(seq)
        for s in np.unique(src):
            here = src == s
            epochs, offs = np.divmod(seq[here], self.num_windows[s])
            w = np.empty(len(offs), dtype=np.int64)
            for e in np.unique(epochs):
                w[epochs == e] = self._permutation(int(s), int(e))[offs[epochs == e]]
            win[here] = w
        return src, win

    def _gather(self, src: np.ndarray, win: np.ndarray, *, masks: bool):
        rows = torch.empty((len(src), self.seq_len + 1), dtype=torch.int64)
        mask = torch.ones_like(rows) if masks else None
        for s in np.unique(src):
            here = torch.from_numpy(src == s)
            starts = win[src == s] * self.seq_len
            rows[here] = _windows(self.tokens[s], starts, self.seq_len + 1)
            if masks and self.mask[s] is not None:
                mask[here] = _windows(self.mask[s], starts, self.seq_len + 1)
        return rows, mask

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``b``'s source of each position and each position's rank in its source."""
        if b not in self._blocks:
            if len(self._blocks) >= 2:  # a step spans at most two blocks unless G > MIX_BLOCK
                self._blocks.pop(next(iter(self._blocks)))
            rng = np.random.default_rng([self.seed, MIX_SALT, b])
            labels = rng.permutation(np.repeat(np.arange(len(self.quota)), self.quota))
            order = np.argsort(labels, kind="stable")  # by source, then by position
            rank = np.empty(MIX_BLOCK, dtype=np.int64)
            rank[order] = np.arange(MIX_BLOCK) - np.repeat(self._first, self.quota)
            self._blocks[b] = labels, rank
        return self._blocks[b]

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            mine = [k for k in self._perms if k[0] == s]
            if len(mine) >= 2:
                self._perms.pop(mine[0])
            rng = np.random.default_rng([self.seed, 1 + s, epoch])
            self._perms[key] = rng.permutation(self.num_windows[s])
        return self._perms[key]


def train_sampler(data, *, seq_len: int, global_batch: int, seed: int):
    """The training sampler of ``prepare``'s result: a GlobalBatchSampler of one source, a
    MixtureSampler of a Mixture."""
    if isinstance(data, Mixture):
        return MixtureSampler(data.parts, data.weights, seq_len=seq_len, global_batch=global_batch,
                              seed=seed, names=data.names)  # fmt: skip
    return GlobalBatchSampler(data.train, seq_len=seq_len, global_batch=global_batch, seed=seed,
                              name=data.source, mask=data.train_mask)  # fmt: skip


def val_set(data, *, seq_len: int, batch: int, num_batches: int) -> list:
    """The validation (inputs, targets) batches of ``prepare``'s result (module docstring
    for a mixture; ``val_pairs`` for one source)."""
    if not isinstance(data, Mixture):
        return val_pairs(data.val, data.val_mask, seq_len=seq_len, batch=batch,
                         num_batches=num_batches, name=data.source)  # fmt: skip
    _check_positive(batch=batch, num_batches=num_batches)
    inputs, targets = [], []
    for part, n in zip(data.parts, apportion(batch * num_batches, data.weights)):
        if n:
            (x, y), = val_pairs(part.val, part.val_mask, seq_len=seq_len, batch=int(n),
                                num_batches=1, name=part.source)  # fmt: skip
            inputs.append(x)
            targets.append(y)
    order = torch.from_numpy(np.random.default_rng(MIX_SALT).permutation(batch * num_batches))
    x, y = torch.cat(inputs)[order], torch.cat(targets)[order]
    return list(zip(x.split(batch), y.split(batch)))


def check_held_out(data, seq_len: int) -> None:
    """DataError (one line) when a held-out split is shorter than one sequence."""
    for part in getattr(data, "parts", (data,)):
        if len(part.val) < seq_len + 1:
            where = "--data" if part is data else part.source
            raise DataError(
                f"{where}: the held-out split has {len(part.val)} tokens but a sequence needs "
                f"{seq_len + 1}; give more text or a larger --val-fraction"
            )


def prepare_mixture(cfg, sources: list[tuple[str, float]], *, log: Callable[[str], None],
                    workers: int | None, prepare_source: Callable,
                    is_cached: Callable) -> Mixture:  # fmt: skip
    """Prepare each source with one tokenizer (module docstring): ``prepare_source`` and
    ``is_cached`` are ``tokens.prepare`` and ``tokens.cached`` (passed in: that module
    calls this one)."""
    tokenizer = cfg.tokenizer
    if tokenizer == "bpe":
        tokenizer = _shared_bpe_path(cfg, [p for p, _ in sources])
    subs = [dataclasses.replace(cfg, path=p, tokenizer=str(tokenizer)) for p, _ in sources]
    if not (Path(tokenizer).is_file() or tokenizer == "bytes") or not all(map(is_cached, subs)):
        _check_sources(cfg, sources)  # (every rank of a run opens caches that exist: no check)
    if cfg.tokenizer == "bpe":
        _train_shared_bpe(cfg, [p for p, _ in sources], Path(tokenizer), log)
    parts = []
    for path, weight in sources:
        log(f"data: source {path} (weight {weight:.3g})")
        sub = dataclasses.replace(cfg, path=path, tokenizer=tokenizer)
        parts.append(prepare_source(sub, log=log, workers=workers))
    return Mixture(parts=tuple(parts), names=tuple(p for p, _ in sources),
                   weights=tuple(w for _, w in sources), source=f"--data {cfg.path}")  # fmt: skip


def _check_sources(cfg, sources) -> None:
    """Refuse a source that cannot be read before any is prepared (nothing written)."""
    from plait.data import pretokenized
    from plait.data.corpus import find_corpus
    from plait.data.tokenizer import load_tokenizer

    vocab = None
    if cfg.tokenizer not in ("bpe", "bytes"):
        vocab = load_tokenizer(cfg.tokenizer).vocab_size
    elif cfg.tokenizer == "bytes":
        vocab = 256
    for path, _ in sources:
        if pretokenized.is_token_file(path):
            if cfg.tokenizer == "bpe":
                raise DataError(
                    f"--data {path}: holds token ids, so the mixture needs the tokenizer they "
                    "were made with: --tokenizer path/to/tokenizer.json"
                )
            tf = pretokenized.open_token_file(path)
            tok = type("Vocab", (), {"vocab_size": vocab})
            # the dtype now; the ids when the source is prepared (a scan of the file)
            pretokenized.check_vocab(tf, tok, shown=path, tok_name=cfg.tokenizer,
                                     max_id=lambda: -1)  # fmt: skip
        else:
            find_corpus(path, cfg.text_column).units()


def _shared_bpe_path(cfg, paths: list[str]) -> Path:
    """Where the BPE shared by these sources lives, keyed by their identities."""
    from plait.data.cache import cache_root
    from plait.data.corpus import find_corpus

    corpora = [find_corpus(p, cfg.text_column) for p in paths]
    key = {"format": 1, "vocab_size": cfg.vocab_size, "corpora": [c.identity() for c in corpora]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(cfg) / f"mixbpe{cfg.vocab_size}-{digest}" / "tokenizer.json"


def _train_shared_bpe(cfg, paths: list[str], path: Path, log: Callable[[str], None]) -> None:
    """One BPE trained on every text source in order, written to ``path`` once."""
    from plait.data.cache import exclusive, write_atomically
    from plait.data.corpus import find_corpus
    from plait.data.tokenizer import train_bpe

    if path.is_file():
        return
    folder = path.parent
    corpora = [find_corpus(p, cfg.text_column) for p in paths]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cache folder {folder.parent}: cannot create it ({e.strerror})")
    with exclusive(folder / ".lock", log):
        if not path.is_file():
            docs = itertools.chain.from_iterable(c.documents() for c in corpora)
            log(f"data: training one byte-level BPE of {cfg.vocab_size} ids on the "
                f"{len(corpora)} sources")  # fmt: skip
            tokenizer = train_bpe(docs, vocab_size=cfg.vocab_size)
            write_atomically(path, tokenizer.save)
