"""Tokenizers: a byte-level BPE trained on the corpus, raw UTF-8 bytes, or a given file.

All of them offer the interface the trainer relies on: ``encode(str) -> list[int]``,
``decode(list[int]) -> str``, ``vocab_size``, ``eot_id`` (the end-of-text id that separates
documents, or None) and ``save(path)``; plus ``encode_batch`` and ``encode_concat`` to
tokenise a corpus fast.

- ``bpe``: GPT-2 style byte-level BPE trained with the ``tokenizers`` package. The vocabulary
  is 256 byte tokens, the special token ``<|endoftext|>`` (id 0) and the learned merges, in
  all ``vocab_size`` ids (fewer if the corpus is too small to learn that many merges).
- ``bytes``: 256 ids, the identity on UTF-8 bytes. Documents are separated by byte 0x03,
  ASCII "End of Text" (ETX): it keeps the vocabulary at exactly 256, and control character
  3 essentially never occurs in text, so the separator is unambiguous in practice.
- a path to a ``tokenizer.json`` (or a folder holding one): any tokenizer the ``tokenizers``
  package reads, or one written by ``ByteTokenizer.save``. Its end-of-text token is looked up
  by name (EOT_CANDIDATES); when it has none, ``eot_id`` is None and documents are simply
  concatenated.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.errors import DataError

EOT_TOKEN = "<|endoftext|>"
BYTES_EOT_ID = 3  # ASCII ETX, "End of Text"
# End-of-text spellings of common tokenizers, tried in order when loading a tokenizer.json.
EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """256 ids, one per byte of the UTF-8 encoding; decoding replaces invalid sequences."""

    vocab_size = 256
    eot_id = BYTES_EOT_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_concat(self, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch``'s ids back to back in ``dtype``, and each text's count."""
        parts = [t.encode("utf-8") for t in texts]
        ids = np.frombuffer(b"".join(parts), dtype=np.uint8).astype(dtype)
        return ids, np.array([len(b) for b in parts], dtype=np.int64)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"plait_tokenizer": "bytes", "eot_id": self.eot_id}))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind plait's interface."""

    def __init__(self, tok: Tokenizer, eot_id: int | None):
        self._tok = tok
        self.eot_id = eot_id
        # One past the largest id, which is the count unless a loaded file has gaps.
        ids = tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        # Here "<|endoftext|>" in the text means the special token, so a prompt can hold one.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Tokenise many documents on all cores. A corpus is data, not markup: a literal
        "<|endoftext|>" inside it (this very file has some) is encoded as plain text, so
        the only end-of-text ids in the token stream are the document separators."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._encodings(texts)]

    def encode_concat(self, texts: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch``'s ids back to back in ``dtype``, and each text's count: one
        array for the batch rather than one per text (the cache's dtype directly, no
        uint32 copy), which is what tokenising a corpus wants."""
        encodings = self._encodings(texts)
        lengths = np.array([len(e) for e in encodings], dtype=np.int64)
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=dtype,
                          count=int(lengths.sum()))  # fmt: skip
        return ids, lengths

    def _encodings(self, texts: list[str]) -> list:
        self._tok.encode_special_tokens = True  # (encode_batch's docstring)
        try:
            return self._tok.encode_batch_fast(texts, add_special_tokens=False)
        finally:
            self._tok.encode_special_tokens = False

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))


def train_bpe(documents: Iterable[str], *, vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (special token included) on the documents.

    Deterministic: the same documents give the same merges (checked with tokenizers 0.23),
    which matters when several machines each prepare their own cache.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer)
    return HFTokenizer(tok, tok.token_to_id(EOT_TOKEN))


def load_tokenizer(path: str | Path, *, flag: str = "--tokenizer") -> ByteTokenizer | HFTokenizer:
    """Load a tokenizer.json (a folder holding one works too); DataError if it cannot."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"{flag} {path}: no such file; use 'bpe', 'bytes' or a path to a tokenizer.json"
        )
    text = p.read_text(encoding="utf-8", errors="replace")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{flag} {path}: not valid JSON ({e.msg}); expected a tokenizer.json")
    if isinstance(spec, dict) and spec.get("plait_tokenizer") == "bytes":
        return ByteTokenizer()
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises plain Exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"{flag} {path}: not a tokenizer.json the tokenizers package can read ({reason})"
        )
    eot_id = next((i for t in EOT_CANDIDATES if (i := tok.token_to_id(t)) is not None), None)
    return HFTokenizer(tok, eot_id)


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """Storage type of token ids: uint16 while every id fits (vocab_size <= 65536)."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32
