"""Where the training text comes from: an ordered stream of documents.

``--data`` picks one of four sources:

- nothing: the embedded default corpus, i.e. the Python standard library's own ``*.py``
  files on this machine (``sysconfig.get_paths()["stdlib"]``, test folders left out,
  about 12 MB). Every machine with Python has it, nothing to download, and source code
  is a good corpus for a small model.
- a text file: one document.
- a folder: every text file under it (``TEXT_SUFFIXES``, plus JSON Lines files), one
  document per file (per line for JSON Lines). Hidden folders and ``__pycache__`` are skipped.
- a JSON Lines file (``JSONL_SUFFIXES``): one document per line, taken from its "text" field;
  or instruction data (``prompt`` / ``completion`` or chat ``messages`` records), whose loss
  is taken on the answers only (``instruct.py``).

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

from plait.errors import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".jsonlines", ".ndjson", ".json")

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


@dataclass(frozen=True)
class Corpus:
    """A discovered source of text: which files, in which order, and how to name them."""

    label: str  # how messages name the source: "--data books/" or "the embedded corpus"
    kind: str  # "stdlib" | "file" | "folder"
    root: Path  # the folder (stdlib, folder) or the file itself
    files: tuple[Path, ...]  # absolute paths, in document order
    user_path: str | None = None  # --data exactly as given, for messages
    instruct: bool = False  # instruction examples (instruct.py), not documents

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
            if self.instruct:  # the rendering is part of what the tokens are
                from plait.data.instruct import TEMPLATE

                out["instruct"] = TEMPLATE
            return out
        listing = []
        for f in self.files:
            st = f.stat()
            rel = f.name if self.kind == "file" else f.relative_to(self.root).as_posix()
            listing.append([rel, st.st_size, st.st_mtime_ns])
        out = {"kind": self.kind, "root": str(self.root), "files": listing}
        if self.instruct:
            from plait.data.instruct import TEMPLATE

            out["instruct"] = TEMPLATE
        return out

    def display(self, f: Path) -> str:
        """How messages name one file: as the user would type it."""
        if self.kind == "file":
            return self.user_path or str(f)
        if self.kind == "folder":
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
        skipped, replaced = [], 0
        for f in self.files:
            if _format(f) == "jsonl":
                yield from _jsonl_documents(f, self.display(f))
                continue
            data = f.read_bytes()
            if b"\x00" in data[:BINARY_SNIFF_BYTES]:
                if self.kind == "file":
                    raise DataError(
                        f"--data {self.display(f)}: looks like a binary file, not text; pass a "
                        "text file, a folder of text files or a .jsonl file"
                    )
                skipped.append(self.display(f))
                continue
            try:
                text = data.decode("utf-8-sig")
            except UnicodeDecodeError:
                text = data.decode("utf-8-sig", errors="replace")
                replaced += 1
            if text.strip():
                yield text
        if log and skipped:
            log(f"data: skipped {len(skipped)} binary file(s) in {self.label}, e.g. {skipped[0]}")
        if log and replaced:
            log(f"data: {replaced} file(s) in {self.label} had bytes that are not UTF-8 (replaced)")

    def examples(self, chat=None):
        """Instruction examples as (text, trained) segments (``instruct.py``; ``chat``: a
        tokenizer's chat template to render conversations with)."""
        from plait.data import instruct

        for f in self.files:
            yield from instruct.examples(f, self.display(f), chat)


def find_corpus(path: str | None) -> Corpus:
    """Resolve ``--data`` (None: the embedded corpus) to a Corpus, or raise DataError."""
    if path is None:
        root = stdlib_root()
        return Corpus("the embedded corpus", "stdlib", root, tuple(stdlib_files(root)))
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if p.is_dir():
        files = _walk(p, USER_EXCLUDED_DIRS, TEXT_SUFFIXES + JSONL_SUFFIXES)
        if not files:
            looked = ", ".join(f"*{s}" for s in TEXT_SUFFIXES + JSONL_SUFFIXES)
            raise DataError(
                f"--data {path}: no text found (looked for {looked} in it and its subfolders)"
            )
        return Corpus(f"--data {path}", "folder", p, tuple(files), path)
    if not p.is_file():
        raise DataError(f"--data {path}: not a regular file or folder")
    if p.stat().st_size == 0:
        raise DataError(f"--data {path}: the file is empty")
    instruct = False
    if _format(p) == "jsonl":
        from plait.data.instruct import first_record, is_instruction

        instruct = is_instruction(first_record(p))
    return Corpus(f"--data {path}", "file", p, (p,), path, instruct=instruct)


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
    return "jsonl" if f.suffix.lower() in JSONL_SUFFIXES else "text"


def _jsonl_documents(f: Path, shown: str) -> Iterator[str]:
    with open(f, encoding="utf-8-sig", errors="replace") as lines:
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"--data {shown} line {n}: not valid JSON ({e.msg}); expected one object "
                    'per line like {"text": "..."}'
                ) from None
            if not isinstance(record, dict) or "text" not in record:
                from plait.data.instruct import is_instruction

                if is_instruction(record):
                    raise DataError(
                        f"--data {shown} line {n}: an instruction record; pass that .jsonl "
                        "file itself as --data (instruction data is one file)"
                    )
                raise DataError(
                    f'--data {shown} line {n}: no \'text\' field; expected {{"text": "..."}}'
                )
            text = record["text"]
            if not isinstance(text, str):
                raise DataError(
                    f"--data {shown} line {n}: 'text' is {type(text).__name__}, expected a string"
                )
            if text.strip():
                yield text
