"""A fine-tuning record in either shape -> ids and mask (titan_tpu/data/sft_examples.py).

Bugs caught: a shape routed to the wrong masking (a prompt/completion list rendered as plain text),
the configured field names ignored, a record in neither shape accepted or reported without its
place and the fields looked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chat_fixtures import CONVERSATION, checkpoint_folder
from titan_tpu.data.chat_masks import completion_tokens, conversation_tokens, conversational_completion_tokens
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.sft_examples import RecordFields, record_tokens
from titan_tpu.data.tokenizer import HFTokenizer


def test_each_shape_takes_its_own_masking(tmp_path: Path) -> None:
    folder = checkpoint_folder(tmp_path, "qwen3")
    template, tokenizer = ChatTemplate.from_folder(folder), HFTokenizer(folder / "tokenizer.json")
    fields = RecordFields(messages="chat", prompt="q", completion="a")

    def tokens(record: dict, train_on: str = "assistant"):
        return record_tokens(record, "r:1", fields, template, tokenizer, train_on, {})  # type: ignore[arg-type]

    assert tokens({"chat": CONVERSATION}) == conversation_tokens(template, tokenizer, CONVERSATION, "assistant", "r:1")
    assert tokens({"q": "Two plus two?", "a": " Four."}, "completion") == completion_tokens(
        tokenizer, "Two plus two?", " Four.", "<|im_end|>", None, "completion", "r:1"
    )
    turns = {"q": CONVERSATION[:2], "a": CONVERSATION[2:3]}
    assert tokens(turns, "completion") == conversational_completion_tokens(
        template, tokenizer, CONVERSATION[:2], CONVERSATION[2:3], "completion", "r:1"
    )
    with pytest.raises(
        ChatTemplateError, match=r"^r:1: no 'chat' field and no 'q'/'a' pair \(the record has messages\)"
    ):
        tokens({"messages": CONVERSATION})
    with pytest.raises(ChatTemplateError, match="must both be strings or both lists of turns, got str and list"):
        tokens({"q": "x", "a": []})
