"""Corpus -> tokenizer -> token cache -> deterministic global batches.

    ds = prepare(DataConfig(path="books/"))            # every rank may call it; one builds
    sampler = GlobalBatchSampler(ds.train, seq_len=256, global_batch=64, seed=0, name=ds.source)
    rows = sampler.local(step, dp_rank=dp_rank, dp=dp)  # (64 / dp, 257): inputs [:, :-1], targets [:, 1:]
    val = val_batches(ds.val, seq_len=256, batch=64, num_batches=4, name=ds.source)

One idea per file: ``corpus`` finds the documents, ``tokenizer`` turns text into ids,
``tokens`` builds and opens the on-disk cache, ``sampler`` cuts it into batches.
"""

from plait.data.sampler import (
    IGNORE_INDEX,
    GlobalBatchSampler,
    inputs_targets,
    val_batches,
    val_pairs,
)
from plait.data.tokenizer import ByteTokenizer, HFTokenizer
from plait.data.tokens import DataConfig, Dataset, prepare
from plait.errors import DataError

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "Dataset",
    "GlobalBatchSampler",
    "IGNORE_INDEX",
    "HFTokenizer",
    "inputs_targets",
    "prepare",
    "val_batches",
    "val_pairs",
]
