"""Episodes written for people to read: the first rl.dump_rollouts of the latest rollout at an
evaluation, at the next rollout after rollouts/DUMP appears (the request is taken), appended and never
overwritten, and one shown in the log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from titan_tpu.generation.episodes import Trajectory
from titan_tpu.tasks.grpo.prompts import Prompt
from titan_tpu.tasks.grpo.rollout_dump import EpisodeDumps

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
MESSAGES = [
    {"role": "system", "content": "tools..."},
    {"role": "user", "content": "What is 2 * 3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calculator", "content": "6"},
    {"role": "assistant", "content": "6"},
]


def episode(reward: float) -> Trajectory:
    return Trajectory(
        prompt=[1, 2],
        messages=MESSAGES,
        tools=[{"type": "function", "function": {"name": "calculator"}}],
        tokens=[3, 4, 5],
        trained=[True, False, True],
        reward=reward,
        turns=2,
        tool_calls=1,
        end="environment",
    )


PROMPTS = [Prompt("What is 2 * 3?", [1, 2], {"prompt": "What is 2 * 3?"}, "data.jsonl:1")]


def test_evaluation_writes_the_first_episodes_and_logs_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dumps = EpisodeDumps(tmp_path, count=2, group_size=4)
    dumps.after_rollout(10, PROMPTS, {2: episode(0.0), 0: episode(1.0), 1: episode(0.5)})
    assert not (tmp_path / "rollouts").exists()  # nothing asked for yet
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        dumps.write(12)
    lines = [json.loads(line) for line in (tmp_path / "rollouts" / "step-12.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reward"]) for r in lines] == [(0, 1.0), (1, 0.5)]
    assert lines[0]["messages"] == MESSAGES and lines[0]["tools"] == ["calculator"]
    assert (lines[0]["record"], lines[0]["model_tokens"], lines[0]["tokens"]) == ("data.jsonl:1", 2, 5)
    assert "episode of row 0 (reward 1, 2 turns, 1 tool calls" in caplog.text
    assert "tool:      '6'" in caplog.text and """assistant: 'calculator({"expression": "2*3"})'""" in caplog.text
    dumps.write(12)  # a resumed run repeating the step appends
    assert len((tmp_path / "rollouts" / "step-12.jsonl").read_text().splitlines()) == 4


def test_a_request_file_dumps_the_next_rollout_once(tmp_path: Path) -> None:
    dumps = EpisodeDumps(tmp_path, count=1, group_size=4)
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "DUMP").touch()
    dumps.after_rollout(4, PROMPTS, {0: episode(1.0)})
    assert (tmp_path / "rollouts" / "step-4.jsonl").is_file()
    assert not (tmp_path / "rollouts" / "DUMP").exists()
    dumps.after_rollout(6, PROMPTS, {0: episode(1.0)})
    assert not (tmp_path / "rollouts" / "step-6.jsonl").exists()


def test_zero_dumps_nothing(tmp_path: Path) -> None:
    dumps = EpisodeDumps(tmp_path, count=0, group_size=4)
    dumps.after_rollout(4, PROMPTS, {0: episode(1.0)})
    dumps.write(4)
    assert not (tmp_path / "rollouts").exists()
