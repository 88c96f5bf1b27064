"""Corpus -> tokenizer -> token cache -> deterministic global batches.

    ds = prepare(DataConfig(path="books/"))            # every rank may call it; one builds
    sampler = GlobalBatchSampler(ds.train, seq_len=256, global_batch=64, seed=0, name=ds.source)
    rows = sampler.local(step, dp_rank=dp_rank, dp=dp)  # (64 / dp, 257): inputs [:, :-1], targets [:, 1:]
    val = val_batches(ds.val, seq_len=256, batch=64, num_batches=4, name=ds.source)

    # any --data, a mixture "web.parquet:0.7,code/:0.3" included:
    sampler = train_sampler(prepare(cfg), seq_len=256, global_batch=64, seed=0)

One idea per file: ``corpus`` finds the documents (``columnar`` reads Parquet and Arrow),
``tokenizer`` turns text into ids, ``build`` tokenises on every core, ``tokens`` builds and
opens the on-disk cache, ``pretokenized`` maps token files as they are, ``sampler`` cuts a
stream into batches and ``mixture`` mixes several by weight. docs/data.md has the formats.
"""

import importlib

from plait.data.tokenizer import ByteTokenizer, HFTokenizer
from plait.data.tokens import DataConfig, Dataset, prepare
from plait.errors import DataError

# The batch side (torch tensors) loads on first use: a command that only reads its flags
# and the data's configuration (``plait train`` refusing bad input) does not wait for it.
_LAZY = {
    **dict.fromkeys(("Mixture", "MixtureSampler", "check_held_out", "train_sampler",
                     "val_set"), "plait.data.mixture"),
    **dict.fromkeys(("IGNORE_INDEX", "GlobalBatchSampler", "inputs_targets", "model_kwargs",
                     "val_batches", "val_pairs"), "plait.data.sampler"),
}  # fmt: skip


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plait.data' has no attribute {name!r}")


__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "Dataset",
    "GlobalBatchSampler",
    "IGNORE_INDEX",
    "HFTokenizer",
    "inputs_targets",
    "model_kwargs",
    "Mixture",
    "MixtureSampler",
    "check_held_out",
    "train_sampler",
    "val_set",
    "prepare",
    "val_batches",
    "val_pairs",
]
