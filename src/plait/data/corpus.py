"""Where the training text comes from: an ordered stream of documents.

``--data`` picks one of these sources (pre-tokenized ``.bin`` files are ``pretokenized.py``'s,
mixtures ``mixture.py``'s):

- nothing: the embedded default corpus, i.e. the Python standard library's own ``*.py``
  files on this machine (``sysconfig.get_paths()["stdlib"]``, test folders left out,
  about 12 MB). Every machine with Python has it, nothing to download, and source code
  is a good corpus for a small model.
- a text file: one document.
- a folder: every text file under it (``TEXT_SUFFIXES``, plus JSON Lines files), one
  document per file (per line for JSON Lines). Hidden folders and ``__pycache__`` are skipped.
- a JSON Lines file (``JSONL_SUFFIXES``): one document per line, taken from its "text" field
  (``--text-column``); or instruction data (``prompt`` / ``completion`` or chat ``messages``
  records), whose loss is taken on the answers only (``instruct.py``).
- a Parquet file, or a folder of them (``*.parquet``, next to any text files): one document
  per row, from the ``--text-column`` column (``columnar.py``).
- a folder written by ``datasets``' ``save_to_disk`` (``state.json`` and ``data-*.arrow``; a
  ``DatasetDict`` folder gives its ``train`` split): one document per row, likewise.

Tokenising reads the source a *unit* at a time (``units``): a run of text files, a byte range
of a JSON Lines file, a Parquet row group or a run of Arrow record batches. Units are cut
in document order, so tokenising them in parallel (``build.py``) and writing their ids in
unit order gives exactly the stream that reading the documents one by one gives.

Files are visited in sorted relative-path order, so the token stream, and therefore every
batch, is the same on every machine that holds the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from plait.data.lines import RecordError, UnitStats, jsonl_lines
from plait.data.sources import existing
from plait.errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".jsonlines", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_TEXT_COLUMN = "text"

# Folders of the standard library that are not "the library": its test suites (which are
# larger than the library itself and full of deliberately odd code) and installed packages.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
USER_EXCLUDED_DIRS = frozenset({"__pycache__", "node_modules"})

# A single file up to this size is identified by its content (see Corpus.identity).
CONTENT_HASH_LIMIT = 64 << 20
# A file whose first bytes hold a NUL is binary (the same test git and grep use).
BINARY_SNIFF_BYTES = 8192
# A unit of text files or of a JSON Lines file is about this many bytes (module docstring).
UNIT_BYTES = 16 << 20


class Unit(NamedTuple):
    """A slice of a corpus that one worker tokenises (module docstring). ``file`` indexes
    ``Corpus.files``; ``a`` / ``b`` mean, by ``fmt``: "text" files [file, b); "jsonl" the
    lines that start in bytes [a, b); "parquet" row group a; "arrow" record batches [a, b).
    ``nbytes`` is what progress and ETA count."""

    fmt: str
    file: int
    a: int
    b: int
    nbytes: int


@dataclass(frozen=True)
class Corpus:
    """A discovered source of text: which files, in which order, and how to name them."""

    label: str  # how messages name the source: "--data books/" or "the embedded corpus"
    kind: str  # "stdlib" | "file" | "folder"
    root: Path  # the folder (stdlib, folder) or the file itself
    files: tuple[Path, ...]  # absolute paths, in document order
    user_path: str | None = None  # --data exactly as given, for messages
    instruct: bool = False  # instruction examples (instruct.py), not documents
    text_column: str = DEFAULT_TEXT_COLUMN  # JSON Lines field / Parquet and Arrow column

    def identity(self) -> dict:
        """What the token cache is keyed on.

        Hashing every byte of a large folder on every start would cost more than it saves,
        so folders (and the standard library) are identified by each file's relative path,
        size and modification time: editing a file changes its mtime and the cache is
        rebuilt. A single file up to CONTENT_HASH_LIMIT is identified by its content
        instead (~0.1 s per 64 MiB), which also catches a same-size rewrite within one
        mtime tick and lets copies of the file share one cache.
        """
        if self.kind == "file" and self.root.stat().st_size <= CONTENT_HASH_LIMIT:
            digest = hashlib.sha256(self.root.read_bytes()).hexdigest()
            out = {"kind": "file", "format": _format(self.root), "sha256": digest}
        else:
            listing = []
            for f in self.files:
                st = f.stat()
                rel = f.name if self.kind == "file" else f.relative_to(self.root).as_posix()
                listing.append([rel, st.st_size, st.st_mtime_ns])
            out = {"kind": self.kind, "root": str(self.root), "files": listing}
        if self.instruct:  # the rendering is part of what the tokens are
            from plait.data.instruct import TEMPLATE

            out["instruct"] = TEMPLATE
        if self.text_column != DEFAULT_TEXT_COLUMN:  # (so the default keeps older keys)
            out["text_column"] = self.text_column
        return out

    def display(self, f: Path) -> str:
        """How messages name one file: as the user would type it."""
        if self.kind == "file":
            return self.user_path or str(f)
        if self.kind in ("folder", "datasets"):
            return str(Path(self.user_path or self.root) / f.relative_to(self.root))
        return str(f)

    def documents(self, log: Callable[[str], None] | None = None) -> Iterator[str]:
        """Yield the documents in order; empty or whitespace-only ones are dropped.

        Binary files inside a folder are skipped and bytes that are not UTF-8 are replaced
        (one odd file should not stop a run); ``log`` hears how many of each, if any.
        """
        if self.instruct:
            from plait.data import instruct

            for ex in self.examples():
                yield instruct.text(ex)
            return
        skipped, replaced, lines = [], 0, {}  # lines: of each JSON Lines file so far
        for unit in self.units():
            stats = UnitStats()
            try:
                yield from read_unit(self, unit, stats)
            except RecordError as e:
                raise self.record_error(unit, lines.get(unit.file, 0), e) from None
            lines[unit.file] = lines.get(unit.file, 0) + stats.lines
            skipped += stats.skipped
            replaced += stats.replaced
        self.log_oddities(log, skipped, replaced)

    def log_oddities(self, log, skipped: list[str], replaced: int) -> None:
        if log and skipped:
            log(f"data: skipped {len(skipped)} binary file(s) in {self.label}, e.g. {skipped[0]}")
        if log and replaced:
            log(f"data: {replaced} file(s) in {self.label} had bytes that are not UTF-8 (replaced)")

    def record_error(self, unit: Unit, lines_before: int, e: RecordError) -> DataError:
        """The one-line DataError of a bad JSON Lines record, with its line in the file."""
        shown = self.display(self.files[unit.file])
        return DataError(f"--data {shown} line {lines_before + e.line}: {e.message}")

    def units(self) -> list[Unit]:
        """The corpus cut into units in document order (module docstring); DataError for a
        Parquet or Arrow file that cannot be read or lacks the text column."""
        from plait.data import columnar

        out, run, run_bytes = [], None, 0
        for i, f in enumerate(self.files):
            fmt = _format(f)
            if fmt != "text" and run is not None:  # a run of text files ends here
                out.append(Unit("text", run, 0, i, run_bytes))
                run = None
            size = f.stat().st_size
            if fmt == "text":
                run, run_bytes = (i, 0) if run is None else (run, run_bytes)
                run_bytes += size
                if run_bytes >= UNIT_BYTES:
                    out.append(Unit("text", run, 0, i + 1, run_bytes))
                    run = None
            elif fmt == "jsonl":
                out += [Unit("jsonl", i, a, min(a + UNIT_BYTES, size), min(UNIT_BYTES, size - a))
                        for a in range(0, size, UNIT_BYTES)]  # fmt: skip
            elif fmt == "parquet":
                shown = self.display(f)
                out += [Unit("parquet", i, rg, 0, n)
                        for rg, n in columnar.parquet_units(f, self.text_column, shown)]  # fmt: skip
            else:  # arrow
                shown = self.display(f)
                out += [Unit("arrow", i, a, b, n)
                        for a, b, n in columnar.arrow_units(f, self.text_column, shown)]  # fmt: skip
        if run is not None:
            out.append(Unit("text", run, 0, len(self.files), run_bytes))
        return out

    def examples(self, chat=None):
        """Instruction examples as (text, trained) segments (``instruct.py``; ``chat``: a
        tokenizer's chat template to render conversations with)."""
        from plait.data import instruct

        for f in self.files:
            yield from instruct.examples(f, self.display(f), chat)


def find_corpus(path: str | None, text_column: str = DEFAULT_TEXT_COLUMN) -> Corpus:
    """Resolve ``--data`` (None: the embedded corpus) to a Corpus, or raise DataError."""
    if path is None:
        root = stdlib_root()
        return Corpus("the embedded corpus", "stdlib", root, tuple(stdlib_files(root)))
    p = existing(path)
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        files = _saved_dataset_files(p, path)
        return Corpus(f"--data {path}", "datasets", p, files, path, text_column=text_column)
    if p.is_dir():
        suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
        files = _walk(p, USER_EXCLUDED_DIRS, suffixes)
        if not files:
            looked = ", ".join(f"*{s}" for s in suffixes)
            raise DataError(
                f"--data {path}: no text found (looked for {looked} in it and its subfolders)"
            )
        return Corpus(f"--data {path}", "folder", p, tuple(files), path, text_column=text_column)
    if not p.is_file():
        raise DataError(f"--data {path}: not a regular file or folder")
    if p.stat().st_size == 0:
        raise DataError(f"--data {path}: the file is empty")
    instruct = False
    if _format(p) == "jsonl":
        from plait.data.instruct import first_record, is_instruction

        instruct = is_instruction(first_record(p))
    return Corpus(f"--data {path}", "file", p, (p,), path, instruct=instruct,
                  text_column=text_column)  # fmt: skip


def _saved_dataset_files(root: Path, shown: str) -> tuple[Path, ...]:
    """The Arrow files of a ``save_to_disk`` folder, in the order its state.json lists them
    (a DatasetDict folder: those of its ``train`` split)."""
    if not (root / "state.json").is_file():
        splits = _read_json(root / "dataset_dict.json", shown).get("splits") or []
        if "train" not in splits:
            raise DataError(
                f"--data {shown}: a DatasetDict without a 'train' split (it has "
                f"{', '.join(map(str, splits)) or 'none'}); pass the split's folder, e.g. "
                f"--data {Path(shown) / str(splits[0]) if splits else shown}"
            )
        return _saved_dataset_files(root / "train", str(Path(shown) / "train"))
    state = _read_json(root / "state.json", shown)
    names = [d.get("filename") for d in state.get("_data_files") or [] if isinstance(d, dict)]
    files = tuple(root / n for n in names if n)
    if not files or not all(f.is_file() for f in files):
        raise DataError(
            f"--data {shown}: its state.json lists no readable data files; save it again "
            "with datasets' save_to_disk"
        )
    return files


def _read_json(path: Path, shown: str) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"--data {shown}: cannot read {path.name} ({e})")
    if not isinstance(out, dict):
        raise DataError(f"--data {shown}: {path.name} is not a JSON object")
    return out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The embedded corpus: the standard library's ``*.py`` files, tests excluded, sorted."""
    return _walk(root or stdlib_root(), STDLIB_EXCLUDED_DIRS, (".py",))


def _walk(root: Path, excluded: frozenset[str], suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for folder, dirs, names in os.walk(root):
        # Pruning here (not filtering afterwards) keeps the walk of the stdlib ~20 ms.
        dirs[:] = [d for d in dirs if d not in excluded and not d.startswith(".")]
        found += [Path(folder, n) for n in names if n.endswith(suffixes) and not n.startswith(".")]
    found = [f for f in found if f.is_file()]
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def _format(f: Path) -> str:
    suffix = f.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "arrow" if suffix == ".arrow" else "text"


def read_unit(corpus: Corpus, unit: Unit, stats: UnitStats) -> Iterator[str]:
    """The non-empty documents of one unit, in order; ``stats`` hears what else it found.
    A bad JSON Lines record raises RecordError (``Corpus.record_error`` words it)."""
    from plait.data import columnar

    f = corpus.files[unit.file]
    shown = corpus.display(f)
    column = corpus.text_column
    if unit.fmt == "text":
        texts = _text_files(corpus, corpus.files[unit.file : unit.b], stats)
    elif unit.fmt == "jsonl":
        texts = _jsonl_texts(f, unit.a, unit.b, column, stats)
    elif unit.fmt == "parquet":
        texts = columnar.parquet_texts(f, column, unit.a, shown)
    else:
        texts = columnar.arrow_texts(f, column, unit.a, unit.b, shown)
    return (t for t in texts if t.strip())


def _text_files(corpus: Corpus, files, stats: UnitStats) -> Iterator[str]:
    for f in files:
        data = f.read_bytes()
        if b"\x00" in data[:BINARY_SNIFF_BYTES]:
            if corpus.kind == "file":
                raise DataError(
                    f"--data {corpus.display(f)}: looks like a binary file, not text; pass a "
                    "text file, a folder of text files, a .jsonl or .parquet file"
                )
            stats.skipped.append(corpus.display(f))
            continue
        try:
            yield data.decode("utf-8-sig")
        except UnicodeDecodeError:
            stats.replaced += 1
            yield data.decode("utf-8-sig", errors="replace")


def _jsonl_texts(f: Path, start: int, stop: int, column: str, stats: UnitStats) -> Iterator[str]:
    """The documents of the lines of ``f`` that start in bytes [start, stop)."""
    for n, text in jsonl_lines(f, start, stop, stats):
        yield _jsonl_text(text, n, column)


def _jsonl_text(line: str, n: int, column: str) -> str:
    """The document of one JSON Lines record (line ``n`` of its unit), or RecordError."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError(
            n, f"not valid JSON ({e.msg}); expected one object per line like "
            f'{{"{column}": "..."}}',
        ) from None  # fmt: skip
    if not isinstance(record, dict) or column not in record:
        from plait.data.instruct import is_instruction

        if is_instruction(record):
            raise RecordError(
                n, "an instruction record; pass that .jsonl file itself as --data "
                "(instruction data is one file)",
            )  # fmt: skip
        if column != DEFAULT_TEXT_COLUMN:
            raise RecordError(n, f"no {column!r} field (--text-column {column})")
        raise RecordError(n, 'no \'text\' field; expected {"text": "..."}')
    text = record[column]
    if not isinstance(text, str):
        raise RecordError(n, f"{column!r} is {type(text).__name__}, expected a string")
    return text
