"""Typed config values: check a TOML value or convert command-line text to a field's type, name the
type in errors and `--help`, and write a value back as TOML.

Supported field types: bool, int, float, str, `Literal[...]`, `X | None` of those, `list[X]` of
those, and `dict[str, Any]` (a table whose entries another layer checks) alone or as the items of
a list (`rl.rewards = [{ fn = "math" }]`). TOML has no null, so an
optional value is unset with the word "none", in the file and on the command line alike.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
import types
import typing
from typing import Any, Literal

from titan_tpu.config.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

NONE_WORD = "none"
_SCALARS: dict[Any, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def did_you_mean(name: str, options: list[str]) -> str:
    """ "did you mean 'x'? " for the closest option (one that differs only in case first), or "" when
    none is close. Every bad-name message puts it before the list of valid names, which can be long."""
    by_case = [option for option in options if option.lower() == name.lower()]
    close = by_case or difflib.get_close_matches(name, options, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def optional_inner(tp: Any) -> Any | None:
    """X for `X | None` (or `Optional[X]`), else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    rest = [arg for arg in typing.get_args(tp) if arg is not type(None)]
    return rest[0] if len(rest) == 1 and len(typing.get_args(tp)) == 2 else None


def _list_item(tp: Any) -> Any | None:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def is_table(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def is_supported(tp: Any) -> bool:
    inner = optional_inner(tp)
    if inner is not None:
        return is_supported(inner) and not is_table(inner)
    item = _list_item(tp)
    if item is not None:
        return item in _SCALARS or typing.get_origin(item) is Literal or is_table(item)
    return tp in _SCALARS or typing.get_origin(tp) is Literal or is_table(tp)


def describe(tp: Any) -> str:
    """What a value of this type looks like, for error messages."""
    inner = optional_inner(tp)
    if inner is not None:
        return f"{describe(inner)}, or '{NONE_WORD}'"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(to_toml_value(c) if isinstance(c, bool) else repr(c) for c in typing.get_args(tp))
    item = _list_item(tp)
    if item is not None:
        return f"a list, each {describe(item)}"
    if is_table(tp):
        return "a table of key = value"
    return _SCALARS[tp]


def type_name(tp: Any) -> str:
    """The type as `--help` shows it."""
    inner = optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} | {NONE_WORD}"
    if typing.get_origin(tp) is Literal:
        return " | ".join(json.dumps(c) for c in typing.get_args(tp))
    item = _list_item(tp)
    if item is not None:
        return f"list[{type_name(item)}]"
    if is_table(tp):
        return "table"
    return tp.__name__


def check(value: Any, tp: Any, where: str) -> Any:
    """A value as TOML gives it, checked against the type (ints are accepted as floats)."""
    inner = optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.lower() == NONE_WORD):
            return None
        try:
            return check(value, inner, where)
        except ConfigError:
            raise ConfigError(f"{where}: got {value!r}, expected {describe(tp)}") from None
    if typing.get_origin(tp) is Literal:
        if value in typing.get_args(tp) and type(value) in {type(c) for c in typing.get_args(tp)}:
            return value
        raise ConfigError(f"{where}: got {value!r}, expected {describe(tp)}")
    item = _list_item(tp)
    if item is not None:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: got {value!r}, expected {describe(tp)}")
        return [check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if is_table(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: got {value!r}, expected {describe(tp)}")
        return dict(value)
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{where}: got {value!r}, expected {describe(tp)}")
    return float(value) if tp is float else value


def parse_toml_literal(text: str) -> Any:
    """Command-line text read as one TOML value (2, 1e-5, true, [1, 2], {a = 1}); anything that is
    not a TOML value stays the plain string, so `--x=loop` needs no quotes."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    return parsed["v"] if len(parsed) == 1 else text


def from_text(text: str, tp: Any, where: str) -> Any:
    """Command-line text -> a checked value of the field's type."""
    inner = optional_inner(tp)
    if inner is not None:
        if text.lower() == NONE_WORD:
            return None
        try:
            return from_text(text, inner, where)
        except ConfigError:
            raise ConfigError(f"{where}: got {text!r}, expected {describe(tp)}") from None
    if typing.get_origin(tp) is Literal and text.lower() in ("true", "false"):
        # A choice that also takes TOML's booleans (rl.scale_rewards = true, as TRL's): the flag's word.
        if any(isinstance(choice, bool) for choice in typing.get_args(tp)):
            return check(text.lower() == "true", tp, where)
    if typing.get_origin(tp) is Literal or tp is str:
        return check(text, tp, where)
    item = _list_item(tp)
    if item is not None:
        stripped = text.strip()
        if stripped.startswith("["):
            return check(parse_toml_literal(stripped), tp, where)
        parts = [p.strip() for p in stripped.split(",")] if stripped else []
        return [from_text(p, item, f"{where}[{i}]") for i, p in enumerate(parts)]
    if is_table(tp):
        return check(parse_toml_literal(text.strip() or "{}"), tp, where)
    try:
        if tp is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        return int(text) if tp is int else float(text)
    except ValueError:
        raise ConfigError(f"{where}: got {text!r}, expected {describe(tp)}") from None


def to_toml_value(value: Any) -> str:
    """A value written as TOML; None is written as the word that unsets an optional value."""
    if value is None:
        return json.dumps(NONE_WORD)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(to_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        entries = (f"{_toml_key(k)} = {to_toml_value(v)}" for k, v in value.items())
        return "{ " + ", ".join(entries) + " }"
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)
