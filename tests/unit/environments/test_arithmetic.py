"""titan_tpu/environments/arithmetic.py: right values, and refusals for everything but arithmetic, fast."""

from __future__ import annotations

import sys
import time

import pytest

from titan_tpu.environments.arithmetic import (
    MAX_DEPTH,
    MAX_EXPRESSION_CHARS,
    ExpressionError,
    evaluate,
    format_number,
)


@pytest.mark.parametrize(
    ("expression", "text"),
    [
        ("123 * 456", "56088"),
        ("12 / 2", "6"),  # true division of integers is a float, printed without ".0"
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("-(3 + 4) * +2", "-14"),
        ("((1 + 2) * (3 - 4)) ** 2", "9"),
        ("0.1 + 0.2", "0.3"),  # binary noise rounded away at 12 significant digits
        ("1 / 3", "0.333333333333"),
        ("1e16", "1e+16"),
        ("2.5e-3 * 2", "0.005"),
        ("  1 + 1  ", "2"),
        ("2 ** 332", str(2**332)),  # just under the magnitude bound, exact
    ],
)
def test_values(expression: str, text: str) -> None:
    """Bugs caught: a wrong operator table (// for /), operator precedence or unary minus lost, ints
    turned into floats ("56088.0"), floats printed with binary noise or a trailing ".0"."""
    assert format_number(evaluate(expression)) == text


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "a function call is not allowed (__import__('os'))"),
        ("().__class__", "an attribute is not allowed"),
        ("x + 1", "a name is not allowed (x)"),
        ("[1][0]", "a subscript is not allowed"),
        ("'a' * 3", "a string is not allowed"),
        ("1 < 2", "a comparison is not allowed"),
        ("True + 1", "the constant True is not allowed"),
        ("1j * 2", "the constant 1j is not allowed"),
        ("1 << 4", "the operator LShift is not allowed"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e400", "too large"),
        ("10 ** 100", "too large"),
        ("1 +", "not a valid expression"),
    ],
)
def test_refusals(expression: str, message: str) -> None:
    """Bugs caught: an evaluator that runs names, calls or attributes (the first two are the classic
    escapes), lets a bool or a complex through, or raises ZeroDivisionError instead of a message."""
    with pytest.raises(ExpressionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


def test_an_evaluator_built_on_eval_would_fail_here() -> None:
    """Negative control: eval computes what this test requires to be refused, so an evaluator that
    handed the text to eval (with any builtins left) could not pass test_refusals."""
    assert eval("len('abc') + 1") == 4  # noqa: S307 (the control itself: a trusted literal)
    with pytest.raises(ExpressionError, match="a function call"):
        evaluate("len('abc') + 1")


@pytest.mark.parametrize(
    "expression", ["9**9**9**9", "2 ** 10 ** 10", "10 ** 99 * 10 ** 99 * 10 ** 99", "1.0000001 ** 1e20"]
)
def test_huge_results_are_refused_at_once(expression: str) -> None:
    """Bug caught: a power or product computed before it is bounded (9**9**9**9 would run for hours and
    fill the memory)."""
    began = time.perf_counter()
    with pytest.raises(ExpressionError, match="too large"):
        evaluate(expression)
    assert time.perf_counter() - began < 0.5


def test_long_and_deep_input_is_refused() -> None:
    """Bugs caught: no length bound (the parser's time and memory grow with the text), and a
    RecursionError escaping on deep nesting instead of a message."""
    with pytest.raises(ExpressionError, match=f"at most {MAX_EXPRESSION_CHARS}"):
        evaluate("1+" * MAX_EXPRESSION_CHARS + "1")
    with pytest.raises(ExpressionError, match="nested too deeply"):
        evaluate("-" * (MAX_EXPRESSION_CHARS - 1) + "1")
    # The bound is the evaluator's own: a raised interpreter recursion limit (another library in the
    # process may raise it) does not lift it, one level past it is refused by it, and nesting within it
    # still evaluates.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        for nesting in (MAX_EXPRESSION_CHARS - 1, MAX_DEPTH + 1):
            with pytest.raises(ExpressionError, match=f"nested too deeply \\(at most {MAX_DEPTH} levels\\)"):
                evaluate("-" * nesting + "1")
    finally:
        sys.setrecursionlimit(limit)
    assert evaluate("-" * MAX_DEPTH + "1") == 1
