"""The [rl] keys of GRPO's variants (objective, importance level, advantage estimator, reward scaling,
dynamic sampling, overlong punishment) as the config loads them: what each value turns into, and the
one-line refusal of a value out of range or one the chosen variant would not read.

Bugs caught: a value accepted and then ignored (eps_high with CISPO, max_draws without dynamic
sampling, a scaling RLOO or REINFORCE++ does not apply), a nonsense range accepted (a negative clip,
a cap below 1, a buffer longer than the completion), TRL's boolean scale_rewards no longer read."""

from __future__ import annotations

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.tasks.grpo.config import RLConfig

BASE = ["--rl.task=arithmetic"]


def rl_of(*overrides: str) -> RLConfig:
    return load_config("grpo_qwen3_debug", [*BASE, *overrides]).section(RLConfig)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--rl.eps_high=-0.1"], r"rl\.eps_high: must be in \(0, 10\), got -0\.1"),
        (["--rl.eps_low=1.0"], r"rl\.eps_low: must be < 1"),
        (["--rl.objective=cispo", "--rl.eps_high=0.3"], r"rl\.eps_high: clips the clipped objective's ratio"),
        (["--rl.objective=cispo", "--rl.eps_high=0.2", "--rl.cispo_cap=0.5"], r"rl\.cispo_cap: must be >= 1"),
        (["--rl.cispo_cap=4"], r"rl\.cispo_cap: applies to rl\.objective = 'cispo'"),
        (["--rl.importance_sampling_level=sentence"], r"rl\.importance_sampling_level: got 'sentence'"),
        (["--rl.advantage_estimator=rloo"], r"rl\.scale_rewards: true divides by the group's std"),
        (["--rl.advantage_estimator=rloo", "--rl.scale_rewards=group"], r"'group' divides by the group's std"),
        (["--rl.advantage_estimator=reinforce_pp"], r"rl\.scale_rewards: rl\.advantage_estimator = 'reinforce_pp'"),
        (["--rl.scale_rewards=none", "--rl.advantage_eps=0.01"], r"rl\.advantage_eps: is added to the std"),
        (
            ["--rl.scale_rewards=sometimes"],
            r"got 'sometimes', expected one of 'auto', 'group', 'batch', 'none', true, false",
        ),
        (["--rl.max_draws=4"], r"rl\.max_draws: bounds rl\.dynamic_sampling's draws"),
        (["--rl.dynamic_sampling=true", "--rl.max_draws=0"], r"rl\.max_draws: must be >= 1"),
        (["--rl.overlong_buffer=-1"], r"rl\.overlong_buffer: must be in \[0, rl\.max_new_tokens"),
        (["--rl.overlong_buffer=7"], r"rl\.overlong_buffer: must be in \[0, rl\.max_new_tokens = 6\]"),
        (["--rl.overlong_penalty=0.5"], r"rl\.overlong_penalty: is the soft overlong punishment's size"),
        (["--rl.overlong_buffer=2", "--rl.overlong_penalty=0"], r"rl\.overlong_penalty: must be a number > 0"),
    ],
)
def test_a_bad_variant_value_is_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        rl_of(*overrides)
    assert "\n" not in str(error.value)


def test_overlong_punishment_is_refused_with_episodes() -> None:
    with pytest.raises(ConfigError, match=r"rl\.overlong_buffer: is read by single-turn GRPO") as error:
        load_config("grpo_calculator_debug", ["--data.path=records.jsonl", "--rl.overlong_buffer=4"]).section(RLConfig)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "scaling"),
    [
        ([], "group"),  # grpo_qwen3_debug.toml writes TRL's boolean: true = group
        (["--rl.scale_rewards=false"], "none"),  # the booleans on the command line too
        (["--rl.scale_rewards=True"], "group"),
        (["--rl.scale_rewards=batch"], "batch"),
        (["--rl.scale_rewards=none"], "none"),
        (["--rl.scale_rewards=auto"], "group"),
        (["--rl.scale_rewards=auto", "--rl.advantage_estimator=rloo"], "none"),  # TRL's RLOOTrainer
        (["--rl.scale_rewards=batch", "--rl.advantage_estimator=rloo"], "batch"),  # its normalize_advantages
        (["--rl.scale_rewards=auto", "--rl.advantage_estimator=reinforce_pp"], "none"),  # it whitens by itself
    ],
)
def test_scale_rewards_values(overrides: list[str], scaling: str) -> None:
    assert rl_of(*overrides).reward_scaling == scaling


def test_booleans_are_trls_group_and_none() -> None:
    assert RLConfig(scale_rewards=True).reward_scaling == "group"
    assert RLConfig(scale_rewards=False).reward_scaling == "none"
    assert RLConfig().reward_scaling == "group"  # auto, for the grpo estimator


def test_each_variant_loads() -> None:
    cispo = rl_of("--rl.objective=cispo", "--rl.eps_high=0.2", "--rl.cispo_cap=5")
    assert (cispo.objective, cispo.cispo_cap) == ("cispo", 5.0)
    assert rl_of("--rl.importance_sampling_level=sequence").importance_sampling_level == "sequence"
    sampling = rl_of("--rl.dynamic_sampling=true", "--rl.max_draws=3")
    assert sampling.dynamic_sampling and sampling.max_draws == 3
    overlong = rl_of("--rl.overlong_buffer=4", "--rl.overlong_penalty=0.5")
    assert (overlong.overlong_buffer, overlong.overlong_penalty) == (4, 0.5)
