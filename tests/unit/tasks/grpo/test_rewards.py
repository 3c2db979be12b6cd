"""The built-in exact and format rewards and the arithmetic task's data: the checks a wrong reward or a
leaky split would fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.reward_batches import batch_of
from titan_tpu.tasks.grpo.arithmetic import ArithmeticProblems, Problem, pretraining_corpus
from titan_tpu.tasks.grpo.prompts import PromptStream
from titan_tpu.tasks.grpo.rewards import build_rewards, score


def _one(fn: str, completion: str, reference: str = "5", **extra: str) -> float:
    rewards = build_rewards([{"fn": fn, **extra}], "answer", "\n")
    return score(rewards, batch_of([completion], [reference]))[rewards[0].name][0]


def test_exact_match_reads_the_answer_before_the_stop_text() -> None:
    assert _one("exact", "5\n") == 1.0
    assert _one("exact", " 5\n7+1=8") == 1.0  # what follows the stop text is not the answer
    assert _one("exact", "5") == 1.0  # cut at max_new_tokens right after the answer: still right
    assert _one("exact", "55\n") == 0.0  # a prefix match is not a match
    assert _one("exact", "\n5") == 0.0


def test_format_reward_wants_a_finished_integer() -> None:
    pattern = {"pattern": "-?\\d+\n"}
    assert _one("format", "123\n", **pattern) == 1.0  # wrong but well formed
    assert _one("format", "-4\n", **pattern) == 1.0
    assert _one("format", "123", **pattern) == 0.0  # never stopped
    assert _one("format", "12a\n", **pattern) == 0.0
    assert _one("format", "12\n3", **pattern) == 0.0


def test_split_is_disjoint_complete_and_fixed() -> None:
    problems = ArithmeticProblems(max_operand=20, held_out_fraction=0.1)
    train, held = set(problems.train), set(problems.held_out)
    assert not train & held
    assert len(train | held) == 21 * 21
    assert len(held) == round(0.1 * 441)
    again = ArithmeticProblems(max_operand=20, held_out_fraction=0.1)
    assert again.held_out == problems.held_out


def test_prompt_stream_resumes_where_it_stopped_and_never_leaves_train() -> None:
    problems = ArithmeticProblems(max_operand=9, held_out_fraction=0.2)
    stream = PromptStream(problems.train, seed=3)
    first = stream.take(50)
    first += stream.take(50)  # 80 training problems: this take crosses into the second epoch
    state = stream.state_dict()
    expected = stream.take(30)
    resumed = PromptStream(problems.train, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(30) == expected
    assert set(first) <= set(problems.train)
    assert len(set(first[:80])) == 80  # an epoch is a permutation: no repeats within it
    with pytest.raises(ValueError, match="does not match"):
        PromptStream(problems.train, seed=4).load_state_dict(state)


def test_corpus_has_train_problems_and_the_requested_carry_errors(tmp_path: Path) -> None:
    problems = ArithmeticProblems(max_operand=99, held_out_fraction=0.05)
    path = pretraining_corpus(problems, tmp_path / "c.txt", lines=4000, carry_error_rate=0.7, seed=0)
    held_prompts = {p.prompt for p in problems.held_out}
    carries = wrong = 0
    for line in path.read_text().splitlines():
        prompt, answer = line.split("=")
        a, b = map(int, prompt.split("+"))
        assert prompt + "=" not in held_prompts
        problem = Problem(a, b)
        if problem.carries:
            carries += 1
            wrong += answer != problem.answer
            assert answer in (problem.answer, problem.answer_without_carry)
        else:
            assert answer == problem.answer
    assert 0.65 < wrong / carries < 0.75
