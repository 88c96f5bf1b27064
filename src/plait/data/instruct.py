"""Instruction data: examples whose loss is taken on the answer only.

``--data FILE.jsonl`` whose first record has one of these shapes (every line must then
have it too) is instruction data rather than documents:

    {"prompt": "def add(a, b):\\n", "completion": "    return a + b\\n"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

An example is a list of segments (text, trained). Rendering (``TEMPLATE``, version 1):

- prompt / completion: the prompt, then the completion, concatenated as they are (write
  the separator you want into the prompt); the completion is trained.
- messages: each message as ``<|ROLE|>\\n`` + content + ``\\n``; an assistant message's
  content and its newline are trained, everything else (headers, system and user turns)
  is context.
- messages, when ``--tokenizer`` is a Hugging Face tokenizer folder with a chat template
  (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``): the
  conversation as the template renders it (``ChatTemplate``: transformers'
  ``apply_chat_template``). Each assistant turn is trained as what the template adds to
  the conversation before it rendered with the generation prompt -- its content and its
  end-of-turn token, not the header the prompt already holds -- so the mask follows the
  assistant turns in the model's own format. Special tokens the template writes
  (``<|im_start|>``, ``<|eot_id|>``) are encoded as the special tokens they are.

Each segment is tokenised on its own (a BPE merge never straddles a prompt / completion
boundary, so the boundary between context and targets is exact), and the example ends
with the end-of-text token, trained when the example's last segment is (the model learns
to stop). Examples follow one another in the token stream like documents; the loss
mask (1 = the token is a target the loss is taken on) is stored beside the tokens
(``tokens.py``) and the sampler turns it into ignored targets (``sampler.py``). Packing
several examples into one window is what the pretraining stream does with documents:
attention is causal across the whole window, as in GPT-style packing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from plait.errors import DataError

TEMPLATE = 1  # bump when the rendering changes (it is part of the token cache's key)
ROLES = ("system", "user", "assistant")

Segments = list[tuple[str, bool]]


def is_instruction(record) -> bool:
    """Whether a JSON Lines record is an instruction example (not a ``text`` document)."""
    return (
        isinstance(record, dict)
        and "text" not in record
        and ("messages" in record or "prompt" in record or "completion" in record)
    )


def first_record(path: Path):
    """The first non-empty line of a JSON Lines file, parsed (None if it is not JSON)."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


class ChatTemplate:
    """The chat template of a Hugging Face tokenizer folder, rendered by transformers'
    ``apply_chat_template`` (the tokenizer is loaded on first use)."""

    def __init__(self, folder: Path, template: str | list):
        self.folder, self.template = folder, template  # as tokenizer_config.json holds it
        self._tokenizer = None

    @property
    def digest(self) -> str:
        """What the token cache is keyed on: the template's text."""
        return hashlib.sha256(json.dumps(self.template).encode()).hexdigest()

    def render(self, messages: list[dict], *, generation_prompt: bool, where: str) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja's TemplateError, or the template's raise_exception
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{where}: the chat template of {self.folder} fails ({reason})")


def chat_template(tokenizer: str) -> ChatTemplate | None:
    """The chat template of ``--tokenizer`` when it is a folder that has one, else None."""
    folder = Path(tokenizer).expanduser()
    if tokenizer in ("bpe", "bytes") or not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file():
        return ChatTemplate(folder, (folder / "chat_template.jinja").read_text(encoding="utf-8"))
    try:
        conf = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    template = conf.get("chat_template") if isinstance(conf, dict) else None
    return ChatTemplate(folder, template) if template else None


def _rendered(msgs: list[dict], chat: ChatTemplate, where: str) -> Segments:
    """A conversation's segments as ``chat`` renders it (module docstring): render the turns
    before each assistant message with the generation prompt (context), then with that
    message (what it adds is trained). A template whose earlier turns read differently
    once a later one follows cannot be cut so, and is refused."""
    out: Segments = []
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = chat.render(msgs[:i], generation_prompt=True, where=where)
        full = chat.render(msgs[: i + 1], generation_prompt=False, where=where)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError(
                f"{where}: the chat template of {chat.folder} renders earlier turns "
                "differently once a later one follows, so the assistant turns cannot be "
                "cut out; train on prompt / completion records instead"
            )
        out += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    whole = chat.render(msgs, generation_prompt=False, where=where)
    if whole.startswith(done):  # turns after the last assistant one: context
        out.append((whole[len(done) :], False))
    return [(text, trained) for text, trained in out if text]


def segments(record, where: str, chat: ChatTemplate | None = None) -> Segments:
    """The (text, trained) segments of one example; DataError naming ``where`` if bad.
    ``chat``: render chat ``messages`` with this template (module docstring)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with prompt/completion or messages")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        out: Segments = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] needs a string 'content'")
            role = m.get("role")
            if role not in ROLES:
                raise DataError(
                    f"{where}: messages[{i}] role {role!r}; use one of {', '.join(ROLES)}"
                )
            trained = role == "assistant"
            out.append((f"<|{role}|>\n", False))
            out.append((m["content"] + "\n", trained))
        if not any(t for _, t in out):
            raise DataError(f"{where}: no assistant message, so nothing to train on")
        if chat is not None:
            return _rendered([{"role": m["role"], "content": m["content"]} for m in msgs],
                             chat, where)  # fmt: skip
        return out
    for key in ("prompt", "completion"):
        if not isinstance(record.get(key), str):
            raise DataError(
                f"{where}: {key!r} missing or not a string; expected "
                '{"prompt": "...", "completion": "..."} or {"messages": [...]}'
            )
    if not record["completion"]:
        raise DataError(f"{where}: empty 'completion', so nothing to train on")
    return [(record["prompt"], False), (record["completion"], True)]


def examples(path: Path, shown: str, chat: ChatTemplate | None = None) -> Iterator[Segments]:
    """Every example of an instruction JSON Lines file, in file order (``chat``: see
    ``segments``)."""
    from plait.data.lines import RecordError, UnitStats

    try:
        yield from unit_examples(path, 0, path.stat().st_size, UnitStats(), chat)
    except RecordError as e:
        raise DataError(f"--data {shown} line {e.line}: {e.message}") from None


_HERE = "record"  # the ``where`` of unit_examples' errors, cut off again


def unit_examples(path: Path, start: int, stop: int, stats, chat: ChatTemplate | None = None
                  ) -> Iterator[Segments]:  # fmt: skip
    """The examples of the lines of ``path`` that start in bytes [start, stop) (a unit of
    ``corpus.py``, so workers can tokenise a file's byte ranges in parallel); a bad record
    raises ``lines.RecordError`` with its line in the unit (the caller knows the lines
    before it)."""
    from plait.data.lines import RecordError, jsonl_lines

    for n, line in jsonl_lines(path, start, stop, stats):
        try:
            ex = segments(json.loads(line), _HERE, chat)
        except json.JSONDecodeError as e:
            raise RecordError(n, f"not valid JSON ({e.msg})") from None
        except DataError as e:
            raise RecordError(n, str(e).removeprefix(f"{_HERE}: ")) from None
        yield ex


def encode(
    tokenizer, batch: list[Segments], *, special: bool = False
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each example: segments tokenised separately (one batch call), then
    the end-of-text token (module docstring); mask is uint8, 1 on trained tokens.
    ``special``: a special token's spelling in the text is that token (a chat template's
    rendering), not plain text (a corpus's)."""
    shards = [text for ex in batch for text, _ in ex]
    if special:
        encoded = iter(tokenizer.encode(text) for text in shards)
    else:
        encoded = iter(tokenizer.encode_batch(shards))
    out = []
    for ex in batch:
        ids, mask = [], []
        for _, trained in ex:
            part = np.asarray(next(encoded), dtype=np.uint32)
            ids.append(part)
            mask.append(np.full(len(part), trained, dtype=np.uint8))
        if tokenizer.eot_id is not None:
            ids.append(np.array([tokenizer.eot_id], dtype=np.uint32))
            mask.append(np.array([ex[-1][1]], dtype=np.uint8))
        out.append((np.concatenate(ids), np.concatenate(mask)))
    return out


def text(ex: Segments) -> str:
    """The example as plain text (what a tokenizer is trained on)."""
    return "".join(t for t, _ in ex)
