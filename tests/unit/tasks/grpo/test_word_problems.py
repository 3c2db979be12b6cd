"""The word problems of the SFT-then-GRPO recipe and the files written from them."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from titan_tpu.tasks.grpo.math_reward import math_equivalent
from titan_tpu.tasks.grpo.word_problem_data import HELD_OUT_SHARE, write_recipe_data
from titan_tpu.tasks.grpo.word_problems import WordProblem, held_out, problems


def test_solutions_are_right_and_the_noisy_one_stops_one_step_early() -> None:
    """Catches a worked solution whose `####` answer the math reward would not accept (GRPO could never
    be rewarded), and a noisy demonstration that is right after all (SFT would reach 100%, leaving
    GRPO nothing to repair) or wrong on a one-step problem."""
    two = WordProblem("Ann", "apples", 7, 5, -3)
    assert two.question == "Ann has 7 apples, buys 5 more and then gives 3 away. How many apples does she have now?"
    assert two.solution() == "7 + 5 = 12. 12 - 3 = 9. #### 9"
    assert two.solution(forget_last_step=True) == "7 + 5 = 12. 12 - 3 = 9. #### 12"
    assert math_equivalent(two.solution(), two.answer)
    assert not math_equivalent(two.solution(forget_last_step=True), two.answer)
    one = WordProblem("Ben", "pens", 9, -4, 0)
    assert one.solution(forget_last_step=True) == one.solution() == "9 - 4 = 5. #### 5"
    for problem in islice(problems("train", 0, HELD_OUT_SHARE), 500):
        assert math_equivalent(problem.solution(), problem.answer), problem
        assert all(0 < value <= 19 for value in (problem.start, problem.start + problem.first, int(problem.answer)))


def test_the_held_out_split_is_never_in_a_training_file(tmp_path: Path) -> None:
    """Catches held-out problems leaking into pretraining, SFT or GRPO prompts (the accuracy would
    measure memorisation), and duplicated held-out problems (fewer distinct problems than reported)."""
    data = write_recipe_data(
        tmp_path, seed=3, error_rate=0.5, held_out=64, pretraining_docs=2000, sft_examples=500, grpo_prompts=300
    )
    held = [json.loads(line) for line in data.held_out.read_text().splitlines()]
    assert len({r["question"] for r in held}) == 64
    training_text = data.pretraining.read_text() + data.sft.read_text() + data.prompts.read_text()
    assert not any(json.dumps(r["question"])[1:-1] in training_text for r in held)
    conversations = [json.loads(line)["messages"] for line in data.sft.read_text().splitlines()]
    assert [turn["role"] for turn in conversations[0]] == ["user", "assistant"]
    wrong = [c for c in conversations if not math_equivalent(c[1]["content"], str(eval(_last_step(c[1]["content"]))))]
    assert 0.15 < len(wrong) / len(conversations) < 0.35  # half are two-step, half of those stop early


def _last_step(solution: str) -> str:
    """The left side of the solution's last equation, e.g. '12 - 3'."""
    return solution.split(" = ")[-2].split(". ")[-1]


def test_the_split_is_a_property_of_the_problem() -> None:
    """Catches a split that depends on the drawing order or seed (another seed would evaluate on
    problems it trained on)."""
    for problem in islice(problems("held_out", 1, HELD_OUT_SHARE), 50):
        assert held_out(problem, HELD_OUT_SHARE)
    for problem in islice(problems("train", 2, HELD_OUT_SHARE), 200):
        assert not held_out(problem, HELD_OUT_SHARE)
    with pytest.raises(ValueError, match="split must be"):
        next(problems("test", 0, HELD_OUT_SHARE))
