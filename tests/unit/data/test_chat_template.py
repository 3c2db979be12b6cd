"""Chat templates rendered as transformers' `apply_chat_template` renders them (titan_tpu/data/chat_template.py).

On the published Qwen 3 and Llama 3.1 templates (tests/support/chat_fixtures.py) and a multi-turn
conversation with a system prompt: the same text and the same token ids, with and without the
generation prompt and Qwen 3's thinking switch. Bugs caught: Jinja settings that change whitespace
(trim_blocks, lstrip_blocks), a missing helper or special-token variable, None fields passed to the
template, reasoning kept in earlier turns, a template read from the wrong file; and bad templates
or folders reported as anything but one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.support.chat_fixtures import CONVERSATION, checkpoint_folder, published_template
from titan_tpu.config import ConfigError
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.tokenizer import HFTokenizer

CASES = [
    ("qwen3", {}),
    ("qwen3", {"enable_thinking": False}),
    ("qwen3", {"enable_thinking": True}),
    ("llama3_1", {}),
    ("llama3_1", {"date_string": "1 Dec 2026"}),
]


@pytest.mark.parametrize(("family", "switches"), CASES)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_text_and_ids_equal_apply_chat_template(
    tmp_path: Path, family: str, switches: dict, add_generation_prompt: bool
) -> None:
    folder = checkpoint_folder(tmp_path, family)
    reference = AutoTokenizer.from_pretrained(folder)
    template = ChatTemplate.from_folder(folder)
    tokenizer = HFTokenizer(folder / "tokenizer.json")
    # With the generation prompt the conversation ends on a user turn, as a prompt would.
    messages = CONVERSATION[:-1] if add_generation_prompt else CONVERSATION
    want = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **switches
    )
    want_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False, **switches
    )
    got = template.render(messages, add_generation_prompt=add_generation_prompt, **switches)
    assert got == want
    assert tokenizer.encode(got) == list(want_ids)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_under_any_of_its_names_renders_as_apply_chat_template(tmp_path: Path, field: str) -> None:
    folder = checkpoint_folder(tmp_path, "qwen3")
    messages = [*CONVERSATION[:-1], {"role": "assistant", "content": "Thirteen.", field: "Eleven is too small."}]
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False)
    assert "Eleven is too small." in want
    assert ChatTemplate.from_folder(folder).render(messages) == want


def test_qwen3_drops_reasoning_before_the_last_user_turn_and_the_switch_changes_the_prompt(tmp_path: Path) -> None:
    """The renderings differ where the template says they do: a renderer that ignored the switches or
    the template's own logic would pass a parity test only by accident."""
    template = ChatTemplate.from_folder(checkpoint_folder(tmp_path, "qwen3"))
    text = template.render(CONVERSATION)
    assert "Two and two make four" not in text  # the first answer's reasoning is dropped
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThirteen.<|im_end|>\n")
    prompt = CONVERSATION[:-1]
    thinking = template.render(prompt, add_generation_prompt=True)
    not_thinking = template.render(prompt, add_generation_prompt=True, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"


def test_llama3_takes_its_bos_from_the_tokenizer_config(tmp_path: Path) -> None:
    template = ChatTemplate.from_folder(checkpoint_folder(tmp_path, "llama3_1"))
    assert template.render(CONVERSATION).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")


def test_a_chat_template_jinja_file_and_an_override_win_over_the_config(tmp_path: Path) -> None:
    folder = checkpoint_folder(tmp_path, "qwen3")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert ChatTemplate.from_folder(folder).render(CONVERSATION[:2]) == "[system][user]"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ eos_token }}{{ messages | length }}")
    assert ChatTemplate.from_folder(folder, override).render(CONVERSATION) == "<|im_end|>5"


def test_a_folder_without_a_template_is_one_line_naming_it(tmp_path: Path) -> None:
    folder = checkpoint_folder(tmp_path, "qwen3", with_template=False)
    with pytest.raises(ConfigError, match=f"^{folder}: no chat template .*data.chat_template") as err:
        ChatTemplate.from_folder(folder)
    assert "\n" not in str(err.value)
    # The override supplies one; the special tokens still come from the folder.
    override = tmp_path / "t.jinja"
    override.write_text(published_template("qwen3"))
    assert ChatTemplate.from_folder(folder, override).tokens == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }


def test_broken_templates_and_refused_conversations_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^chat template x: line 1: "):
        ChatTemplate("{% if %}", {}, "x")
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", {}, "t.jinja")
    with pytest.raises(ChatTemplateError, match=r"^chat template t.jinja: roles must alternate$"):
        refusing.render(CONVERSATION)
    failing = ChatTemplate("{{ messages[7].content }}", {}, "t.jinja")
    with pytest.raises(ChatTemplateError, match=r"^chat template t.jinja"):
        failing.render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        refusing.render([])


def test_named_templates_take_the_default_and_a_list_without_one_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "named"
    folder.mkdir()
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_folder(folder).render(CONVERSATION) == "D"
    config["chat_template"] = config["chat_template"][:1]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no 'default'"):
        ChatTemplate.from_folder(folder)


def test_the_template_runs_sandboxed(tmp_path: Path) -> None:
    """A template is code from a download: it may not reach Python internals."""
    escaping = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {}, "evil.jinja")
    with pytest.raises(ChatTemplateError, match="evil.jinja"):
        escaping.render(CONVERSATION)
