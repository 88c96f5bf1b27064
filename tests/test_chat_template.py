"""Chat data through a tokenizer folder's own chat template (``instruct.ChatTemplate``):
the token stream is the conversation as ``transformers``' ``apply_chat_template`` renders
it, the loss mask covers exactly the assistant turns (content and end-of-turn), the
template's special tokens are single ids, and a template that cannot be cut into turns
is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plait.data import DataConfig, DataError, prepare
from plait.data.tokenizer import train_bpe

# Qwen2.5's ChatML shape (default system prompt included) and Llama 3's header shape
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "upper ant bee"}, {"role": "assistant", "content": "ANT BEE"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse cat dog"},
     {"role": "assistant", "content": "dog cat"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "dog cat"}],
]  # fmt: skip


def tokenizer_folder(folder: Path, template: str, *, as_file: bool) -> Path:
    """A BPE tokenizer with the templates' special tokens, and ``template`` as
    ``chat_template.jinja`` (``as_file``) or in ``tokenizer_config.json``."""
    folder.mkdir(parents=True)
    tok = train_bpe(["the ant and the bee, the cat and the dog " * 20], vocab_size=300)
    tok._tok.add_special_tokens(SPECIAL)
    tok.save(folder / "tokenizer.json")
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if as_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        conf["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))
    return folder


def _data(tmp_path: Path, folder: Path, chats=CHATS) -> DataConfig:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats * 20))
    return DataConfig(path=str(path), tokenizer=str(folder), cache_dir=str(tmp_path / "cache"),
                      val_fraction=0.05)  # fmt: skip


@pytest.mark.parametrize("template, as_file", [(CHATML, False), (LLAMA3, True)])
def test_conversations_render_with_the_folders_template(template, as_file, tmp_path):
    """Catches plait's own rendering used where the folder has a template, a mask that
    trains a header, a user turn or the default system prompt (or misses an end-of-turn
    token), and special tokens split into characters."""
    import transformers

    folder = tokenizer_folder(tmp_path / "tok", template, as_file=as_file)
    data = prepare(_data(tmp_path, folder))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    tok = data.tokenizer
    ids = np.concatenate([data.train, data.val]).astype(np.int64)
    mask = np.concatenate([data.train_mask, data.val_mask]).astype(bool)
    # the stream: each conversation as the template renders it, then the end of text
    stream = tok.decode(ids.tolist())
    rendered = [theirs.apply_chat_template(c, tokenize=False) for c in CHATS]
    assert stream == "".join(r + "<|endoftext|>" for r in rendered) * 20
    # special tokens are one id each
    for s in SPECIAL[:2] if template == CHATML else SPECIAL[2:]:
        assert (ids == theirs.convert_tokens_to_ids(s)).sum() > 0, s
    # the mask: exactly each assistant turn's content and its end-of-turn (the example's
    # end of text too, after a final assistant turn), in order
    end = "<|im_end|>\n" if template == CHATML else "<|eot_id|>"
    trained, run = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            run.append(i)
        elif run:
            trained.append(tok.decode(run))
            run = []
    if run:
        trained.append(tok.decode(run))
    want = []
    for c in CHATS:
        answers = [m["content"] + end for m in c if m["role"] == "assistant"]
        answers[-1] += "<|endoftext|>"
        want += answers
    assert trained == want * 20


def test_without_a_template_plaits_own_rendering(tmp_path):
    """Catches a template picked up from a folder that has none (the cache key and the
    rendering stay plait's)."""
    folder = tokenizer_folder(tmp_path / "tok", CHATML, as_file=False)
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    del conf["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(conf))
    data = prepare(_data(tmp_path, folder))
    assert data.tokenizer.decode(data.train[:40].tolist()).startswith("<|user|>\nupper ant")


def test_a_template_that_cannot_be_cut_into_turns_is_one_line(tmp_path):
    """A template whose earlier turns change once a later one follows (here: the turn
    count up front) has no assistant spans to train on: one DataError naming the line."""
    counted = "{{ messages | length }}:" + CHATML
    folder = tokenizer_folder(tmp_path / "tok", counted, as_file=True)
    with pytest.raises(DataError, match=r"chat\.jsonl line 1: the chat template of .* renders "
                                        "earlier turns differently"):  # fmt: skip
        prepare(_data(tmp_path, folder))


def test_the_template_goes_out_with_the_exported_tokenizer(tmp_path):
    """Catches an export whose tokenizer loses the chat template the run was trained in
    (transformers would then chat in another format, or refuse to)."""
    import transformers

    from plait.data.instruct import chat_template
    from plait.data.tokenizer import load_tokenizer
    from plait.model import hf
    from plait.model.config import ModelConfig

    folder = tokenizer_folder(tmp_path / "tok", LLAMA3, as_file=True)
    chat = chat_template(str(folder))
    out = tmp_path / "out"
    out.mkdir()
    assert hf.save_tokenizer(out, load_tokenizer(folder), ModelConfig(), chat.template)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours = transformers.AutoTokenizer.from_pretrained(folder)
    assert theirs.apply_chat_template(CHATS[1], tokenize=False) == ours.apply_chat_template(
        CHATS[1], tokenize=False
    )
