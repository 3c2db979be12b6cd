"""GRPO resumed from a checkpoint continues as the uninterrupted run does: the same prompts reach the
rewards in the same order, and the losses and rewards of every later step are bitwise equal
(deterministic mode, one process).

Bugs caught: a prompt stream that restarts at its beginning (or skips a rollout) after a resume, a
sampling seed that depends on the process's history instead of the step, an optimizer or data state
left out of the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.grpo_record_runs import run_on_records, stopped_after

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why

REWARD_MODULE = """
calls = []

def token_sum(prompts, completions, records):
    calls.append(list(prompts))
    return [(sum(c.encode("utf-8", "replace")) % 5) / 4 for c in completions]
"""
COMPARED = ("loss", "grad_norm", "reward_mean", "reward/resume_reward:token_sum", "completion_length", "kl")


def _run(tmp_path: Path, dump: Path, steps: int) -> tuple[int, dict[int, dict], list[list[str]]]:
    return run_on_records(tmp_path, dump, steps, "resume_reward:token_sum", "--optimizer.lr=1e-2", "--rl.beta=0.04")


def test_a_resumed_grpo_run_sees_the_same_prompts_and_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "resume_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, straight, straight_prompts = _run(tmp_path, tmp_path / "a", steps=4)
    assert len(straight_prompts) == 4  # one rollout batch per optimizer step here
    stopped_after(tmp_path / "a", tmp_path / "b", step=2)
    start, resumed, resumed_prompts = _run(tmp_path, tmp_path / "b", steps=4)
    assert start == 2 and sorted(resumed) == [3, 4]
    assert resumed_prompts == straight_prompts[2:]
    assert straight_prompts[2] != straight_prompts[0]  # the stream moved on: a restart at 0 would show
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == straight[step][key], (
                f"step {step} {key}: {resumed[step][key]!r} != {straight[step][key]!r}"
            )
    assert any(straight[s]["reward_std"] > 0 for s in (3, 4)), "the test reward must vary, or nothing is compared"
