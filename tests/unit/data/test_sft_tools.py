"""Fine-tuning on tool-using conversations (titan_tpu/data/sft_examples.py with chat_masks.py).

A `messages` record with a `tools` field, assistant `tool_calls` and `tool` turns, on Qwen 3 and
`chatml_bytes`: the ids are the conversation rendered with its tools, and the trained tokens are
exactly the assistant turns (the call turns and the answer, each through its end of turn); the
tools' text, the tool results and the user turns are not. Bugs caught: `tools` not passed to the
template (the ids lack the tools' text), tool results trained on (the negative control: such a
mask fails the same assertion), a tools field of the wrong shape accepted or reported without the
record's place, tools given twice (record and sft.template_switches), tools on plain-text records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat_fixtures import checkpoint_folder
from tests.support.tool_conversations import EPISODE, TOOLS
from titan_tpu.data.chat_masks import MaskedTokens, conversational_completion_tokens
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.chat_tokenizer import CHATML_BYTES, tokenizer_folder
from titan_tpu.data.sft_examples import RecordFields, record_tokens
from titan_tpu.data.tokenizer import HFTokenizer

CONVERSATION = EPISODE[:-1]  # ends with the answer
CALLS_1 = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
CALLS_2 = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6+1"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "Two times three is 6, and Paris is sunny."
# The trained text of CONVERSATION, run by run: Qwen 3 writes an empty reasoning block into the last turn.
TRAINED = {
    CHATML_BYTES: [f"{CALLS_1}<|im_end|>", f"{CALLS_2}<|im_end|>", f"{ANSWER}<|im_end|>"],
    "qwen3": [f"{CALLS_1}<|im_end|>", f"{CALLS_2}<|im_end|>", f"<think>\n\n</think>\n\n{ANSWER}<|im_end|>"],
}


def _setup(tmp_path: Path, family: str) -> tuple[ChatTemplate, HFTokenizer]:
    folder = tokenizer_folder(CHATML_BYTES) if family == CHATML_BYTES else checkpoint_folder(tmp_path, family)
    return ChatTemplate.from_folder(folder), HFTokenizer(folder / "tokenizer.json")


def _runs(tokenizer: HFTokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded text of each maximal run of tokens whose mask is True."""
    runs: list[list[int]] = []
    for i, (token, on) in enumerate(zip(ids, mask)):
        if on and (i == 0 or not mask[i - 1]):
            runs.append([])
        if on:
            runs[-1].append(token)
    return [tokenizer.decode(run) for run in runs]


def _tokens(template: ChatTemplate, tokenizer: HFTokenizer, record: dict[str, Any], **switches: Any) -> MaskedTokens:
    return record_tokens(record, "tools.jsonl:4", RecordFields(), template, tokenizer, "assistant", switches)


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_assistant_calls_and_answer_are_trained_tools_and_results_are_not(tmp_path: Path, family: str) -> None:
    template, tokenizer = _setup(tmp_path, family)
    masked = _tokens(template, tokenizer, {"messages": CONVERSATION, "tools": TOOLS})
    text = template.render(CONVERSATION, tools=TOOLS)
    assert masked.ids == tokenizer.encode(text)
    assert _runs(tokenizer, masked.ids, masked.trained) == TRAINED[family]
    untrained = "".join(_runs(tokenizer, masked.ids, [not t for t in masked.trained]))
    assert "# Tools" in untrained and '"name": "weather"' in untrained
    assert "<tool_response>\n6\n</tool_response>" in untrained and "<tool_response>\n7\n</tool_response>" in untrained

    # Negative control: a mask that also trained the tool results fails the same assertion.
    ids, offsets = tokenizer.encode_with_offsets(text)
    results = [(i, text.index("<|im_end|>", i)) for i in range(len(text)) if text.startswith("<tool_response>", i)]
    with_results = [
        t or any(s < end and e > start for start, end in results) for t, (s, e) in zip(masked.trained, offsets)
    ]
    assert ids == masked.ids and with_results != masked.trained
    assert _runs(tokenizer, ids, with_results) != TRAINED[family]


def test_the_tools_field_is_rendered_and_may_be_a_json_string(tmp_path: Path) -> None:
    template, tokenizer = _setup(tmp_path, "qwen3")
    offered = _tokens(template, tokenizer, {"messages": CONVERSATION, "tools": TOOLS})
    assert _tokens(template, tokenizer, {"messages": CONVERSATION, "tools": json.dumps(TOOLS)}) == offered
    assert _tokens(template, tokenizer, {"messages": CONVERSATION, "tools": None}) != offered  # a null offers none
    # sft.template_switches may offer the tools of every record instead.
    assert _tokens(template, tokenizer, {"messages": CONVERSATION}, tools=TOOLS) == offered
    # Conversational prompt/completion records take them too, as TRL's SFTTrainer does.
    record = {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3], "tools": TOOLS}
    got = record_tokens(record, "r", RecordFields(), template, tokenizer, "completion", {})
    assert got == conversational_completion_tokens(
        template, tokenizer, CONVERSATION[:2], CONVERSATION[2:3], "completion", "r", tools=TOOLS
    )
    assert "# Tools" in tokenizer.decode(got.ids)


BAD_TOOLS = {
    "'tools' is a string that is not JSON": "calculator",
    "'tools' must be a list of JSON-schema objects, got dict": TOOLS[0],
    r"'tools'\[1\] must be a JSON-schema object, got str": [TOOLS[0], "weather"],
}


@pytest.mark.parametrize("reason", sorted(BAD_TOOLS))
def test_bad_tools_are_one_line_naming_the_record(tmp_path: Path, reason: str) -> None:
    template, tokenizer = _setup(tmp_path, CHATML_BYTES)
    with pytest.raises(ChatTemplateError, match=f"^tools.jsonl:4: {reason}") as err:
        _tokens(template, tokenizer, {"messages": CONVERSATION, "tools": BAD_TOOLS[reason]})
    assert "\n" not in str(err.value)


def test_tools_given_twice_or_to_plain_text_are_refused(tmp_path: Path) -> None:
    template, tokenizer = _setup(tmp_path, CHATML_BYTES)
    with pytest.raises(ChatTemplateError, match="^tools.jsonl:4: the record offers 'tools' and sft.template_switches"):
        _tokens(template, tokenizer, {"messages": CONVERSATION, "tools": TOOLS}, tools=TOOLS)
    record = {"prompt": "Two times three?", "completion": "6", "tools": TOOLS}
    with pytest.raises(ChatTemplateError, match="^r: tools are rendered with a conversation"):
        record_tokens(record, "r", RecordFields(), template, tokenizer, "completion", {})
