"""The built-in chat tokenizer folder and the tokenizer files an export carries
(titan_tpu/data/chat_tokenizer.py).

Bugs caught: a `chatml_bytes` folder that transformers loads differently from us (other ids for the
same conversation, other special tokens), a byte mapping that loses or merges bytes, an export that
leaves out the tokenizer or the run's own chat template."""

from __future__ import annotations

from pathlib import Path

from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.chat_tokenizer import CHATML_BYTES, tokenizer_export_files, tokenizer_folder
from titan_tpu.data.tokenizer import build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Spell héllo, ☃ and\ttabs."},
    {"role": "assistant", "content": "h-é-l-l-o"},
]


def test_transformers_renders_and_tokenizes_the_builtin_folder_as_we_do() -> None:
    from transformers import AutoTokenizer

    folder = tokenizer_folder(CHATML_BYTES)
    ours = build_tokenizer(CHATML_BYTES)
    theirs = AutoTokenizer.from_pretrained(str(folder))
    text = ChatTemplate.from_folder(folder).render(CONVERSATION)
    for prompt in (False, True):
        expected = theirs.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=prompt)
        expected = expected if isinstance(expected, list) else expected["input_ids"]
        rendered = ChatTemplate.from_folder(folder).render(CONVERSATION, add_generation_prompt=prompt)
        assert ours.encode(rendered) == expected
    ids = ours.encode(text)
    # One token per UTF-8 byte outside the special tokens, and back to the same text.
    assert len(ids) == len(text.replace("<|im_start|>", "S").replace("<|im_end|>", "E").encode())
    assert ours.decode(ids) == theirs.decode(ids) == text
    assert (theirs.eos_token, theirs.pad_token, theirs.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_an_export_carries_the_tokenizer_and_the_runs_template(tmp_path: Path) -> None:
    files = tokenizer_export_files(CHATML_BYTES)
    assert sorted(files) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert all(path.is_file() for path in files.values())
    template = tmp_path / "mine.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert tokenizer_export_files(CHATML_BYTES, str(template))["chat_template.jinja"] == template
    assert tokenizer_export_files("byte") == {}
