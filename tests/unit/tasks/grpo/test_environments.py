"""`rl.env` refused in one line: an environment that cannot be imported or built, a record it cannot
start from, a method that raises or answers with the wrong type (named with the record it was
running), and multi-turn keys that make no sense; one run through train.py shows the exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO
from titan_tpu.config import ConfigError, load_config
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.protocols.environment import EnvReply, EpisodeStart, ModelTurn
from titan_tpu.tasks.grpo.environments import EnvironmentFailure, GuardedCalls, environment_factory
from titan_tpu.tasks.grpo.multi_turn import EpisodeSource

TURN = ModelTurn(text="hi", content="hi")


def test_an_environment_that_cannot_be_found_or_built_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rl.env: no module 'no_such_envs' on the Python path"):
        environment_factory("no_such_envs:Env", {}, [tmp_path])
    with pytest.raises(ConfigError, match=r"has no class 'Nope'"):
        environment_factory("tests.support.byte_sum_env:Nope", {}, [])
    with pytest.raises(ConfigError, match=r"neither a built-in environment \(calculator, python\) nor 'module:Class'"):
        environment_factory("calculater", {}, [])
    (tmp_path / "half_env.py").write_text("class Half:\n    def start(self, record): ...\n")
    with pytest.raises(ConfigError, match=r"has no step, reward method"):
        environment_factory("half_env:Half", {}, [tmp_path])
    with pytest.raises(ConfigError, match=r"rl.env_args: building calculator with \{'answer': 'x'\} raised TypeError"):
        environment_factory("calculator", {"answer": "x"}, [])


class Faulty:
    """step raises on its second call, reward answers with a string."""

    def __init__(self) -> None:
        self.calls = 0

    def start(self, record: dict[str, Any]) -> EpisodeStart:
        return EpisodeStart([{"role": "user", "content": "q"}])

    def step(self, turn: ModelTurn) -> EnvReply:
        self.calls += 1
        if self.calls == 2:
            raise KeyError("score")
        return EnvReply([{"role": "user", "content": "more"}])

    def reward(self) -> Any:
        return "1.0"


def test_a_method_that_raises_or_answers_wrongly_names_the_environment_and_the_record() -> None:
    calls = GuardedCalls("my_envs:Faulty", ["data.jsonl:1", "data.jsonl:7"], [{}, {}])
    env = Faulty()
    calls.step(env, 1, TURN)
    with pytest.raises(EnvironmentFailure) as raised:
        calls.step(env, 1, TURN)
    first = str(raised.value).splitlines()[0]
    assert first == "rl.env my_envs:Faulty: step raised KeyError: 'score' (episode of the record at data.jsonl:7)"
    assert "raise KeyError" in str(raised.value)  # the user's own frame follows the line
    with pytest.raises(EnvironmentFailure, match=r"reward returned str '1.0', not a finite float .*data.jsonl:1"):
        calls.reward(env, 0)


def records(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_record_the_environment_cannot_start_from_is_refused_with_its_place(tmp_path: Path) -> None:
    path = records(tmp_path, [{"prompt": "What is 2 * 3?", "answer": "6"}] * 3 + [{"prompt": "What is 1 + 1?"}])
    config = load_config("grpo_calculator_debug", [f"--data.path={path}", "--rl.held_out_fraction=0.3"])
    source = EpisodeSource(config, build_tokenizer(config.data.tokenizer))
    with pytest.raises(
        ConfigError,
        match=rf"^{path}:4: rl.env calculator: the record's 'answer' .* found no such field \(the record's fields: prompt\)",
    ):
        source.prompt_set(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--rl.max_turns=0"], "rl.max_turns: must be >= 1"),
        (["--rl.env=", "--rl.max_turns=3"], "rl.max_turns: applies to multi-turn episodes"),
        (["--rl.reference_field=solution"], "rl.reference_field: is read by single-turn GRPO"),
        (["--rl.max_episode_tokens=-1"], "rl.max_episode_tokens: must be >= 0"),
    ],
)
def test_multi_turn_keys_that_make_no_sense_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("grpo_calculator_debug", ["--data.path=records.jsonl", *overrides])


@pytest.mark.slow
def test_train_py_stops_with_exit_status_2_and_one_line(tmp_path: Path) -> None:
    """A record without the answer the calculator needs: the run stops before any model is built."""
    path = records(tmp_path, [{"prompt": "What is 2 * 3?", "answer": "6"}] * 3 + [{"prompt": "What is 1 + 1?"}])
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "grpo_calculator_debug", f"--data.path={path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {path}:4: rl.env calculator: " + errors[0].split("rl.env calculator: ", 1)[1]]
    assert "answer" in errors[0] and "Traceback" not in done.stderr
