"""The text a multi-turn rollout appends after each sampled turn (titan_tpu/data/chat_delta.py).

A rollout's tokens are the first prompt's, then per turn the ids sampled (through the end-of-turn
token) and the delta's. On a three-turn tool episode with `chatml_bytes` and Qwen 3 (and a
two-turn one with Qwen 3's reasoning), built from each turn as the rollout sees it (the sampled
text parsed, `ModelTurn.message()`), those tokens are the ids of the whole episode rendered and
tokenized at once: a delta that starts a character early or late, drops the newline after the end
of turn, leaves out the generation prompt or renders without the tools fails it. With Qwen 3's
thinking off the delta is still found (the template rewrites the last turn once others follow).

Negative controls, why the rollout must not render the conversation again: a call sampled without
spaces, and bytes that are not UTF-8, come back as other ids. A template whose earlier turns change
once more follow is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.chat_fixtures import checkpoint_folder
from tests.support.tool_conversations import ASSISTANT_TURNS, EPISODE, TOOLS
from titan_tpu.data.chat_delta import first_prompt, turn_delta
from titan_tpu.data.chat_masks import assistant_spans
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.chat_tokenizer import CHATML_BYTES, tokenizer_folder
from titan_tpu.data.tokenizer import HFTokenizer
from titan_tpu.data.tool_calls import parse_model_turn

EOT = "<|im_end|>"


def _setup(tmp_path: Path, family: str) -> tuple[ChatTemplate, HFTokenizer]:
    folder = tokenizer_folder(CHATML_BYTES) if family == CHATML_BYTES else checkpoint_folder(tmp_path, family)
    return ChatTemplate.from_folder(folder), HFTokenizer(folder / "tokenizer.json")


def _with_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**m, "content": f"<think>\nTurn {i}.\n</think>\n\n{m['content']}"} if m["role"] == "assistant" else m
        for i, m in enumerate(messages)
    ]


# (family, the episode, its assistant turns): the whole episode renders every turn as sampled.
EPISODES = {
    "chatml_bytes": (CHATML_BYTES, EPISODE, ASSISTANT_TURNS),
    "qwen3": ("qwen3", EPISODE, ASSISTANT_TURNS),
    # Qwen 3 keeps reasoning of the turns after the last user message: end on the tool results.
    "qwen3 reasoning": ("qwen3", _with_reasoning(EPISODE[:7]), ASSISTANT_TURNS[:2]),
}


@pytest.mark.parametrize("case", sorted(EPISODES))
def test_prompt_then_sampled_turns_and_deltas_are_the_whole_episodes_ids(tmp_path: Path, case: str) -> None:
    family, episode, turns = EPISODES[case]
    template, tokenizer = _setup(tmp_path, family)
    # What the model samples for each turn: the turn as the whole episode renders it, through its end of turn.
    text, spans = assistant_spans(template, episode, "episode", tools=TOOLS)
    ids = tokenizer.encode(first_prompt(template, episode[: turns[0]], TOOLS))
    history = list(episode[: turns[0]])
    for n, (k, (start, end)) in enumerate(zip(turns, spans)):
        sampled = text[start:end]
        assert sampled.endswith(EOT)
        ids += tokenizer.encode(sampled)
        history.append(parse_model_turn(sampled.removesuffix(EOT), finished=True).message())
        answer = episode[k + 1 : turns[n + 1] if n + 1 < len(turns) else len(episode)]
        delta = turn_delta(template, history, answer, TOOLS)
        assert delta.startswith("\n<|im_start|>") and delta.endswith("<|im_start|>assistant\n")
        ids += tokenizer.encode(delta)
        history += answer
    assert len(history) == len(episode)
    assert ids == tokenizer.encode(template.render(episode, add_generation_prompt=True, tools=TOOLS))


def test_the_delta_of_a_tool_result_is_the_user_turn_and_the_next_prompt(tmp_path: Path) -> None:
    template, _ = _setup(tmp_path, CHATML_BYTES)
    delta = turn_delta(template, EPISODE[:3], EPISODE[3:4], TOOLS)
    assert delta == "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_without_thinking_finds_the_turn_it_rewrites(tmp_path: Path) -> None:
    """Qwen 3 writes an empty <think></think> into the last turn alone, so the history rendered alone
    is not a prefix of the longer conversation; the delta is still what follows the end of turn."""
    template, _ = _setup(tmp_path, "qwen3")
    history = [*EPISODE[:2], {"role": "assistant", "content": "", "tool_calls": EPISODE[2]["tool_calls"]}]
    alone = template.render(history, tools=TOOLS, enable_thinking=False)
    whole = template.render([*history, EPISODE[3]], add_generation_prompt=True, tools=TOOLS, enable_thinking=False)
    assert not whole.startswith(alone[: alone.rindex(EOT)])  # the case the fallback is for
    assert turn_delta(template, history, EPISODE[3:4], TOOLS, enable_thinking=False) == (
        "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


@pytest.mark.parametrize("family", [CHATML_BYTES, "qwen3"])
def test_negative_control_a_compact_call_rendered_again_is_other_ids(tmp_path: Path, family: str) -> None:
    template, tokenizer = _setup(tmp_path, family)
    prompt = first_prompt(template, EPISODE[:2], TOOLS)
    sampled_text = '<tool_call>\n{"name":"calculator","arguments":{"expression":"2*3"}}\n</tool_call>'
    sampled = tokenizer.encode(sampled_text + EOT)
    turn = parse_model_turn(sampled_text, finished=True)
    assert turn.call_errors == () and turn.tool_calls[0].arguments == {"expression": "2*3"}
    history = [*EPISODE[:2], turn.message()]
    rollout = tokenizer.encode(prompt) + sampled + tokenizer.encode(turn_delta(template, history, EPISODE[3:4], TOOLS))
    rendered = tokenizer.encode(template.render([*history, EPISODE[3]], add_generation_prompt=True, tools=TOOLS))
    assert rollout[len(tokenizer.encode(prompt)) :][: len(sampled)] == sampled
    assert rendered != rollout  # tojson wrote '{"name": "calculator", ...}': not what was sampled
    assert '{"name": "calculator", "arguments": {"expression": "2*3"}}' in tokenizer.decode(rendered)


def test_negative_control_bytes_that_are_not_utf8_come_back_as_other_ids(tmp_path: Path) -> None:
    template, tokenizer = _setup(tmp_path, CHATML_BYTES)
    prompt = tokenizer.encode(first_prompt(template, EPISODE[:2]))
    sampled = tokenizer.encode("It is ☃")[:-1] + tokenizer.encode(EOT)  # the snowman's last byte never sampled
    text = tokenizer.decode(sampled[:-1])
    assert text.endswith("\ufffd")  # what decoding makes of the cut character
    history = [*EPISODE[:2], parse_model_turn(text, finished=True).message()]
    rollout = prompt + sampled + tokenizer.encode(turn_delta(template, history, EPISODE[-1:]))
    rendered = tokenizer.encode(template.render([*history, EPISODE[-1]], add_generation_prompt=True))
    assert rollout[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert len(rendered) == len(rollout) + 1  # U+FFFD is three bytes where two were sampled
    assert rendered != rollout


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line() -> None:
    counting = ChatTemplate(
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        {},
        "counting.jinja",
    )
    history = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    with pytest.raises(
        ChatTemplateError, match=r"^chat template counting.jinja renders the conversation before"
    ) as err:
        turn_delta(counting, history, [{"role": "user", "content": "And?"}])
    assert "\n" not in str(err.value)
    with pytest.raises(ChatTemplateError, match="must end with one"):
        turn_delta(counting, history[:1], [])
