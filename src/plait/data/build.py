"""Tokenising a corpus into ``tokens.bin``: on every core, streaming, resumable.

The corpus is cut into units (``Corpus.units``: a run of text files, 16 MB of a JSON Lines
file, a Parquet row group, a run of Arrow record batches). Worker processes each read and
tokenise one unit at a time -- reading in the workers too, so JSON and Parquet decoding
scale with the cores -- and the parent appends their ids to ``tokens.bin.partial`` in unit
order. At most ``2 x workers`` units are in flight, so memory is a few units whatever the
corpus size. Each unit's documents are cut into pieces and encoded exactly as one process
would (``cut_document``), so the stream does not depend on the number of workers.
Instruction data goes the same way: its units are byte ranges of the JSON Lines file, each
worker renders and encodes their examples (``instruct.encode``) and returns the loss mask
with the ids, and the parent appends the mask to ``mask.bin.partial`` beside the tokens.

Where the time goes (a 12 MB Parquet row group of source code, BPE of 4,096 ids, one
core): ~95% in the tokenizer's Rust ``encode_batch_fast``; turning its ids into numpy
~3.5% (``Encoding.ids`` builds a Python list; ``encode_concat`` then makes one array per
call in the cache's dtype rather than one per document); reading Parquet ~1.5%; sending a
unit's array to the parent and writing it a few milliseconds (benchmarks/RESULTS.md).

Resuming: every COMMIT_SECONDS the parent fsyncs the partial file(s) and then records, in
``tokens.progress.json``, how many units and tokens it holds (and a digest of the plan).
A build that dies is continued by the next ``prepare``: the partial file is cut back to the
recorded length and tokenising starts at the next unit. A plan that changed starts over.

Progress: a line with the share of bytes done, tokens/s and the ETA every
PROGRESS_SECONDS (through ``log``).

Communication: none (no torch.distributed). Workers are forked ``multiprocessing`` processes
of the one machine; each uses one tokenizer thread, so W workers use W cores.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from plait.data import instruct
from plait.data.corpus import Corpus, RecordError, Unit, UnitStats, read_unit

# Below this many bytes a corpus is tokenised in this process (starting workers costs more).
PARALLEL_MIN_BYTES = 32 << 20
COMMIT_SECONDS = 10.0
ENCODE_CHARS = 1 << 20  # characters per call of the tokenizer
EXAMPLES_PER_CALL = 1024  # instruction examples per call of the tokenizer
PROGRESS_SECONDS = 5.0
JOURNAL_FORMAT = 1

_WORKER: dict = {}  # in a worker: the corpus, tokenizer and dtype (set by _init)


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tokenise(corpus: Corpus, units: list[Unit], tokenizer, dtype, out: Path, *,
             workers: int | None, log: Callable[[str], None], mask_out: Path | None = None,
             chat=None) -> dict[str, int]:  # fmt: skip
    """Write every document's ids, each followed by the end-of-text id, to ``out`` (renamed
    into place at the end); returns the counts that meta.json records. Instruction data
    (``corpus.instruct``) also writes its loss mask, one uint8 per token, to ``mask_out``
    (``chat``: the tokenizer's chat template, ``instruct.ChatTemplate``, or None)."""
    partial = out.with_name(out.name + ".partial")
    mask_partial = mask_out.with_name(mask_out.name + ".partial") if mask_out else None
    journal = out.with_name(out.name.split(".")[0] + ".progress.json")
    plan = _plan_digest(units, dtype, mask=mask_out is not None)
    done = _resume(partial, mask_partial, journal, plan, dtype, len(units), log)
    total_bytes = sum(u.nbytes for u in units)
    workers = workers or default_workers()
    if total_bytes < PARALLEL_MIN_BYTES or len(units) - done["units"] < 2:
        workers = 1
    progress = _Progress(total_bytes, sum(u.nbytes for u in units[: done["units"]]), log)
    skipped, replaced, lines = [], 0, dict(done.pop("lines"))
    state = {"corpus": corpus, "tokenizer": tokenizer, "dtype": dtype, "chat": chat}
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(partial, "ab"))
        m = stack.enter_context(open(mask_partial, "ab")) if mask_partial else None
        runner = stack.enter_context(_Runner(state, workers))
        last_commit = time.perf_counter()
        for i, result in runner.results(units, start=done["units"]):
            unit = units[i]
            if isinstance(result, RecordError):
                raise corpus.record_error(unit, lines.get(str(unit.file), 0), result)
            ids, mask, stats, num_documents, num_chars = result
            ids.tofile(f)
            done["units"] = i + 1
            done["num_tokens"] += len(ids)
            done["num_documents"] += num_documents
            done["num_chars"] += num_chars
            if m is not None:
                mask.tofile(m)
                done["num_trained_tokens"] += int(mask.sum())
            lines[str(unit.file)] = lines.get(str(unit.file), 0) + stats.lines
            skipped += stats.skipped
            replaced += stats.replaced
            progress.update(unit.nbytes, len(ids))
            if time.perf_counter() - last_commit >= COMMIT_SECONDS:
                _commit([f, m], journal, {**done, "plan": plan, "lines": lines})
                last_commit = time.perf_counter()
        for fh in (m, f):
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
    progress.finish()
    corpus.log_oddities(log, skipped, replaced)
    if mask_partial:  # the mask first: tokens.bin in place means the mask is too
        os.replace(mask_partial, mask_out)
    os.replace(partial, out)
    journal.unlink(missing_ok=True)
    return done


def discard(out: Path) -> None:
    """Remove a build's partial files (after an error in the data: nothing is kept)."""
    out.with_name(out.name + ".partial").unlink(missing_ok=True)
    out.with_name("mask.bin.partial").unlink(missing_ok=True)
    out.with_name(out.name.split(".")[0] + ".progress.json").unlink(missing_ok=True)


def _plan_digest(units: list[Unit], dtype, *, mask: bool = False) -> str:
    key = {"format": JOURNAL_FORMAT, "dtype": np.dtype(dtype).name, "units": units}
    if mask:  # (only then, so a text build's digest is what it was)
        key["mask"] = True
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _resume(partial: Path, mask_partial: Path | None, journal: Path, plan: str, dtype,
            num_units: int, log: Callable[[str], None]) -> dict:  # fmt: skip
    """The counts of the units already in ``partial`` (and ``mask_partial``, one byte a
    token), cut back to them, or zeros."""
    fresh = {"units": 0, "num_tokens": 0, "num_documents": 0, "num_chars": 0, "lines": {}}
    if mask_partial:
        fresh["num_trained_tokens"] = 0
    try:
        state = json.loads(journal.read_text())
        keep = state["num_tokens"] * np.dtype(dtype).itemsize
        if state["plan"] != plan or partial.stat().st_size < keep:
            raise ValueError("another plan")
        if mask_partial and mask_partial.stat().st_size < state["num_tokens"]:
            raise ValueError("the mask is short")
        counts = {k: state[k] for k in fresh}
    except (OSError, ValueError, KeyError, TypeError):
        for stale in (partial, mask_partial, journal):
            if stale:
                stale.unlink(missing_ok=True)
        return fresh
    os.truncate(partial, keep)  # what was written after the last commit goes again
    if mask_partial:
        os.truncate(mask_partial, state["num_tokens"])
    log(f"data: resuming an interrupted build at unit {state['units']} of {num_units} "
        f"({state['num_tokens']:,} tokens kept)")  # fmt: skip
    return counts


def _commit(files: list, journal: Path, state: dict) -> None:
    for f in files:
        if f is not None:
            f.flush()
            os.fsync(f.fileno())  # the tokens first: the journal never vouches for lost bytes
    tmp = journal.with_name(journal.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, journal)


class _Runner:
    """Tokenises units in order: in this process (workers == 1) or in a pool of forked
    workers with at most 2 x workers units in flight."""

    def __init__(self, state: dict, workers: int):
        self.state = state  # the corpus, tokenizer, dtype and chat template (_encode)
        self.workers, self.pool = workers, None

    def __enter__(self) -> _Runner:
        if self.workers > 1:
            # Fork: the workers inherit the corpus and tokenizer without pickling them. With
            # TOKENIZERS_PARALLELISM set while forking, the tokenizers library neither warns
            # nor starts a thread pool in the workers (one core each); the parent keeps its own.
            method = "fork" if sys.platform == "linux" else "spawn"
            before = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                ctx = multiprocessing.get_context(method)
                self.pool = ctx.Pool(self.workers, initializer=_init, initargs=(self.state,))
            finally:
                if before is None:
                    os.environ.pop("TOKENIZERS_PARALLELISM", None)
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = before
        return self

    def results(self, units: list[Unit], *, start: int):
        """(unit index, result) in unit order from ``start``; a result is
        (ids, mask or None, UnitStats, documents, characters) or the unit's RecordError."""
        if self.pool is None:
            for i in range(start, len(units)):
                yield i, _encode(units[i], self.state)
            return
        pending = collections.deque()
        todo = iter(range(start, len(units)))
        for i in todo:
            pending.append((i, self.pool.apply_async(_encode, (units[i],))))
            if len(pending) >= 2 * self.workers:
                break
        while pending:
            i, res = pending.popleft()
            yield i, res.get()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, self.pool.apply_async(_encode, (units[nxt],))))

    def __exit__(self, *exc) -> None:
        # close, not terminate, on an error too: at most 2 x workers units are still in
        # flight and each ends in its encoding time, while ``Pool.terminate`` can leave
        # its task handler's join waiting forever on workers it killed (seen once in CI:
        # a bad record's error path hung the suite in ``_terminate_pool``)
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


def _init(state: dict) -> None:
    _WORKER.update(state)


def _encode(unit: Unit, state: dict | None = None):
    """One unit's ids (end-of-text after each document, in the cache's dtype), its loss
    mask (instruction data; else None), stats, documents and characters; a bad JSON Lines
    record is returned, not raised."""

    state = state or _WORKER
    corpus, tokenizer, dtype = state["corpus"], state["tokenizer"], state["dtype"]
    stats = UnitStats()
    if corpus.instruct:
        return _encode_examples(unit, state, stats)
    pieces = []
    try:
        for doc in read_unit(corpus, unit, stats):
            pieces += cut_document(doc)
    except RecordError as e:
        return e
    parts, num_documents, num_chars = [], 0, 0
    for batch in _batches(pieces):
        # in batches of ENCODE_CHARS: the tokenizer's per-token objects of a whole unit
        # would take ~100 bytes a token; its ids alone take 2 or 4
        ids, lengths = tokenizer.encode_concat([p for p, _ in batch], dtype)
        last = np.fromiter((end for _, end in batch), dtype=bool, count=len(batch))
        if tokenizer.eot_id is not None:  # after each document's last piece
            ids = np.insert(ids, np.cumsum(lengths)[last], np.array(tokenizer.eot_id, dtype))
        parts.append(ids)
        num_documents += int(last.sum())
        num_chars += sum(len(p) for p, _ in batch)
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return ids, None, stats, num_documents, num_chars


def _encode_examples(unit: Unit, state: dict, stats: UnitStats):
    """``_encode`` for instruction data: the unit's examples rendered (``instruct.py``),
    their ids and loss mask, in batches of EXAMPLES_PER_CALL."""
    corpus, tokenizer, dtype, chat = (state[k] for k in ("corpus", "tokenizer", "dtype", "chat"))
    ids, mask, num_chars, num_documents = [], [], 0, 0
    examples = instruct.unit_examples(corpus.files[unit.file], unit.a, unit.b, stats, chat)
    try:
        while batch := list(itertools.islice(examples, EXAMPLES_PER_CALL)):
            for ex_ids, ex_mask in instruct.encode(tokenizer, batch, special=chat is not None):
                ids.append(ex_ids.astype(dtype))
                mask.append(ex_mask)
            num_chars += sum(len(instruct.text(ex)) for ex in batch)
            num_documents += len(batch)
    except RecordError as e:
        return e
    if not ids:
        return np.zeros(0, dtype=dtype), np.zeros(0, np.uint8), stats, 0, 0
    return np.concatenate(ids), np.concatenate(mask), stats, num_documents, num_chars


def _batches(pieces: list[tuple[str, bool]]):
    start, size = 0, 0
    for i, (text, _) in enumerate(pieces):
        size += len(text)
        if size >= ENCODE_CHARS:
            yield pieces[start : i + 1]
            start, size = i + 1, 0
    if start < len(pieces):
        yield pieces[start:]


class _Progress:
    """A log line every PROGRESS_SECONDS: share of bytes done, tokens/s, ETA."""

    def __init__(self, total_bytes: int, done_bytes: int, log: Callable[[str], None]):
        self.total, self.done, self.log = max(total_bytes, 1), done_bytes, log
        self.start = self.last = time.perf_counter()
        self.bytes = self.tokens = 0  # in this session (a resumed build's rate is its own)

    def update(self, nbytes: int, ntokens: int) -> None:
        self.bytes += nbytes
        self.tokens += ntokens
        now = time.perf_counter()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            self.log(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        done = self.done + self.bytes
        eta = (self.total - done) / max(self.bytes / elapsed, 1e-9)
        return (f"data: tokenising {done / self.total:.0%} ({done / 1e6:,.0f} of "
                f"{self.total / 1e6:,.0f} MB)  {self.tokens / elapsed / 1e6:.2f}M tokens/s  "
                f"ETA {_clock(eta)}")  # fmt: skip

    def finish(self) -> None:
        if time.perf_counter() - self.start >= PROGRESS_SECONDS:
            elapsed = time.perf_counter() - self.start
            self.log(f"data: tokenised {self.bytes / 1e6:,.0f} MB at "
                     f"{self.tokens / elapsed / 1e6:.2f}M tokens/s")  # fmt: skip


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# Tokenising cuts documents longer than PIECE_CHARS at a line break, so a document's
# pieces can go to several cores. The cut only changes how the text around it is merged.
PIECE_CHARS = 1 << 20


def cut_document(doc: str) -> list[tuple[str, bool]]:
    """``doc`` cut at line breaks into pieces of at most PIECE_CHARS, each with whether it
    is the document's last (the end-of-text follows it)."""
    out, start = [], 0
    while len(doc) - start > PIECE_CHARS:
        cut = doc.rfind("\n", start + PIECE_CHARS // 2, start + PIECE_CHARS) + 1
        cut = cut or start + PIECE_CHARS  # no line break near the limit: cut anywhere
        out.append((doc[start:cut], False))
        start = cut
    out.append((doc[start:], True))
    return out
