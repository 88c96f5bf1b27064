"""plait.data: the data people bring -- Parquet, datasets folders, nanoGPT and Megatron token
files, weighted mixtures, parallel resumable tokenising, and the one-line refusals.

Fixtures are generated in tmp_path (no downloads); the bytes tokenizer keeps them fast.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import plait.data.build as build_mod
import plait.data.corpus as corpus_mod
from plait.cli import main
from plait.data import DataConfig, DataError, MixtureSampler, prepare, train_sampler, val_set
from plait.data.mixture import MIX_BLOCK, apportion, parse_sources
from plait.data.tokenizer import ByteTokenizer

DOCS = [
    f"doc {i}: " + " ".join(f"wörd{(i * j) % 97}" for j in range(5 + i % 40)) for i in range(120)
]


def _cfg(tmp_path: Path, path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), tokenizer="bytes", **kw)


def _stream(ds) -> np.ndarray:
    return np.concatenate([np.asarray(ds.train), np.asarray(ds.val)]).astype(np.int64)


def _jsonl(path: Path, docs, field="text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def _megatron(prefix: Path, docs_ids: list[np.ndarray], dtype=np.uint16, code=8) -> Path:
    """A Megatron .bin/.idx pair written by the layout of indexed_dataset.py's _IndexWriter
    (one sequence per document)."""
    lengths = np.array([len(d) for d in docs_ids], dtype=np.int32)
    pointers = (
        np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    )
    np.concatenate(docs_ids).astype(dtype).tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1))
        f.write(lengths.tobytes() + pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return prefix.with_suffix(".bin")


# ------------------------------------------------------------------------------ formats


def test_each_format_gives_the_jsonl_token_stream(tmp_path):
    """Parquet (file, folder, another --text-column), a datasets save_to_disk folder (several
    Arrow shards), a nanoGPT .bin and a Megatron .bin/.idx all give the JSONL's stream.
    Catches a reader that drops, reorders or duplicates rows (row groups, shards, Arrow
    batches), reads the wrong column, or maps token files with the wrong dtype or offset."""
    datasets = pytest.importorskip("datasets")
    reference = _stream(prepare(_cfg(tmp_path, _jsonl(tmp_path / "d.jsonl", DOCS))))
    eot = 3  # the bytes tokenizer's end-of-text

    table = pa.table({"id": list(range(len(DOCS))), "content": DOCS})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=17)
    (tmp_path / "shards").mkdir()
    pq.write_table(table.slice(0, 50), tmp_path / "shards" / "part-000.parquet", row_group_size=9)
    pq.write_table(table.slice(50), tmp_path / "shards" / "part-001.parquet", row_group_size=9)
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(
        str(tmp_path / "saved"), max_shard_size="4KB"
    )
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 2
    ids = [np.frombuffer(d.encode(), dtype=np.uint8).astype(np.int64) for d in DOCS]
    with_eot = [np.append(i, eot) for i in ids]
    np.concatenate(with_eot).astype(np.uint16).tofile(tmp_path / "nano.bin")
    _megatron(tmp_path / "mega", with_eot)
    _jsonl(tmp_path / "content.jsonl", DOCS, field="content")

    cases = {
        "d.parquet": {"text_column": "content"},
        "shards": {"text_column": "content"},
        "saved": {},
        "nano.bin": {},
        "mega.bin": {},
        "mega.idx": {},
        "mega": {},  # the PREFIX, as Megatron's --data-path takes it
        "content.jsonl": {"text_column": "content"},
    }
    for name, kw in cases.items():
        ds = prepare(_cfg(tmp_path, tmp_path / name, **kw))
        assert np.array_equal(_stream(ds), reference), name
        assert ds.tokenizer.vocab_size == 256


def test_token_files_are_used_in_place_and_checked_once(tmp_path):
    """A token file is memory-mapped (no copy, no re-tokenising) and its ids are checked
    once per (file, tokenizer). Catches a cache that copies the file or rescans every start."""
    np.arange(1000, dtype=np.uint16).__mod__(250).astype(np.uint16).tofile(tmp_path / "t.bin")
    logs = []
    ds = prepare(_cfg(tmp_path, tmp_path / "t.bin"), log=logs.append)
    base = ds.train.base if ds.train.base is not None else ds.train
    assert isinstance(ds.train, np.memmap) or isinstance(base, np.memmap)
    assert any("checking the 1,000 token ids" in m for m in logs)
    logs.clear()
    prepare(_cfg(tmp_path, tmp_path / "t.bin"), log=logs.append)
    assert not any("checking" in m for m in logs) and any("checked before" in m for m in logs)
    assert not list((tmp_path / "cache").rglob("*.bin"))


# ------------------------------------------------------------------------------ bad input


def _big_vocab_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path))
    return path


@pytest.mark.parametrize(
    "case, needle",
    [
        ("corrupt_parquet", "bad.parquet: not a readable Parquet file"),
        ("truncated_parquet", "cut.parquet: not a readable Parquet file"),
        ("missing_column", "--text-column body: "),
        ("bin_dtype_too_small", "uint16 ids go up to 65,535 but --tokenizer"),
        ("bin_id_too_large", "holds token id 300 but --tokenizer bytes has 256 ids"),
        ("megatron_dtype_too_small", "uint8 ids go up to 255 but --tokenizer"),
        ("weight_zero", "the weight '0' of b.jsonl is not a positive number"),
        ("weight_negative", "the weight '-1' of b.jsonl is not a positive number"),
        ("weight_word", "the weight 'lots' of b.jsonl is not a positive number"),
        ("weight_missing", "b.jsonl has no weight"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path, capsys, monkeypatch, case, needle
):
    """Each bad input ends ``plait prepare`` with one stderr line naming the flag or file,
    exit code 2, and no cache written. Catches a traceback, a silent wrong stream (a .bin
    read with a tokenizer it was not made with), or a half-built cache left behind."""
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "a.jsonl", DOCS[:40])
    _jsonl(tmp_path / "b.jsonl", DOCS[40:])
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "good.parquet")
    args = {"tokenizer": "bytes"}
    if case == "corrupt_parquet":
        (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all")
        args["data"] = "bad.parquet"
    elif case == "truncated_parquet":
        (tmp_path / "cut.parquet").write_bytes((tmp_path / "good.parquet").read_bytes()[:-40])
        args["data"] = "cut.parquet"
    elif case == "missing_column":
        args.update(data="good.parquet", text_column="body")
    elif case == "bin_dtype_too_small":
        np.zeros(100, dtype=np.uint16).tofile(tmp_path / "x.bin")
        args.update(data="x.bin", tokenizer=str(_big_vocab_tokenizer(tmp_path / "big.json")))
    elif case == "bin_id_too_large":
        np.array([1, 2, 300, 4], dtype=np.uint16).tofile(tmp_path / "x.bin")
        args["data"] = "x.bin"
    elif case == "megatron_dtype_too_small":
        _megatron(tmp_path / "m", [np.arange(10)], dtype=np.uint8, code=1)
        args.update(data="m.bin", tokenizer=str(_big_vocab_tokenizer(tmp_path / "big.json")))
    else:
        weight = {"weight_zero": "0", "weight_negative": "-1", "weight_word": "lots"}.get(case)
        args["data"] = "a.jsonl:0.5,b.jsonl" + ("" if weight is None else f":{weight}")
    argv = ["prepare", "--cache-dir", str(tmp_path / "cache")]
    for k, v in args.items():
        argv += [f"--{k.replace('_', '-')}", v]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert err.startswith("plait prepare: error: ")
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))


def test_a_bad_record_deep_in_a_file_names_its_line_and_keeps_nothing(tmp_path, monkeypatch):
    """A JSON error found while tokenising in parallel units names the line in the file
    (units do not know the lines before them) and leaves no partial cache. Catches line
    numbers counted per unit, or partial files kept after a DataError."""
    monkeypatch.setattr(corpus_mod, "UNIT_BYTES", 1500)
    monkeypatch.setattr(build_mod, "PARALLEL_MIN_BYTES", 0)
    lines = [json.dumps({"text": d}) for d in DOCS]
    lines[86] = '{"text": "unterminated'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl line 87: not valid JSON"):
        prepare(_cfg(tmp_path, tmp_path / "d.jsonl"), workers=2)
    assert not any((tmp_path / "cache").rglob("*"))


# ------------------------------------------------------------------------------ building


def test_parallel_build_equals_one_process_and_resumes_after_a_crash(tmp_path, monkeypatch):
    """Workers give the one-process stream byte for byte, and a build killed midway resumes
    at its last committed unit with the same result. Catches results written out of unit
    order, pieces cut differently per worker, and a resume that repeats or skips units."""
    monkeypatch.setattr(corpus_mod, "UNIT_BYTES", 2000)
    monkeypatch.setattr(build_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(build_mod, "COMMIT_SECONDS", 0.0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        (folder / f"f{i}.txt").write_text("\n".join(DOCS[i * 10 : i * 10 + 10]))
    _jsonl(folder / "g.jsonl", DOCS[60:])
    pq.write_table(pa.table({"text": DOCS[:30]}), folder / "h.parquet", row_group_size=7)
    one = prepare(DataConfig(path=str(folder), vocab_size=300, cache_dir=str(tmp_path / "c1")),
                  workers=1)  # fmt: skip
    units = corpus_mod.find_corpus(str(folder)).units()
    assert len(units) > 10

    two = prepare(DataConfig(path=str(folder), vocab_size=300, cache_dir=str(tmp_path / "c2")),
                  workers=2)  # fmt: skip
    assert np.array_equal(_stream(one), _stream(two))

    real, calls = build_mod._encode, []

    def dies_at_unit_7(unit, state=None):
        calls.append(unit)
        if len(calls) == 8:
            raise KeyboardInterrupt  # a crash: no cleanup beyond what a kill would leave
        return real(unit, state)

    cfg3 = DataConfig(path=str(folder), vocab_size=300, cache_dir=str(tmp_path / "c3"))
    monkeypatch.setattr(build_mod, "_encode", dies_at_unit_7)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg3, workers=1)
    partial = next((tmp_path / "c3").glob("*/tokens.bin.partial"))
    assert not (partial.parent / "tokens.bin").exists()
    monkeypatch.setattr(build_mod, "_encode", real)
    logs = []
    three = prepare(cfg3, workers=1, log=logs.append)
    assert any(f"resuming an interrupted build at unit 7 of {len(units)}" in m for m in logs), logs
    assert np.array_equal(_stream(one), _stream(three))
    assert (
        json.loads((three.cache_path / "meta.json").read_text())["num_documents"]
        == (json.loads((one.cache_path / "meta.json").read_text())["num_documents"])
    )


def test_a_document_cut_into_pieces_gets_one_end_of_text(tmp_path, monkeypatch):
    """A document longer than PIECE_CHARS is encoded in pieces, and the end-of-text follows
    only its last piece: with the bytes tokenizer the stream is each document's bytes then
    one ETX. Catches an end-of-text after every piece (or after every batch)."""
    monkeypatch.setattr(build_mod, "PIECE_CHARS", 64)
    monkeypatch.setattr(build_mod, "ENCODE_CHARS", 100)  # pieces of a document in 2+ calls
    docs = ["\n".join(DOCS[:12]), "short one", "\n".join(DOCS[12:20])]
    ds = prepare(_cfg(tmp_path, _jsonl(tmp_path / "d.jsonl", docs), val_fraction=0.0))
    want = b"".join(d.encode() + bytes([3]) for d in docs)
    assert _stream(ds).astype(np.uint8).tobytes() == want
    assert ds.num_documents == 3


def test_instruction_data_builds_in_parallel_with_the_one_process_tokens_and_mask(
    tmp_path, monkeypatch
):
    """Instruction JSONL cut into byte-range units and tokenised by 2 workers gives the
    tokens and loss mask of encoding every example in order in one process
    (``instruct.encode`` over the file's records), and a build killed after writing a unit
    its journal does not vouch for resumes with both files cut back to the journal. Catches a mask out of step with its tokens, a record read twice or
    lost at a unit boundary, and a resume that cuts back the tokens but not the mask."""
    import plait.data.instruct as instruct_mod

    monkeypatch.setattr(corpus_mod, "UNIT_BYTES", 1500)
    monkeypatch.setattr(build_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(build_mod, "COMMIT_SECONDS", 0.0)
    records = []
    for i, d in enumerate(DOCS):
        if i % 2:
            records.append({"prompt": d[:20], "completion": d[20:]})
        else:
            records.append({"messages": [{"role": "user", "content": d[:15]},
                                         {"role": "assistant", "content": d[15:]}]})  # fmt: skip
    lines = [json.dumps(r) for r in records]
    lines[37:37] = [""]  # a blank line counts for line numbers but is no example
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tok = ByteTokenizer()
    pairs = instruct_mod.encode(tok, [instruct_mod.segments(r, "x") for r in records])
    want_ids = np.concatenate([ids for ids, _ in pairs])
    want_mask = np.concatenate([m for _, m in pairs])
    units = corpus_mod.find_corpus(str(path)).units()
    assert len(units) > 10

    def build(cache, workers):
        ds = prepare(DataConfig(path=str(path), tokenizer="bytes", cache_dir=str(cache),
                                val_fraction=0.0), workers=workers)  # fmt: skip
        meta = json.loads((ds.cache_path / "meta.json").read_text())
        assert meta["num_documents"] == len(records)
        assert meta["num_trained_tokens"] == int(want_mask.sum())
        return _stream(ds), np.asarray(ds.train_mask)

    for workers in (1, 2):
        ids, mask = build(tmp_path / f"c{workers}", workers)
        assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask), workers

    real, calls = build_mod._commit, []

    def dies_committing_unit_5(files, journal, state):
        calls.append(state)
        if len(calls) == 6:  # unit 5's tokens and mask are written, the journal says 5 units
            raise KeyboardInterrupt
        return real(files, journal, state)

    monkeypatch.setattr(build_mod, "_commit", dies_committing_unit_5)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "c3", 1)
    assert next((tmp_path / "c3").glob("*/mask.bin.partial")).stat().st_size > 0
    monkeypatch.setattr(build_mod, "_commit", real)
    ids, mask = build(tmp_path / "c3", 1)
    assert np.array_equal(ids, want_ids) and np.array_equal(mask, want_mask)


def test_a_bad_instruction_record_in_a_later_unit_names_its_line(tmp_path, monkeypatch):
    """With the file cut into units tokenised by workers, a bad record far into the file is
    reported with its line in the file (the units before it counted), in one line, and
    nothing is left in the cache. Catches a line number relative to the unit."""
    monkeypatch.setattr(corpus_mod, "UNIT_BYTES", 500)
    monkeypatch.setattr(build_mod, "PARALLEL_MIN_BYTES", 0)
    lines = [json.dumps({"prompt": d[:10], "completion": d[10:]}) for d in DOCS[:80]]
    lines[70] = json.dumps({"prompt": "a", "completion": ""})
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl line 71: empty 'completion'") as e:
        prepare(_cfg(tmp_path, tmp_path / "d.jsonl"), workers=2)
    assert "\n" not in str(e.value)
    assert not any((tmp_path / "cache").rglob("*"))


# ------------------------------------------------------------------------------ mixtures


def _mixture(tmp_path: Path, weights=(0.7, 0.2, 0.1)):
    """Three sources whose bytes never overlap (digits, lower case, upper case), so a row
    shows which source it came from."""
    alphabets = ["0123456789 ", "abcdefghij ", "ABCDEFGHIJ "]
    rng = np.random.default_rng(0)
    spec = []
    for k, (alpha, w) in enumerate(zip(alphabets, weights)):
        docs = [
            "".join(rng.choice(list(alpha), size=rng.integers(50, 400))) for _ in range(40 + 30 * k)
        ]
        _jsonl(tmp_path / f"s{k}.jsonl", docs)
        spec.append(f"{tmp_path / f's{k}.jsonl'}:{w}")
    return prepare(_cfg(tmp_path, ",".join(spec), val_fraction=0.05)), alphabets


def test_mixture_counts_are_within_the_binomial_bound(tmp_path):
    """Over N = 1,000 sequences, source s's count n_s satisfies |n_s - N w_s| <= 5 sigma,
    sigma = sqrt(N w_s (1 - w_s)): the spread of N independent draws (binomial). The
    block-stratified order is a without-replacement draw from a block of 65,536 with
    exact quotas, whose count is hypergeometric and spreads less than that, so 5 sigma
    (a 6e-7 two-sided tail for a normal) is a bound that holds for any correct seed.
    For 0.7 / 0.2 / 0.1 the bounds are 700 +- 72, 200 +- 63, 100 +- 47: a sampler that
    ignored the weights (333 each) or swapped two sources fails it. Each row must also
    hold only its claimed source's bytes (catches a gather from the wrong stream), and
    tokens_seen must agree with the rows (the metrics log)."""
    data, alphabets = _mixture(tmp_path)
    seq_len, g, steps = 16, 8, 125
    sampler = train_sampler(data, seq_len=seq_len, global_batch=g, seed=3)
    assert isinstance(sampler, MixtureSampler)
    counts = np.zeros(3, dtype=np.int64)
    for step in range(steps):
        src = sampler.sources(step)
        rows = sampler.batch(step)
        for s, row in zip(src, rows):
            chars = set(bytes(row[row != 3].tolist()).decode())
            assert chars <= set(alphabets[s]), (s, chars)
        counts += np.bincount(src, minlength=3)
    n = steps * g
    for s, w in enumerate(data.weights):
        sigma = math.sqrt(n * w * (1 - w))
        assert abs(counts[s] - n * w) <= 5 * sigma, (s, counts)
    seen = sampler.tokens_seen(steps - 1)
    assert list(seen.values()) == [int(c) * seq_len for c in counts]
    assert list(seen) == list(data.names)


def test_mixture_shares_over_whole_blocks_are_the_weights():
    """apportion gives each source its largest-remainder quota of a block; the quotas sum to
    the block. Catches a quota rounded the same way for every source (sum != block)."""
    q = apportion(MIX_BLOCK, [0.7, 0.2, 0.1])
    assert q.sum() == MIX_BLOCK and list(q) == [45875, 13107, 6554]
    assert list(apportion(10, [0.55, 0.45])) == [6, 4]
    assert list(apportion(3, [1 / 3, 1 / 3, 1 / 3])) == [1, 1, 1]
    assert parse_sources("a.jsonl:3,b/:1") == [("a.jsonl", 0.75), ("b/", 0.25)]


def test_mixture_resume_and_layout_do_not_change_the_rows(tmp_path):
    """A sampler built afresh at step k (what --resume does) gives exactly the rows and the
    tokens-per-source of the sampler that ran from step 0, and dp shares (1, 2, 4 ranks) and
    arbitrary row ranges concatenate to the global batch. Catches iterator state carried
    between steps, and rows that depend on dp. Run across a block boundary too."""
    data, _ = _mixture(tmp_path)
    kw = dict(seq_len=16, global_batch=8, seed=5)
    running = train_sampler(data, **kw)
    first = [running.batch(s) for s in range(12)]
    seen = [running.tokens_seen(s) for s in range(12)]
    resumed = train_sampler(data, **kw)
    for s in range(7, 12):
        assert torch.equal(resumed.batch(s), first[s])
        assert resumed.tokens_seen(s) == seen[s]
    for dp in (1, 2, 4):
        parts = [resumed.local_batch(10, dp_rank=r, dp=dp)[0] for r in range(dp)]
        assert torch.equal(torch.cat(parts), first[10][:, :-1])
    assert torch.equal(resumed.rows(3, 2, 7)[1], first[3][2:7, 1:])
    edge = MIX_BLOCK // 8 - 1  # the step whose rows end at the first block boundary
    a = train_sampler(data, **kw)
    b = train_sampler(data, **kw)
    a.batch(edge), a.batch(edge + 1)
    assert torch.equal(b.batch(edge + 1), a.batch(edge + 1))
    assert sum(a.tokens_seen(edge).values()) == MIX_BLOCK * 16
    assert not torch.equal(train_sampler(data, **{**kw, "seed": 6}).batch(0), first[0])


def test_mixture_validation_draws_every_source(tmp_path):
    """The validation batches hold each source's rows in its weight's share, the same on
    every call. Catches a validation set taken from the first source only."""
    data, alphabets = _mixture(tmp_path, weights=(0.5, 0.25, 0.25))
    batches = val_set(data, seq_len=16, batch=4, num_batches=2)
    again = val_set(data, seq_len=16, batch=4, num_batches=2)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(batches, again))
    rows = torch.cat([x for x, _ in batches])
    found = [next(s for s, a in enumerate(alphabets) if bytes(r[r != 3].tolist()).decode()[0] in a)
             for r in rows]  # fmt: skip
    assert sorted(found) == [0, 0, 0, 0, 1, 1, 2, 2]


def test_a_resumed_mixture_run_continues_the_uninterrupted_run(tmp_path):
    """plait train's Trainer on a three-source mixture: 6 steps saving at step 3, then a
    fresh Trainer resuming from that checkpoint runs steps 4-6 with the uninterrupted
    run's losses and per-source token counts, exactly (one process, the same arithmetic).
    Catches a resume that restarts the mixture's order (other rows: other losses) or
    loses its per-source counts."""
    import dataclasses

    from plait.layout import Layout
    from plait.model.config import preset
    from plait.topology import Topology
    from plait.train.config import RunConfig, TrainConfig
    from plait.train.loop import Trainer

    _, _ = _mixture(tmp_path)  # the sources and their caches
    spec = ",".join(f"{tmp_path / f's{k}.jsonl'}:{w}" for k, w in enumerate((0.7, 0.2, 0.1)))
    cfg = RunConfig(
        model=preset("tiny", n_layers=1, hidden=32, n_heads=2, seq_len=16, vocab_size=256),
        layout=Layout(global_batch_size=4, micro_batch_size=2),
        data=_cfg(tmp_path, spec, val_fraction=0.05),
        train=TrainConfig(
            steps=6, eval_every=0, eval_batches=1, progress=False, lr=3e-3, warmup=1
        ),  # fmt: skip
        out=str(tmp_path / "run"),
    )
    whole = Trainer(cfg, topo=Topology.single())
    records = []
    for step in range(6):
        records.append(whole.step(step))
        if step == 2:
            whole.save(3)
    resumed_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
    resumed = Trainer(resumed_cfg, topo=Topology.single())
    start = resumed.restore()
    assert start == 3
    again = [resumed.step(step) for step in range(start, 6)]
    for want, got in zip(records[3:], again):
        assert got["loss"] == want["loss"], (want["step"], got["loss"], want["loss"])
        assert got["source_tokens"] == want["source_tokens"]
    assert len(records[-1]["source_tokens"]) == 3
