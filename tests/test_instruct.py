"""Instruction data (``plait.data.instruct``): the formats and their one-line errors, the
loss mask beside the token cache, the sampler's masked targets and global count, and the
completion-only loss against a masked mean computed by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plait.data import (
    IGNORE_INDEX,
    DataConfig,
    DataError,
    GlobalBatchSampler,
    prepare,
    val_pairs,
)
from plait.data.instruct import segments
from plait.model.config import preset
from plait.model.transformer import build_model
from plait.parallel.tensor import IGNORE_INDEX as TP_IGNORE
from plait.parallel.tensor import vocab_parallel_cross_entropy
from plait.topology import Topology
from plait.train.loop import LocalRunner, _split, autocast_factory

RECORDS = [
    {"prompt": "Q: 2+2?\n", "completion": "A: 4"},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "bye"},
                  {"role": "assistant", "content": "ciao"}]},
]  # fmt: skip


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_ignore_index_is_one_convention():
    assert IGNORE_INDEX == TP_IGNORE == -100  # F.cross_entropy's default


def test_segments_mark_the_answers():
    assert segments(RECORDS[0], "x") == [("Q: 2+2?\n", False), ("A: 4", True)]
    chat = segments(RECORDS[1], "x")
    assert "".join(t for t, _ in chat) == (
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello\n<|user|>\nbye\n"
        "<|assistant|>\nciao\n"
    )
    assert [t for t, trained in chat if trained] == ["hello\n", "ciao\n"]


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"prompt": "a"}', "'completion' missing"),
        ('{"prompt": "a", "completion": ""}', "empty 'completion'"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
        ('{"messages": []}', "non-empty list"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_records_are_one_line(tmp_path, line, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(RECORDS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=needle) as e:
        prepare(DataConfig(path=str(f), tokenizer="bytes", cache_dir=str(tmp_path / "c")))
    assert "line 2" in str(e.value) and "\n" not in str(e.value)


def test_instruction_records_in_a_folder_are_refused(tmp_path):
    (tmp_path / "docs").mkdir()
    _write(tmp_path / "docs" / "d.jsonl", RECORDS)
    with pytest.raises(DataError, match="pass that .jsonl file itself"):
        prepare(DataConfig(path=str(tmp_path / "docs"), tokenizer="bytes",
                           cache_dir=str(tmp_path / "c")))  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("instr")
    records = RECORDS * 150
    cfg = DataConfig(path=str(_write(root / "d.jsonl", records)), tokenizer="bytes",
                     cache_dir=str(root / "cache"), val_fraction=0.1)  # fmt: skip
    return prepare(cfg)


def test_mask_marks_the_answer_bytes_and_the_end(dataset):
    """Bytes tokenizer: ids are the text's bytes; the mask is 1 on "A: 4" and its
    end-of-text, on both assistant turns (with their newline) and the final end-of-text."""
    ids = np.asarray(dataset.train[:200]).astype(np.uint8).tobytes()
    mask = np.asarray(dataset.train_mask[:200]).astype(bool)
    trained = bytes(b for b, m in zip(ids, mask) if m)
    eot = bytes([dataset.tokenizer.eot_id])
    assert trained.startswith(b"A: 4" + eot + b"hello\nciao\n" + eot + b"A: 4" + eot)
    assert len(dataset.train_mask) == len(dataset.train) and len(dataset.val_mask) == len(
        dataset.val
    )


def test_sampler_masks_targets_and_counts_them_for_the_global_batch(dataset):
    sampler = GlobalBatchSampler(dataset.train, seq_len=24, global_batch=8, seed=0,
                                 mask=dataset.train_mask)  # fmt: skip
    for step in (0, 5):
        rows = sampler.batch(step)
        inputs, targets = sampler.local_batch(step, dp_rank=0, dp=1)
        assert torch.equal(inputs, rows[:, :-1])
        kept = targets != IGNORE_INDEX
        assert torch.equal(targets[kept], rows[:, 1:][kept])
        assert 0 < kept.sum() < kept.numel()
        assert sampler.target_count(step) == int(kept.sum())
        parts = [sampler.local_batch(step, dp_rank=r, dp=4)[1] for r in range(4)]
        assert torch.equal(torch.cat(parts), targets)
    plain = GlobalBatchSampler(dataset.train, seq_len=24, global_batch=8, seed=0)
    assert plain.target_count(0) == 8 * 24
    pairs = val_pairs(dataset.val, dataset.val_mask, seq_len=24, batch=4, num_batches=2)
    assert len(pairs) == 2 and all((t != IGNORE_INDEX).any() for _, t in pairs)


def test_completion_only_loss_is_the_masked_mean(dataset):
    """The trainer's loss (LocalRunner over two micro-batches, divided by the global count
    of trained targets) equals the mean cross-entropy over the answer tokens computed
    directly; and so does its gradient."""
    cfg = preset("tiny", n_layers=2, hidden=32, n_heads=4, seq_len=24, vocab_size=256)
    sampler = GlobalBatchSampler(dataset.train, seq_len=24, global_batch=8, seed=0,
                                 mask=dataset.train_mask)  # fmt: skip
    inputs, targets = sampler.local_batch(3, dp_rank=0, dp=1)
    model = build_model(cfg, seed=0)
    runner = LocalRunner(model, autocast=autocast_factory("fp32", torch.device("cpu")))
    loss = runner.train_step(_split((inputs, targets), 4), loss_scale=1.0,
                             tokens_global=sampler.target_count(3))  # fmt: skip
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_model = build_model(cfg, seed=0)
    logits = ref_model(inputs)  # (B, T, V)
    keep = targets != IGNORE_INDEX
    by_hand = F.cross_entropy(logits[keep], targets[keep])  # mean over the answer tokens
    by_hand.backward()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    for n, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_vocabulary_parallel_loss_ignores_masked_targets():
    """The vocabulary-parallel cross-entropy (here its padded-vocabulary path on one rank)
    gives ignored targets zero loss and zero gradient, as F.cross_entropy does."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g)
    targets = torch.tensor([1, IGNORE_INDEX, 3, IGNORE_INDEX, 7, 0])
    ours = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ours, targets, topo=Topology.single(), valid_vocab=9)
    ref = logits.clone().requires_grad_()
    padded = torch.cat([ref[:, :9], torch.full((6, 1), -float("inf"))], dim=1)
    want = F.cross_entropy(padded, targets, reduction="none")
    torch.testing.assert_close(loss, want)
    (loss * torch.arange(1.0, 7.0)).sum().backward()
    (want * torch.arange(1.0, 7.0)).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad)
    assert ours.grad[1].abs().sum() == 0 and ours.grad[3].abs().sum() == 0
