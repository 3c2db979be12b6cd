"""Options the command-line tools (the planner, the doctor) take out of argv before the rest goes
to the config loader as `--section.key=value` overrides."""

from __future__ import annotations

from titan_tpu.config.errors import ConfigError


def take_option(argv: list[str], flag: str) -> str | None:
    """Remove `--flag VALUE` or `--flag=VALUE` from argv and return VALUE (None when absent)."""
    for i, arg in enumerate(argv):
        if arg == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag}: missing value")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None
