"""plait.data: corpus discovery, tokenizers, the token cache, and deterministic batches.

Small corpora written into tmp_path; only the discovery test looks at the real standard
library, and it does not tokenise it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import plait.data.corpus as corpus_mod
import plait.data.tokens as tokens_mod
from plait.data import DataConfig, DataError, GlobalBatchSampler, prepare, val_batches
from plait.data.corpus import STDLIB_EXCLUDED_DIRS, find_corpus, stdlib_files, stdlib_root
from plait.data.tokenizer import BYTES_EOT_ID, EOT_TOKEN, ByteTokenizer, train_bpe
from plait.data.tokens import split_point

TEXT = "def f(x):\n    return x + 1  # héllo wörld ✓\n\n"


def _cfg(tmp_path: Path, path: Path | str | None, **kw) -> DataConfig:
    return DataConfig(path=str(path) if path else None, cache_dir=str(tmp_path / "cache"), **kw)


def _corpus_folder(root: Path, num_files: int = 8) -> Path:
    """A folder of small Python-like files, varied enough for BPE to learn merges."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        body = "".join(
            f"def func_{i}_{j}(value_{j}):\n    return value_{j} * {i + j} + {j}  # ünïcode ✓\n"
            for j in range(60)
        )
        (root / f"mod_{i}.py").write_text(body)
    return root


# ---------------------------------------------------------------- discovery and loading


def test_stdlib_discovery_is_sorted_deterministic_and_excludes_tests():
    root = stdlib_root()
    files = stdlib_files()
    assert files == stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert {"os.py", "json/__init__.py", "asyncio/base_events.py"} <= set(rel)
    for r in rel:
        assert r.endswith(".py")
        assert not STDLIB_EXCLUDED_DIRS & set(r.split("/")[:-1]), r
    assert not any(r.startswith("test/") or "/idle_test/" in r for r in rel)
    size = sum(f.stat().st_size for f in files)
    assert 3e6 < size < 50e6, size  # ~12 MB on CPython 3.11
    assert find_corpus(None).files == tuple(files)


def test_folder_discovery_order_and_exclusions(tmp_path):
    data = tmp_path / "corpus"
    for rel, text in {
        "b.txt": "bee",
        "a/z.md": "zed",
        "a/y.py": "why",
        "c.jsonl": json.dumps({"text": "line one"}) + "\n" + json.dumps({"text": "two"}),
        ".hidden/x.txt": "hidden",
        "__pycache__/m.py": "cached",
        "image.png": "not text",
        "bin.txt": "\x00\x01binary",
        "empty.txt": "",
    }.items():
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text(text)
    corpus = find_corpus(str(data))
    rel = [f.relative_to(data).as_posix() for f in corpus.files]
    assert rel == ["a/y.py", "a/z.md", "b.txt", "bin.txt", "c.jsonl", "empty.txt"]
    logs = []
    assert list(corpus.documents(logs.append)) == ["why", "zed", "bee", "line one", "two"]
    assert any("binary" in m and "bin.txt" in m for m in logs)


def test_text_file_and_jsonl_with_bytes_tokenizer(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text(TEXT)
    ds = prepare(_cfg(tmp_path, f, tokenizer="bytes", val_fraction=0))
    expected = list(TEXT.encode()) + [BYTES_EOT_ID]
    assert ds.train.dtype == np.uint16 and isinstance(ds.train, np.memmap)
    assert ds.train.tolist() == expected and len(ds.val) == 0
    assert ds.num_documents == 1 and ds.tokenizer.vocab_size == 256

    j = tmp_path / "docs.jsonl"
    lines = [{"text": "alpha"}, {"text": ""}, {"text": "βeta", "id": 7}]
    j.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ds = prepare(_cfg(tmp_path, j, tokenizer="bytes", val_fraction=0))
    assert ds.tokenizer.decode(ds.train.tolist()) == "alpha\x03βeta\x03"
    assert ds.num_documents == 2


@pytest.mark.parametrize(
    "setup, expected",
    [
        (lambda d: d / "missing", r"--data .*missing: no such file or folder"),
        (lambda d: (d / "empty").mkdir() or d / "empty", r"no text found \(looked for \*\.txt"),
        (lambda d: _write(d / "e.txt", ""), r"e\.txt: the file is empty"),
        (lambda d: _write(d / "b.txt", "\x00\x00"), r"b\.txt: looks like a binary file"),
        (
            lambda d: _write(d / "f.jsonl", '{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n'),
            r"--data .*f\.jsonl line 3: no 'text' field",
        ),
        (lambda d: _write(d / "g.jsonl", '{"text": "a"}\n{oops\n'), r"g\.jsonl line 2: not valid"),
        (lambda d: _write(d / "h.jsonl", '{"text": 5}\n'), r"h\.jsonl line 1: 'text' is int"),
        (lambda d: _write(d / "w.txt", "   \n\n"), r"no text found \(every document is empty\)"),
    ],
)
def test_data_errors_are_one_line(tmp_path, setup, expected):
    path = setup(tmp_path)
    with pytest.raises(DataError, match=expected) as err:
        prepare(_cfg(tmp_path, path, tokenizer="bytes"))
    assert "\n" not in str(err.value)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_config_and_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="--vocab-size 100: .* at least 257"):
        DataConfig(vocab_size=100)
    DataConfig(vocab_size=100, tokenizer="bytes")  # vocab_size is only read for bpe
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="--val-fraction"):
            DataConfig(val_fraction=bad)
    with pytest.raises(ValueError, match="--tokenizer"):
        DataConfig(tokenizer="")
    f = _write(tmp_path / "t.txt", TEXT)
    with pytest.raises(DataError, match=r"--tokenizer /nope/tok\.json: no such file"):
        prepare(_cfg(tmp_path, f, tokenizer="/nope/tok.json"))
    blocked = DataConfig(path=str(f), tokenizer="bytes", cache_dir=str(f / "cache"))
    with pytest.raises(DataError, match=r"cache folder .*t\.txt/cache: cannot create it"):
        prepare(blocked)
    bad = _write(tmp_path / "bad.json", '{"model": 3}')
    with pytest.raises(DataError, match="--tokenizer .*bad.json: not a tokenizer.json"):
        prepare(_cfg(tmp_path, f, tokenizer=str(bad)))


def test_too_short_for_a_step_errors(tmp_path):
    tokens = np.arange(120, dtype=np.uint16)
    with pytest.raises(DataError, match=r"^--data f\.txt: .*120 tokens .* seq_len\+1 = 129"):
        GlobalBatchSampler(tokens, seq_len=128, global_batch=2, seed=0, name="--data f.txt")
    with pytest.raises(DataError, match=r"validation split has 120 tokens .* = 129"):
        val_batches(tokens, seq_len=128, batch=2, num_batches=1)


# ---------------------------------------------------------------- tokenizers


def test_bpe_and_bytes_round_trip(tmp_path):
    folder = _corpus_folder(tmp_path / "c", num_files=3)
    docs = [f.read_text() for f in sorted(folder.iterdir())]
    tok = train_bpe(docs, vocab_size=300)
    assert tok.vocab_size == 300 and tok.eot_id == 0
    samples = [TEXT, "  leading spaces\ttabs\r\n", "日本語 and emoji 🤖", ""]
    for s in samples:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(tok.encode(docs[0])) < len(docs[0].encode()) / 1.5  # merges were learned
    assert tok.encode(EOT_TOKEN) == [tok.eot_id]  # a prompt may hold the special token
    assert tok.eot_id not in tok.encode_batch([f"a{EOT_TOKEN}b"])[0]  # corpus text may not
    # what the cache builder calls: the same ids, back to back in the cache's dtype
    batch = [docs[0], f"a{EOT_TOKEN}b", "", docs[1]]
    ids, lengths = tok.encode_concat(batch, np.uint16)
    assert ids.dtype == np.uint16 and lengths.tolist() == [len(x) for x in tok.encode_batch(batch)]
    assert ids.tolist() == np.concatenate(tok.encode_batch(batch)).tolist()

    bt = ByteTokenizer()
    for s in samples:
        assert bt.decode(bt.encode(s)) == s
    assert bt.decode([0xFF, 0x41]) == "\ufffdA"


def test_saved_tokenizer_can_be_given_by_path(tmp_path):
    folder = _corpus_folder(tmp_path / "c", num_files=3)
    ds = prepare(_cfg(tmp_path, folder, vocab_size=300))
    ds.tokenizer.save(tmp_path / "tok.json")
    again = prepare(_cfg(tmp_path, folder, tokenizer=str(tmp_path / "tok.json")))
    assert again.fingerprint != ds.fingerprint
    assert np.array_equal(again.train, ds.train) and np.array_equal(again.val, ds.val)
    ByteTokenizer().save(tmp_path / "bytes.json")
    as_bytes = prepare(_cfg(tmp_path, folder, tokenizer=str(tmp_path / "bytes.json")))
    assert isinstance(as_bytes.tokenizer, ByteTokenizer)


# ---------------------------------------------------------------- the token cache


def test_cache_is_reused_and_keyed_on_inputs(tmp_path, monkeypatch):
    folder = _corpus_folder(tmp_path / "c", num_files=4)
    first = prepare(_cfg(tmp_path, folder, vocab_size=320, val_fraction=0.1))
    assert (first.cache_path / "tokenizer.json").is_file()
    assert sorted(p.name for p in first.cache_path.iterdir()) == [
        ".lock",
        "meta.json",
        "tokenizer.json",
        "tokens.bin",
    ]

    def boom(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(tokens_mod, "train_bpe", boom)
    monkeypatch.setattr(tokens_mod.build, "tokenise", boom)
    second = prepare(_cfg(tmp_path, folder, vocab_size=320, val_fraction=0.1))
    assert second.cache_path == first.cache_path
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    # val_fraction is applied on opening, so changing it reuses the cache too
    other = prepare(_cfg(tmp_path, folder, vocab_size=320, val_fraction=0.3))
    assert other.cache_path == first.cache_path and len(other.val) > len(first.val)

    # a different vocabulary, or an edited file, is a different cache
    monkeypatch.undo()
    assert prepare(_cfg(tmp_path, folder, vocab_size=300)).fingerprint != first.fingerprint
    f = folder / "mod_0.py"
    f.write_text(f.read_text() + "x = 1\n")
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert prepare(_cfg(tmp_path, folder, vocab_size=320)).fingerprint != first.fingerprint


def test_large_single_file_is_keyed_on_path_size_and_mtime(tmp_path, monkeypatch):
    f = _write(tmp_path / "a.txt", TEXT)
    assert "sha256" in find_corpus(str(f)).identity()
    monkeypatch.setattr(corpus_mod, "CONTENT_HASH_LIMIT", 10)
    identity = find_corpus(str(f)).identity()
    assert "sha256" not in identity and identity["files"][0][:2] == ["a.txt", len(TEXT.encode())]


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path):
    f = _write(tmp_path / "a.txt", TEXT * 20)
    ds = prepare(_cfg(tmp_path, f, tokenizer="bytes"))
    folder = ds.cache_path
    (folder / "meta.json").unlink()  # as if the build died before its last rename
    _write(folder / "tokens.bin.1234.tmp", "half")
    again = prepare(_cfg(tmp_path, f, tokenizer="bytes"))
    assert np.array_equal(again.train, ds.train)
    assert not list(folder.glob("*.tmp"))


def _prepare_in_child(cfg: DataConfig, barrier, queue) -> None:
    logs = []
    barrier.wait()
    ds = prepare(cfg, log=logs.append)
    queue.put((str(ds.cache_path), np.asarray(ds.train).tolist(), logs))


@pytest.mark.skipif(sys.platform != "linux", reason="uses fork to start quickly")
def test_concurrent_prepare_builds_once(tmp_path):
    folder = _corpus_folder(tmp_path / "c", num_files=6)
    cfg = _cfg(tmp_path, folder, vocab_size=400)
    # fork: the children inherit the imports (spawn would re-import torch, ~3 s each)
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(cfg, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (path_a, train_a, logs_a), (path_b, train_b, logs_b) = results
    assert path_a == path_b and train_a == train_b
    built = [any("token cache ready" in m for m in logs) for logs in (logs_a, logs_b)]
    assert sorted(built) == [False, True], (logs_a, logs_b)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(path_a).name]
    assert not list(Path(path_a).glob("*.tmp"))


def test_split_is_document_aligned():
    eot = 0
    tokens = np.array(([5] * 9 + [eot]) * 10, dtype=np.uint16)  # 10 docs of 10 tokens
    assert split_point(tokens, 0.1, eot) == 90
    tokens = np.array([5] * 87 + [eot] + [5] * 12, dtype=np.uint16)
    assert split_point(tokens, 0.1, eot) == 88  # nearest document start within 5 of 90
    assert split_point(np.full(100, 5, dtype=np.uint16), 0.1, eot) == 90  # no boundary: as is
    assert split_point(tokens, 0.0, eot) == 100


# ---------------------------------------------------------------- batches


def _stream(n: int = 10_000) -> np.ndarray:
    return (np.arange(n) % 50_000).astype(np.uint16)  # token value == position: easy checks


def test_batches_are_windows_and_deterministic():
    tokens = _stream()
    seq_len, g = 16, 8
    sampler = GlobalBatchSampler(tokens, seq_len=seq_len, global_batch=g, seed=3)
    b = sampler.batch(5)
    assert b.shape == (g, seq_len + 1) and b.dtype == torch.int64
    starts = b[:, 0].numpy()
    assert np.all(starts % seq_len == 0)
    assert torch.equal(b, torch.as_tensor(starts[:, None] + np.arange(seq_len + 1)))
    assert torch.equal(b, sampler.batch(5))
    assert torch.equal(b, GlobalBatchSampler(tokens, seq_len=16, global_batch=8, seed=3).batch(5))
    assert not torch.equal(
        b, GlobalBatchSampler(tokens, seq_len=16, global_batch=8, seed=4).batch(5)
    )
    assert not torch.equal(b, sampler.batch(6))


def test_local_slices_concatenate_to_the_global_batch():
    sampler = GlobalBatchSampler(_stream(), seq_len=16, global_batch=8, seed=0)
    for step in (0, 7, 123):
        full = sampler.batch(step)
        for dp in (1, 2, 4):
            parts = [sampler.local(step, dp_rank=r, dp=dp) for r in range(dp)]
            assert torch.equal(torch.cat(parts), full)
    with pytest.raises(ValueError, match="not divisible by --dp 3"):
        sampler.local(0, dp_rank=0, dp=3)


def test_resuming_is_just_the_step_number():
    tokens = _stream()
    a = GlobalBatchSampler(tokens, seq_len=10, global_batch=6, seed=1)
    history = [a.batch(k) for k in range(300)]  # crosses several epochs
    b = GlobalBatchSampler(tokens, seq_len=10, global_batch=6, seed=1)
    for k in (299, 250, 0, 171):
        assert torch.equal(b.batch(k), history[k])


def test_each_epoch_visits_every_window_once():
    tokens = _stream(1_000)  # (1000 - 1) // 9 = 111 windows
    sampler = GlobalBatchSampler(tokens, seq_len=9, global_batch=4, seed=0)
    w = sampler.num_windows
    assert w == 111
    stream = np.concatenate([sampler.window_ids(k) for k in range(3 * w // 4 + 1)])
    epochs = [stream[e * w : (e + 1) * w] for e in range(3)]
    for ids in epochs:
        assert sorted(ids.tolist()) == list(range(w))
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh order each epoch

    small = GlobalBatchSampler(tokens[:100], seq_len=9, global_batch=25, seed=0)  # 11 windows
    stream = np.concatenate([small.window_ids(0), small.window_ids(1)])  # spans 5 epochs
    for e in range(4):
        assert sorted(stream[e * 11 : (e + 1) * 11].tolist()) == list(range(11))


def test_val_batches_are_fixed_and_spread():
    tokens = _stream(1_000)
    a = val_batches(tokens, seq_len=9, batch=4, num_batches=3)
    b = val_batches(tokens, seq_len=9, batch=4, num_batches=3)
    assert len(a) == 3 and all(x.shape == (4, 10) for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    starts = torch.cat(a)[:, 0]
    assert starts.unique().numel() == 12 and starts.max() > 900  # spread over the split
    many = val_batches(tokens[:40], seq_len=9, batch=4, num_batches=2)  # 4 windows for 8 rows
    assert torch.cat(many)[:, 0].tolist() == [0, 0, 9, 9, 18, 18, 27, 27]
