"""The rollout engine's failures, each one line naming the engine and where its log is."""

from __future__ import annotations

from titan_tpu.config.errors import ConfigError


class EngineError(ConfigError):
    """The engine cannot be set up: no environment, a server that does not start or answer, a server
    serving another model or vocabulary. Raised at start-up, so the entry point exits 2."""


class EngineFailed(RuntimeError):
    """The engine died or hung during the run more often than rl.engine_restarts allows."""
