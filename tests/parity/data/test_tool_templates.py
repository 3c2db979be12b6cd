"""Conversations with tools rendered as transformers' `apply_chat_template(..., tools=...)` renders them
(titan_tpu/data/chat_template.py, and the tool template of chat_tokenizer.py's `chatml_bytes`).

On the published Qwen 3 template and on `chatml_bytes`'s folder, as AutoTokenizer loads each: the
same text and the same token ids for tools offered, given as an empty list or not at all; tool calls
whose arguments are objects or JSON strings; two tool results in a row; with and without a system
message; with and without the generation prompt. Bugs caught: tools not passed to the template (or
passed as [] where transformers passes None), a `tojson` that escapes HTML in a schema, a tool
template in `chatml_bytes` that transformers renders otherwise (its folder is what an export
carries), and a checkpoint's named "tool_use" template not picked when tools are given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.support.chat_fixtures import checkpoint_folder, published_template
from tests.support.tool_conversations import EPISODE, TOOLS
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.chat_tokenizer import CHATML_BYTES, tokenizer_folder
from titan_tpu.data.tokenizer import HFTokenizer

# name -> (messages, add_generation_prompt): every ending a prompt or a training example has.
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], bool]] = {
    "after a user reply, prompting": (EPISODE, True),
    "ending with the answer": (EPISODE[:-1], False),
    "after two tool results, prompting": (EPISODE[:7], True),
    "no system message": (EPISODE[1:-1], False),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "qwen3": checkpoint_folder(tmp_path_factory.mktemp("qwen3"), "qwen3"),
        CHATML_BYTES: tokenizer_folder(CHATML_BYTES),
    }


def _assert_same(folder: Path, messages: list[dict[str, Any]], prompt: bool, tools: Any) -> str:
    reference = AutoTokenizer.from_pretrained(str(folder))
    want = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
    want_ids = reference.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=prompt, return_dict=False
    )
    got = ChatTemplate.from_folder(folder).render(messages, add_generation_prompt=prompt, tools=tools)
    assert got == want
    assert HFTokenizer(folder / "tokenizer.json").encode(got) == list(want_ids)
    return got


@pytest.mark.parametrize("family", ["qwen3", CHATML_BYTES])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_tools_offered_text_and_ids_equal_apply_chat_template(
    folders: dict[str, Path], family: str, conversation: str
) -> None:
    messages, prompt = CONVERSATIONS[conversation]
    text = _assert_same(folders[family], messages, prompt, TOOLS)
    # The parity means something only if the tools and calls are there, as the template words them.
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>' in text
    assert ("You are a helpful assistant. Answer briefly.\n\n# Tools" in text) == (messages[0]["role"] == "system")


@pytest.mark.parametrize("family", ["qwen3", CHATML_BYTES])
@pytest.mark.parametrize("tools", [None, []], ids=["none", "empty"])
def test_no_tools_offered_still_renders_calls_and_results(
    folders: dict[str, Path], family: str, tools: list[Any] | None
) -> None:
    text = _assert_same(folders[family], EPISODE, True, tools)
    assert "# Tools" not in text
    assert "<tool_response>\n7\n</tool_response>\n<tool_response>" in text


def test_a_named_tool_use_template_is_taken_whenever_tools_are_given(tmp_path: Path) -> None:
    """apply_chat_template picks a checkpoint's "tool_use" template when `tools` is not None, even []."""
    folder = checkpoint_folder(tmp_path, "qwen3", with_template=False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}[{{ m.role }}]{% endfor %}"},
        {"name": "tool_use", "template": published_template("qwen3")},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert _assert_same(folder, EPISODE, False, None).startswith("[system][user][assistant]")
    assert "<tool_response>" in _assert_same(folder, EPISODE, False, [])
    assert "# Tools" in _assert_same(folder, EPISODE, False, TOOLS)


@pytest.mark.parametrize("tools", ["calculator", TOOLS[0], [TOOLS[0], "weather"]])
def test_tools_that_are_not_a_list_of_schemas_are_one_line(folders: dict[str, Path], tools: Any) -> None:
    """transformers refuses a tool that is neither a schema nor a function (ValueError); a string or a
    single schema would otherwise render character by character or key by key."""
    with pytest.raises(ChatTemplateError, match=r"^tools(\[1\])? must be .*JSON-schema object") as err:
        ChatTemplate.from_folder(folders["qwen3"]).render(EPISODE, tools=tools)
    assert "\n" not in str(err.value)
