"""Typed config values: lists, optional values and tables from TOML and the command line, their
errors, their `--help` names and their TOML rendering. These used to raise KeyError in the loader."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import pytest
import tomllib

from titan_tpu.config import ConfigError, catalogue
from titan_tpu.config.loader import TrainConfig, field_types, section_types
from titan_tpu.config.values import check, describe, from_text, is_supported, to_toml_value, type_name

Choice = Literal["a", "b"]


@pytest.mark.parametrize(
    "text, tp, expected",
    [
        ("1,2, 3", list[int], [1, 2, 3]),
        ("[1, 2]", list[int], [1, 2]),
        ("", list[int], []),
        ("[]", list[str], []),
        ("x,y", list[str], ["x", "y"]),
        ('["x,y", "z"]', list[str], ["x,y", "z"]),
        ("a,b", list[Choice], ["a", "b"]),
        ("none", int | None, None),
        ("NONE", typing.Optional[float], None),  # noqa: UP045 (the older spelling is parsed too)
        ("7", int | None, 7),
        ("2.5", float | None, 2.5),
        ("b", Choice | None, "b"),
        ("{ n = 1, s = 'x' }", dict[str, Any], {"n": 1, "s": "x"}),
        ("", dict[str, Any], {}),
    ],
)
def test_command_line_text_becomes_the_field_type(text: str, tp: Any, expected: Any) -> None:
    assert from_text(text, tp, "s.k") == expected


@pytest.mark.parametrize(
    "text, tp, message",
    [
        ("1,x", list[int], "s.k[1]: got 'x', expected an integer"),
        ("[1, 'x']", list[int], "s.k[1]: got 'x', expected an integer"),
        ("c", list[Choice], "s.k[0]: got 'c', expected one of 'a', 'b'"),
        ("nan-ish", int | None, "s.k: got 'nan-ish', expected an integer, or 'none'"),
        ("5", dict[str, Any], "s.k: got 5, expected a table of key = value"),
    ],
)
def test_bad_command_line_text_is_one_clear_error(text: str, tp: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_text(text, tp, "s.k")
    assert str(info.value) == message


def test_toml_values_are_checked_not_converted() -> None:
    assert check([1, 2], list[int], "s.k") == [1, 2]
    assert check([1, 2], list[float], "s.k") == [1.0, 2.0]
    assert check("none", int | None, "s.k") is None
    assert check(3, int | None, "s.k") == 3
    for value, tp in [
        ("1", list[int]),
        (["1"], list[int]),
        (True, int | None),
        ("3", int | None),
        ([1], dict[str, Any]),
        (1, Choice),
    ]:
        with pytest.raises(ConfigError, match=r"^s\.k(\[0\])?: got "):
            check(value, tp, "s.k")


@pytest.mark.parametrize(
    "value, tp",
    [
        ([1, 2], list[int]),
        ([], list[str]),
        (["a", 'q"uote'], list[str]),
        (None, int | None),
        (2.5, float | None),
        ({"n_layers": 2, "odd key": [1, 2], "eps": 1e-5, "off": False}, dict[str, Any]),
    ],
)
def test_rendered_values_read_back_as_the_same_value(value: Any, tp: Any) -> None:
    rendered = tomllib.loads(f"k = {to_toml_value(value)}")["k"]
    assert check(rendered, tp, "s.k") == value


def test_help_names_and_descriptions() -> None:
    assert type_name(list[int]) == "list[int]"
    assert type_name(int | None) == "int | none"
    assert type_name(dict[str, Any]) == "table"
    assert describe(list[Choice]) == "a list, each one of 'a', 'b'"


def test_every_section_field_has_a_supported_type() -> None:
    # A field of an unsupported type would fail only when someone sets it; catch it here instead.
    for section_cls in section_types().values():
        for name, tp in field_types(section_cls).items():
            assert is_supported(tp), f"{section_cls.__name__}.{name}: {tp}"
    assert not is_supported(set[int]) and not is_supported(dict[str, Any] | None)
    # Every core field of TrainConfig is a section, and every owned section (catalogue.py) is listed too.
    core = {f.name for f in dataclasses.fields(TrainConfig)} - {"owned"}
    assert set(section_types()) == core | set(catalogue.owned_section_types())
