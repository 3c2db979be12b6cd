"""Rewards of a rollout batch: each reward scores every completion from the prompts, the completions
(decoded text, with the stop text when the policy stopped on its own, so a format check can tell a
finished answer from one cut off) and the dataset records they came from; the run's reward is their
weighted sum (`rl.rewards`).

Built-ins: `exact`, `math` (math_reward.py) and `format`. Anything else is `module:function`, your
own, imported once at start-up (from the Python path, the config's folder or the current folder:
user_code.py) and called once per rollout batch on each data-parallel rank with that rank's
completions. A reward that cannot be imported, raises, returns the wrong number of values, or a value
that is not a finite number stops the run with one line naming it (and the record, where one record's
value is at fault); one that raises is followed by its own traceback, which holds your file and line.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_tpu.config import ConfigError
from titan_tpu.tasks.grpo.user_code import import_user_module, traceback_text

Record = Mapping[str, Any]
RewardFn = Callable[[list[str], list[str], list[Record]], Sequence[float]]


class RewardError(ConfigError):
    """A reward function that failed during the run: one line, the function's name, exit 2."""


@dataclass(frozen=True)
class Completions:
    """One rollout batch's share on this rank: the prompt texts, completion texts and records (one of
    each per completion), and where each record came from (its file and line, or its generator)."""

    prompts: list[str]
    texts: list[str]
    records: list[Record]
    places: list[str]


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float


def _before_stop(completion: str, stop_text: str) -> str:
    return completion.split(stop_text, 1)[0] if stop_text else completion


def _exact(reference_field: str, stop_text: str) -> RewardFn:
    def exact(prompts: list[str], completions: list[str], records: list[Record]) -> list[float]:
        answers = [_before_stop(c, stop_text) for c in completions]
        return [float(a.strip() == str(r[reference_field]).strip()) for a, r in zip(answers, records)]

    return exact


def _math(reference_field: str, stop_text: str) -> RewardFn:
    from titan_tpu.tasks.grpo.math_reward import math_equivalent  # imports math-verify only when asked for

    def math_reward(prompts: list[str], completions: list[str], records: list[Record]) -> list[float]:
        return [
            float(math_equivalent(_before_stop(c, stop_text), str(r[reference_field])))
            for c, r in zip(completions, records)
        ]

    return math_reward


def _format(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(prompts: list[str], completions: list[str], records: list[Record]) -> list[float]:
        return [float(compiled.fullmatch(c) is not None) for c in completions]

    return format_reward


def _imported(spec: str, where: str, folders: Sequence[Path]) -> RewardFn:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{where}: {spec!r} is neither a built-in reward (exact, math, format) nor 'module:function'")
    module = import_user_module(module_name, folders, where)
    if not hasattr(module, attribute):
        place = getattr(module, "__file__", None) or module_name
        raise ConfigError(f"{where}: {spec!r}: {place} defines no {attribute!r}")
    fn = getattr(module, attribute)
    if not callable(fn):
        raise ConfigError(f"{where}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def build_rewards(
    tables: list[dict[str, Any]], reference_field: str, stop_text: str, folders: Sequence[Path] = ()
) -> list[Reward]:
    """The rewards of `rl.rewards` (shapes checked by the config), each named by its fn (and its
    place in the list, for a second reward with the same fn). A module of yours is looked for on the
    Python path, then in `folders` (user_code.search_folders)."""
    rewards: list[Reward] = []
    for index, table in enumerate(tables):
        name, where = table["fn"], f"rl.rewards[{index}].fn"
        if any(r.name == name for r in rewards):
            name = f"{name}#{index}"
        kind = table["fn"]
        if kind == "exact":
            fn = _exact(reference_field, stop_text)
        elif kind == "math":
            fn = _math(reference_field, stop_text)
        elif kind == "format":
            fn = _format(table["pattern"])
        else:
            fn = _imported(kind, where, folders)
        rewards.append(Reward(name, fn, float(table.get("weight", 1.0))))
    return rewards


def _scores(reward: Reward, batch: Completions) -> list[float]:
    count = len(batch.texts)
    try:
        values = list(reward.fn(batch.prompts, batch.texts, batch.records))
    except Exception as err:  # the reward's own failure, whatever it is, ends the run with its name
        # Then its traceback from the reward's own frame on: the file and line where it failed.
        own_frames = err.__traceback__.tb_next if err.__traceback__ is not None else None
        raise RewardError(
            f"reward {reward.name} raised {type(err).__name__}: {err} (on {count} completions)\n"
            + traceback_text(err, own_frames)
        ) from None
    if len(values) != count:
        raise RewardError(
            f"reward {reward.name} returned {len(values)} value{'s' * (len(values) != 1)} for {count} "
            "completions; it must return one per completion"
        )
    scores: list[float] = []
    for index, value in enumerate(values):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward {reward.name} returned {value!r} for completion {index} ({batch.places[index]}); "
                "each value must be a finite number"
            )
        scores.append(float(value))
    return scores


def score(rewards: Sequence[Reward], batch: Completions) -> dict[str, list[float]]:
    """Each reward's values for every completion of the batch, by name."""
    return {reward.name: _scores(reward, batch) for reward in rewards}


def weighted_total(rewards: Sequence[Reward], parts: dict[str, list[float]], count: int) -> list[float]:
    """The run's reward of each of `count` completions: the weighted sum of the parts."""
    return [sum(r.weight * parts[r.name][i] for r in rewards) for i in range(count)]
