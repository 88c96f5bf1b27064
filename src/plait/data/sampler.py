"""Deterministic global batches: step k's sequences depend only on (seed, tokens,
global_batch, seq_len), never on how the batch is split across data-parallel ranks or
micro-batches (DESIGN.md section 3).

The token stream is cut into non-overlapping windows of seq_len + 1 tokens; window i starts
at token i * seq_len, so window i's last token (a target) is window i+1's first (an input)
and every token is predicted exactly once per epoch. Epoch e visits the windows in the
order of a permutation drawn from ``numpy.random.default_rng([seed, e])``; step k takes the
entries [k*G, (k+1)*G) of the epoch permutations laid end to end.

Worked example: 1,000 tokens, seq_len 99 -> windows 0..9 (window 9 is tokens 891..990).
With G = 4, step 0 takes perm0[0:4], step 1 perm0[4:8], step 2 perm0[8:10] + perm1[0:2].

Resuming is therefore just the step number: there is no iterator state to checkpoint.

Loss masks (instruction data, ``instruct.py``): a stream may come with a 0/1 ``mask`` of
the same length, 1 where a token is a target the loss is taken on (a completion token).
``local_batch`` then returns the targets with ``IGNORE_INDEX`` wherever the mask is 0,
and ``target_count(step)`` is the number of targets the whole global batch takes a loss
on: every rank computes it from the same windows, so the global mean over unmasked
tokens needs no communication (without a mask it is global_batch * seq_len).
"""

from __future__ import annotations

import numpy as np
import torch

from plait.errors import DataError

# Targets that take no loss: PyTorch's cross-entropy default, and ``parallel.tensor``'s.
IGNORE_INDEX = -100


class GlobalBatchSampler:
    """The global batch of any step, or one data-parallel rank's rows of it.

    ``name`` (e.g. ``Dataset.source``) only appears in error messages.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        name: str = "--data",
        mask: np.ndarray | None = None,
    ):
        _check_positive(seq_len=seq_len, global_batch=global_batch)
        if seed < 0:
            raise ValueError(f"--seed {seed}: must be >= 0")
        if len(tokens) < seq_len + 1:
            raise DataError(
                f"{name}: the training split has {len(tokens):,} tokens but a step needs "
                f"seq_len+1 = {seq_len + 1}; use more text or a smaller --seq-len"
            )
        self.tokens, self.mask = tokens, mask
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len
        self._perms: dict[int, np.ndarray] = {}  # memo only: results never depend on it

    @property
    def steps_per_epoch(self) -> float:
        return self.num_windows / self.global_batch

    def window_ids(self, step: int) -> np.ndarray:
        """The window index of each of step ``step``'s ``global_batch`` rows, shape (G,)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, offsets = np.divmod(positions, self.num_windows)
        ids = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            ids[here] = self._permutation(int(epoch))[offsets[here]]
        return ids

    def batch(self, step: int) -> torch.Tensor:
        """Step ``step``'s global batch, (global_batch, seq_len + 1) int64: inputs are
        ``[:, :-1]``, targets ``[:, 1:]``."""
        return self._gather(self.window_ids(step))

    def local(self, step: int, *, dp_rank: int, dp: int) -> torch.Tensor:
        """Rows [dp_rank*G/dp, (dp_rank+1)*G/dp) of ``batch(step)``, gathering only those."""
        lo, hi = self._dp_rows(dp_rank, dp)
        return self._gather(self.window_ids(step)[lo:hi])

    def local_batch(self, step: int, *, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), (G/dp, T) each, of this dp rank's rows of step ``step``;
        targets hold ``IGNORE_INDEX`` where the mask (if any) says no loss."""
        return self.rows(step, *self._dp_rows(dp_rank, dp))

    def _dp_rows(self, dp_rank: int, dp: int) -> tuple[int, int]:
        return dp_rows(self.global_batch, dp_rank, dp)

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of rows [lo, hi) of step ``step``, gathering only those: a
        pipeline's share when the shares differ (a resilient run's pipelines take rows by
        their speed); targets masked as in ``local_batch``."""
        if not 0 <= lo <= hi <= self.global_batch:
            raise ValueError(f"rows [{lo}, {hi}) outside a global batch of {self.global_batch}")
        ids = self.window_ids(step)[lo:hi]
        mask = (
            None if self.mask is None else _windows(self.mask, ids * self.seq_len, self.seq_len + 1)
        )
        return with_targets(self._gather(ids), mask)

    def target_count(self, step: int) -> int:
        """Targets of step ``step``'s whole global batch that take a loss (module doc)."""
        if self.mask is None:
            return self.global_batch * self.seq_len
        starts = self.window_ids(step) * self.seq_len + 1  # a window's targets: tokens 1..T
        return int(_windows(self.mask, starts, self.seq_len).sum())

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most two epochs unless G > windows
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def _gather(self, window_ids: np.ndarray) -> torch.Tensor:
        return _windows(self.tokens, window_ids * self.seq_len, self.seq_len + 1)


def dp_rows(global_batch: int, dp_rank: int, dp: int) -> tuple[int, int]:
    """Rows [lo, hi) of the global batch that dp rank ``dp_rank`` of ``dp`` takes."""
    if dp < 1 or global_batch % dp:
        raise ValueError(f"--global-batch-size {global_batch} is not divisible by --dp {dp}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp})")
    per = global_batch // dp
    return dp_rank * per, (dp_rank + 1) * per


def val_batches(
    tokens: np.ndarray, *, seq_len: int, batch: int, num_batches: int, name: str = "--data"
) -> list[torch.Tensor]:
    """``num_batches`` validation batches of (batch, seq_len + 1), the same for every layout
    and every call.

    They use windows spread evenly over the whole split (the validation tail may hold
    several documents; the first few windows would only see the first). When the split
    has fewer windows than ``batch * num_batches``, windows repeat, evenly.
    """
    _check_positive(seq_len=seq_len, batch=batch, num_batches=num_batches)
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"{name}: the validation split has {len(tokens):,} tokens but needs at least "
            f"seq_len+1 = {seq_len + 1}; raise --val-fraction, use more text or a smaller --seq-len"
        )
    num_windows = (len(tokens) - 1) // seq_len
    total = batch * num_batches
    ids = np.arange(total, dtype=np.int64) * num_windows // total
    rows = _windows(tokens, ids * seq_len, seq_len + 1)
    return list(rows.split(batch))


def val_pairs(
    tokens: np.ndarray,
    mask: np.ndarray | None,
    *,
    seq_len: int,
    batch: int,
    num_batches: int,
    name: str = "--data",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``val_batches`` as (inputs, targets) pairs, masked like ``local_batch``."""
    rows = val_batches(tokens, seq_len=seq_len, batch=batch, num_batches=num_batches, name=name)
    if mask is None:
        return [with_targets(r, None) for r in rows]
    masks = val_batches(mask, seq_len=seq_len, batch=batch, num_batches=num_batches, name=name)
    return [with_targets(r, m) for r, m in zip(rows, masks)]


def with_targets(
    rows: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of windows (B, T+1); ``mask`` (B, T+1) marks the tokens that are
    targets (0: ``IGNORE_INDEX``)."""
    targets = rows[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return rows[:, :-1], targets


def inputs_targets(mb) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch as (inputs, targets): either windows (B, T+1) of the token stream
    (every next token a target) or an (inputs, targets) pair from ``local_batch`` -- or an
    (inputs, targets, documents) triple (``model_kwargs``)."""
    if isinstance(mb, torch.Tensor):
        return mb[:, :-1], mb[:, 1:]
    return mb[0], mb[1]


def model_kwargs(mb) -> dict:
    """The model's keywords beyond (inputs, targets) for a micro-batch: ``documents`` (B, s),
    the document ids of its whole sequences, when it carries them (--document-mask)."""
    if isinstance(mb, torch.Tensor) or len(mb) < 3:
        return {}
    return {"documents": mb[2]}


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    # One fancy-indexing gather from the memmap: reads only the pages the windows touch.
    index = starts[:, None] + np.arange(length, dtype=np.int64)  # (rows, length)
    return torch.from_numpy(np.asarray(tokens[index]).astype(np.int64))


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
