"""scripts/recipes/calculator_tool_use.py end to end on tiny settings (a few steps per phase): the data,
the tokenizer with the recipe's template, SFT on the tool-call demonstrations and GRPO with the
calculator environment through the trainer, an export per phase, and each export scored with and
without the tool. How much each phase learns is the full run's (docs/benchmarks/calculator_tool_use_*.md);
this checks that every piece is wired to the next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.recipes.calculator_tool_use import main

transformers = pytest.importorskip("transformers")
KEYS = {"sft/with_tool", "sft/without_tool", "grpo/with_tool", "grpo/without_tool"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recipe") / "out"
    main(
        [
            "--out",
            str(out),
            "--demonstrations=16",
            "--prompts=32",
            "--sft-steps=2",
            "--grpo-steps=2",
            "--eval-prompts=4",
        ]
    )
    return out


def test_result_json_has_every_phase_with_and_without_the_tool(run: Path) -> None:
    """Catches a phase or a baseline left out of result.json, and accuracies that are not fractions."""
    result = json.loads((run / "result.json").read_text())
    assert set(result) == {"accuracy", "seconds"} and result["seconds"] > 0
    assert set(result["accuracy"]) == KEYS
    assert all(0.0 <= value <= 1.0 for value in result["accuracy"].values())


def test_the_demonstrations_teach_the_call_and_the_exports_render_it_as_transformers_does(run: Path) -> None:
    """Catches demonstrations whose call the parser would not read back, and an exported folder whose
    tokenizer or template is not the one trained with (transformers would render other ids)."""
    from titan_tpu.data.chat_template import ChatTemplate
    from titan_tpu.data.tokenizer import build_tokenizer
    from titan_tpu.data.tool_calls import parse_model_turn

    demonstration = json.loads((run / "data" / "sft.jsonl").read_text().splitlines()[0])
    call = demonstration["messages"][1]["tool_calls"][0]["function"]
    template = ChatTemplate.from_folder(run / "sft_hf")
    text = template.render(demonstration["messages"][:2], tools=demonstration["tools"])
    turn = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") : text.rindex("<|im_end|>")]
    parsed = parse_model_turn(turn, finished=True)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(call["name"], call["arguments"])]
    ours = build_tokenizer(str(run / "sft_hf")).encode(text)
    theirs = transformers.AutoTokenizer.from_pretrained(run / "grpo_hf").apply_chat_template(
        demonstration["messages"][:2], tools=demonstration["tools"], tokenize=True, return_dict=False
    )
    assert ours == theirs
