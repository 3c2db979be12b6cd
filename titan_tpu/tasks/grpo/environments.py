"""`rl.env`: the environment class a multi-turn run builds one instance of per episode, and its methods
called so that a failure stops the run in one line naming the environment, the method and the record.

A built-in name ('calculator', 'python') or `module:Class`, your own, found like a reward module (the
Python path, then the config's folder, then the current one). `rl.env_args` are its keyword arguments,
tried once at start-up so that a wrong one is refused before any model is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_tpu.config import ConfigError
from titan_tpu.protocols.environment import Environment, EnvReply, EpisodeStart, ModelTurn, RecordError
from titan_tpu.tasks.grpo.user_code import import_user_module, traceback_text

BUILTIN = {
    "calculator": "titan_tpu.environments.calculator:Calculator",
    "python": "titan_tpu.environments.python_tool:PythonEnv",
}


class EnvironmentFailure(ConfigError):
    """The user's environment raised, or answered with something else than the protocol's types: the run
    stops, naming it, the method and the record (exit status 2, like any bad input)."""


@dataclass(frozen=True)
class EnvFactory:
    """Builds one environment per episode."""

    name: str  # rl.env as the user wrote it
    cls: Callable[..., Environment]
    args: Mapping[str, Any]

    def __call__(self) -> Environment:
        return self.cls(**self.args)


def environment_factory(spec: str, args: Mapping[str, Any], folders: Sequence[Path]) -> EnvFactory:
    path = BUILTIN.get(spec, spec)
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise ConfigError(
            f"rl.env: {spec!r} is neither a built-in environment ({', '.join(BUILTIN)}) nor 'module:Class'"
        )
    module = import_user_module(module_name, folders, "rl.env")
    cls = getattr(module, class_name, None)
    if not callable(cls):
        raise ConfigError(f"rl.env: module {module_name!r} ({module.__file__}) has no class {class_name!r}")
    missing = [m for m in ("start", "step", "reward") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            f"rl.env: {spec} has no {', '.join(missing)} method; an environment has start(record), step(turn) "
            "and reward() (titan_tpu/protocols/environment.py)"
        )
    factory = EnvFactory(spec, cls, dict(args))
    try:
        factory()
    except Exception as error:
        raise ConfigError(
            f"rl.env_args: building {spec} with {dict(args)} raised {type(error).__name__}: {error}"
        ) from None
    return factory


class GuardedCalls:
    """An environment's methods for the episodes of `places` (one record place per episode index)."""

    def __init__(self, name: str, places: Sequence[str], records: Sequence[Mapping[str, Any]]) -> None:
        self.name = name
        self.places = places
        self.records = records

    def start(self, env: Environment, index: int) -> EpisodeStart:
        start = self._call("start", index, lambda: env.start(self.records[index]))
        if not isinstance(start, EpisodeStart) or not start.messages:
            raise self._wrong("start", index, "an EpisodeStart with at least one message", start)
        return start

    def step(self, env: Environment, index: int, turn: ModelTurn) -> EnvReply:
        reply = self._call("step", index, lambda: env.step(turn))
        if not isinstance(reply, EnvReply):
            raise self._wrong("step", index, "an EnvReply", reply)
        return reply

    def reward(self, env: Environment, index: int) -> float:
        value = self._call("reward", index, env.reward)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._wrong("reward", index, "a finite float", value)
        return float(value)

    def _call(self, method: str, index: int, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except RecordError as error:
            raise EnvironmentFailure(f"{self.places[index]}: rl.env {self.name}: {error}") from None
        except Exception as error:
            frames = error.__traceback__.tb_next if error.__traceback__ is not None else None
            raise EnvironmentFailure(
                f"rl.env {self.name}: {method} raised {type(error).__name__}: {error} (episode of the record at "
                f"{self.places[index]})\n" + traceback_text(error, frames)
            ) from None

    def _wrong(self, method: str, index: int, expected: str, got: Any) -> EnvironmentFailure:
        return EnvironmentFailure(
            f"rl.env {self.name}: {method} returned {type(got).__name__} {got!r:.80}, not {expected} "
            f"(episode of the record at {self.places[index]})"
        )
