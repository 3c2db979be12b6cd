"""A preference record -> the ids of its prompt and its two completions (titan_tpu/data/preference_records.py).

Bugs caught: a completion that keeps prompt tokens (they would be scored) or loses its end-of-turn /
eos token (the model would never be taught where an answer stops), eos appended twice, the bos token
of a checkpoint that has one left out, the configured field names ignored, a conversational record
rendered without the template's generation prompt, and bad records accepted or reported without their
place, the fields looked for, or what is allowed. (The ids are checked against TRL's own tokenization
in tests/parity/tasks/test_dpo_trl_trainer.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chat_fixtures import checkpoint_folder
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.preference_records import PreferenceEncoder, PreferenceFields
from titan_tpu.data.tokenizer import HFTokenizer

QUESTION = [{"role": "user", "content": "What is two plus two?"}]
RIGHT = [{"role": "assistant", "content": "Four."}]
WRONG = [{"role": "assistant", "content": "Five."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: checkpoint_folder(root, family) for family in ("qwen3", "llama3_1")}


def encoder(folder: Path, fields: PreferenceFields | None = None) -> PreferenceEncoder:
    tokenizer, template = HFTokenizer(folder / "tokenizer.json"), ChatTemplate.from_folder(folder)
    return PreferenceEncoder(tokenizer, template, fields or PreferenceFields(), {})


def decoded(enc: PreferenceEncoder, ids: list[int]) -> str:
    return enc.tokenizer.decode(ids)  # type: ignore[attr-defined]  # an HFTokenizer here


def test_a_conversational_pair_is_the_generation_prompt_then_each_assistant_turn(folders: dict[str, Path]) -> None:
    enc = encoder(folders["llama3_1"], PreferenceFields("question", "good", "bad"))
    pair = enc.encode({"question": QUESTION, "good": RIGHT, "bad": WRONG}, "pairs.jsonl:1")
    template = enc.template
    assert pair.prompt == enc.tokenizer.encode(template.render(QUESTION, add_generation_prompt=True))
    assert decoded(enc, pair.chosen) == "Four.<|eot_id|>"
    assert decoded(enc, pair.rejected) == "Five.<|eot_id|>"
    assert pair.prompt + pair.chosen == enc.tokenizer.encode(template.render([*QUESTION, *RIGHT]))


def test_qwen3s_empty_thinking_block_belongs_to_the_completion(folders: dict[str, Path]) -> None:
    """Qwen 3's template writes an empty <think> block into the last answer of a whole conversation but
    not into the generation prompt: the completion starts where the two renderings part, as TRL's
    common-prefix rule puts it, and ends after the newline the template writes after the turn."""
    enc = encoder(folders["qwen3"])
    pair = enc.encode({"prompt": QUESTION, "chosen": RIGHT, "rejected": WRONG}, "r:1")
    assert decoded(enc, pair.prompt).endswith("<|im_start|>assistant\n")
    assert decoded(enc, pair.chosen) == "<think>\n\n</think>\n\nFour.<|im_end|>\n"


def test_plain_text_pairs_end_with_one_eos_and_start_with_bos(folders: dict[str, Path]) -> None:
    enc = encoder(folders["llama3_1"])
    pair = enc.encode({"prompt": "Two plus two is", "chosen": " four.", "rejected": " five.<|eot_id|>"}, "r:1")
    assert decoded(enc, pair.prompt) == "<|begin_of_text|>Two plus two is"
    assert decoded(enc, pair.chosen) == " four.<|eot_id|>"
    assert decoded(enc, pair.rejected) == " five.<|eot_id|>"  # already ended: not twice
    qwen = encoder(folders["qwen3"])  # no bos: the prompt is the text alone
    assert decoded(qwen, qwen.encode({"prompt": "Hi", "chosen": "a", "rejected": "b"}, "r:1").prompt) == "Hi"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"prompt": QUESTION, "chosen": RIGHT},
            r"^pairs\.jsonl:3: no 'rejected' field \(the record has chosen, prompt\); a preference record has "
            r"'prompt', 'chosen' and 'rejected' .*set dpo\.prompt_field",
        ),
        (
            {"prompt": QUESTION, "chosen": RIGHT, "rejected": RIGHT},
            r"^pairs\.jsonl:3: 'chosen' and 'rejected' are identical; a preference pair needs two different",
        ),
        (
            {"prompt": "q", "chosen": RIGHT, "rejected": WRONG},
            r"^pairs\.jsonl:3: 'prompt', 'chosen' and 'rejected' must be three strings or three lists of turns, "
            r"got str, list, list$",
        ),
        (
            {"prompt": QUESTION, "chosen": QUESTION, "rejected": WRONG},
            r"^pairs\.jsonl:3: 'chosen' starts with a 'user' turn; a completion is the assistant's answer",
        ),
        ({"prompt": [], "chosen": RIGHT, "rejected": WRONG}, r"^pairs\.jsonl:3: 'prompt': an empty conversation$"),
        (
            {"prompt": QUESTION, "chosen": [{"role": "robot", "content": "x"}], "rejected": WRONG},
            r"^pairs\.jsonl:3: 'chosen': turn 0 has unknown role 'robot'; allowed: system, user, assistant, tool$",
        ),
        (
            {"prompt": "q", "chosen": "a", "rejected": "b", "tools": []},
            r"^pairs\.jsonl:3: 'tools' are rendered with a conversation",
        ),
        (
            {"prompt": QUESTION, "chosen": RIGHT, "rejected": WRONG, "tools": "{not json"},
            r"^pairs\.jsonl:3: 'tools' is a string that is not JSON",
        ),
    ],
    ids=["missing", "identical", "mixed", "not-assistant", "empty-prompt", "bad-role", "tools-on-text", "tools-json"],
)
def test_a_bad_record_is_one_line_naming_it(folders: dict[str, Path], record: dict, message: str) -> None:
    enc = encoder(folders["qwen3"])
    with pytest.raises(ChatTemplateError, match=message) as caught:
        enc.encode(record, "pairs.jsonl:3")
    assert "\n" not in str(caught.value)


def test_tools_reach_the_template(folders: dict[str, Path]) -> None:
    enc = encoder(folders["qwen3"])
    schema = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {}}}
    plain = enc.encode({"prompt": QUESTION, "chosen": RIGHT, "rejected": WRONG}, "r:1")
    offered = enc.encode({"prompt": QUESTION, "chosen": RIGHT, "rejected": WRONG, "tools": [schema]}, "r:1")
    assert '"name": "add"' in decoded(enc, offered.prompt) and '"name": "add"' not in decoded(enc, plain.prompt)
    assert offered.chosen == plain.chosen
