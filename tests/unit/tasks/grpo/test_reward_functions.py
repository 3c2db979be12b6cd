"""The `math` reward's verdicts on a table of completions, and rewards you write (`module:function`):
imported once, called once per rollout batch, and every way they can fail stopping the run with one
line that names the function (and the record, where one record's value is at fault).

Bugs caught: a math check that compares strings (`0.5` vs `\\frac{1}{2}`), reads a worked solution's
intermediate numbers as the answer, or passes a wrong answer that looks right (`#### 420` for 42); a
user reward called per completion instead of per batch, or without the records; a wrong result from
a user reward that surfaces as a traceback, or a NaN or a short list that trains on garbage (a reward
that raises: test_reward_modules.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.reward_batches import batch_of
from titan_tpu.config import ConfigError, load_config
from titan_tpu.tasks.grpo.rewards import RewardError, build_rewards, score

ROOT = REPO

GSM8K_SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"

# (completion, reference, verdict): GSM8K's `#### answer`, \boxed{}, fractions, decimals, LaTeX, and
# wrong answers that look right.
MATH_CASES = [
    ("#### 72", GSM8K_SOLUTION, True),
    ("She sold 24 in May, so 48 + 24 = 72.\n#### 72", GSM8K_SOLUTION, True),
    ("She sold 24 in May.\n#### 24", GSM8K_SOLUTION, False),  # an intermediate result is not the answer
    ("#### 720", GSM8K_SOLUTION, False),
    ("#### 72", "72", True),
    ("#### 1,000", "1000", True),
    ("#### 1000.0", "1000", True),
    ("#### -5", "-5", True),
    ("#### 5", "-5", False),
    ("#### 42", "24", False),  # the digits of the answer in the wrong order
    ("#### 420", "42", False),
    ("The answer is \\boxed{42}.", "42", True),
    ("The answer is \\boxed{4.2}.", "42", False),
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),
    ("The answer is \\boxed{0.5}.", "\\frac{1}{2}", True),
    ("The answer is \\boxed{1/2}.", "\\frac{1}{2}", True),
    ("The answer is \\boxed{\\frac{2}{4}}.", "\\frac{1}{2}", True),
    ("The answer is \\boxed{\\frac{1}{3}}.", "\\frac{1}{2}", False),
    ("The answer is \\boxed{2}.", "\\frac{1}{2}", False),  # the denominator alone
    ("So $x = 5$.", "5", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{8}", False),
    ("\\boxed{\\pi}", "\\pi", True),
    ("\\boxed{3.14}", "\\pi", False),  # close is not equal
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),
    ("\\boxed{x^2 + 1}", "(x+1)^2", False),
    ("The total is $18.", "18", True),
    ("I first thought 42, but it is 43.", "42", False),  # the last answer counts
    ("I first thought 43, but it is 42.", "42", True),
    ("\\boxed{50\\%}", "50", True),
    ("No idea.", "42", False),
    ("", "42", False),
    ("#### 72", "", False),  # a reference that holds no answer never rewards
]


@pytest.mark.parametrize(("completion", "reference", "verdict"), MATH_CASES)
def test_math_reward_verdicts(completion: str, reference: str, verdict: bool) -> None:
    rewards = build_rewards([{"fn": "math"}], "answer", "\n")
    assert score(rewards, batch_of([completion], [reference]))["math"] == [float(verdict)]


def test_the_table_has_both_verdicts_and_enough_rows() -> None:
    assert len(MATH_CASES) >= 30
    assert sum(v for _, _, v in MATH_CASES) >= 10 and sum(not v for _, _, v in MATH_CASES) >= 10


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    name = f"user_rewards_{abs(hash(body)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


CALLS_RECORDED = """
calls = []

def score(prompts, completions, records):
    calls.append((list(prompts), list(completions), [dict(r) for r in records]))
    return [len(c) / 10 for c in completions]
"""


def test_a_user_reward_is_called_once_per_batch_with_prompts_completions_and_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _module(tmp_path, monkeypatch, CALLS_RECORDED)
    rewards = build_rewards([{"fn": f"{module}:score", "weight": 0.5}, {"fn": "exact"}], "answer", "\n")
    batch = batch_of(["12\n", "7\n", "123456\n"], ["12", "8", "1"])
    parts = score(rewards, batch)
    assert parts == {f"{module}:score": [0.3, 0.2, 0.7], "exact": [1.0, 0.0, 0.0]}
    calls = sys.modules[module].calls
    assert calls == [(batch.prompts, batch.texts, [dict(r) for r in batch.records])]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "def score(p, c, r):\n    return [1.0, 0.0]\n",
            r"^reward {m}:score returned 2 values for 3 completions; it must return one per completion$",
        ),
        (
            "def score(p, c, r):\n    return [1.0, float('nan'), 0.0]\n",
            r"^reward {m}:score returned nan for completion 1 \(data.jsonl:2\); each value must be a finite number$",
        ),
        (
            "def score(p, c, r):\n    return [1.0, 0.0, None]\n",
            r"^reward {m}:score returned None for completion 2 \(data.jsonl:3\); each value must be a finite number$",
        ),
    ],
)
def test_a_failing_user_reward_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, message: str
) -> None:
    module = _module(tmp_path, monkeypatch, body)
    rewards = build_rewards([{"fn": f"{module}:score"}], "answer", "\n")
    with pytest.raises(RewardError, match=message.format(m=module)) as caught:
        score(rewards, batch_of(["1\n", "2\n", "3\n"], ["1", "2", "3"]))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            "no_such_module_here:score",
            r"rl.rewards\[0\].fn: no module 'no_such_module_here' on the Python path; put no_such_module_here.py",
        ),
        (
            "json:no_such_function",
            r"rl.rewards\[0\].fn: 'json:no_such_function': .*json.* defines no 'no_such_function'",
        ),
        ("json:__doc__", r"rl.rewards\[0\].fn: 'json:__doc__' is a str, not a function"),
        (
            "exactly",
            r"rl.rewards\[0\].fn: 'exactly' is neither a built-in reward \(exact, math, format\) nor 'module:function'",
        ),
    ],
)
def test_a_reward_that_cannot_be_imported_is_refused_at_start_up(fn: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_rewards([{"fn": fn}], "answer", "\n")


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        ("[]", r"rl.rewards: must name at least one reward"),
        ('[{ fn = "exact", wieght = 2 }]', r"rl.rewards\[0\]: unknown key 'wieght'; allowed: fn, weight, pattern"),
        ("[{ weight = 2 }]", r"rl.rewards\[0\].fn: must be a reward name or 'module:function', got None"),
        ('[{ fn = "exact", weight = "high" }]', r"rl.rewards\[0\].weight: must be a finite number, got 'high'"),
        ('[{ fn = "format" }]', r"rl.rewards\[0\].pattern: is required for fn = 'format'"),
        ('[{ fn = "format", pattern = "(" }]', r"rl.rewards\[0\].pattern: not a regular expression"),
        ('[{ fn = "math", pattern = "x" }]', r"rl.rewards\[0\].pattern: applies to fn = 'format' only, not 'math'"),
    ],
)
def test_a_malformed_rewards_entry_is_refused_by_the_config(rewards: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("grpo_qwen3_debug", [f"--rl.rewards={rewards}"])


def test_a_failing_reward_stops_train_py_with_exit_2_and_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_reward.py").write_text("def score(p, c, r):\n    return [0.0]\n")
    done = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "grpo_qwen3_debug",
            f"--job.dump_folder={tmp_path / 'run'}",
            '--rl.rewards=[{ fn = "broken_reward:score" }]',
            "--training.steps=1",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--model.overrides={ n_layers = 1 }",
            "--training.dtype=float32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: reward broken_reward:score returned 1 value for 8 completions; it must return one per completion"
    ], done.stderr[-2000:]
