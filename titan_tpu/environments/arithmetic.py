"""Arithmetic on model-written expressions, walked over Python's `ast` and never handed to eval.

Allowed: integer and float literals, + - * / // % **, unary + and -, parentheses. Anything else (a name,
a call, an attribute, a subscript, a string, a comparison, ...) is refused with a message that says
what was found, before it could run. Every value is bounded, so that no input can hang the trainer:
the text is at most MAX_EXPRESSION_CHARS long, every intermediate result is smaller than
MAX_MAGNITUDE in magnitude, and a power whose result would pass that bound is refused from the
logarithms before it is computed ("9**9**9**9" is refused at once instead of computing for hours).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 1000
# Deepest nesting of operators the evaluator walks: its own bound, not the interpreter's recursion
# limit, which another library in the same process may have raised.
MAX_DEPTH = 100
MAX_MAGNITUDE = 10**100
SIGNIFICANT_DIGITS = 12

Number = int | float

_ALLOWED = "only numbers, + - * / // % ** and parentheses are"


class ExpressionError(ValueError):
    """The expression is refused or cannot be computed; the message says why, for the model to read."""


def _power(base: Number, exponent: Number) -> Number:
    # |base ** exponent| = 10 ** (exponent * log10|base|): checked before Python computes a huge integer.
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= math.log10(MAX_MAGNITUDE):
        raise ExpressionError(f"the result is too large (at most {MAX_MAGNITUDE:.0e} in magnitude)")
    return base**exponent


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

# What the model wrote, in words, for the refusals it is most likely to meet.
_KINDS: dict[type[ast.AST], str] = {
    ast.Name: "a name",
    ast.Call: "a function call",
    ast.Attribute: "an attribute",
    ast.Subscript: "a subscript",
    ast.Compare: "a comparison",
    ast.BoolOp: "a boolean operator",
    ast.Lambda: "a lambda",
    ast.Tuple: "a tuple",
    ast.List: "a list",
    ast.JoinedStr: "a string",
}


def evaluate(expression: str) -> Number:
    """The value of `expression`; ExpressionError when it is refused or cannot be computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(
            f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS} are allowed"
        )
    text = expression.strip()
    try:
        return _value(ast.parse(text, mode="eval").body, text, 0)
    except SyntaxError as error:
        raise ExpressionError(f"not a valid expression: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise ExpressionError("the expression is nested too deeply") from None


def _value(node: ast.expr, source: str, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ExpressionError(f"the expression is nested too deeply (at most {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand, source, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, source, depth + 1), _value(node.right, source, depth + 1)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ExpressionError("division by zero") from None
        except OverflowError:
            raise ExpressionError(f"the result is too large (at most {MAX_MAGNITUDE:.0e} in magnitude)") from None
    raise ExpressionError(f"{_kind(node)} is not allowed ({ast.get_source_segment(source, node)}): {_ALLOWED}")


def _kind(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return "a string" if isinstance(node.value, (str, bytes)) else f"the constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return _KINDS.get(type(node), f"a {type(node).__name__} expression")


def _bounded(value: object) -> Number:
    # A negative number to a fractional power is complex in Python; float overflow gives inf.
    if not isinstance(value, (int, float)):
        raise ExpressionError("the result is not a real number")
    if isinstance(value, float) and math.isnan(value):
        raise ExpressionError("the result is not a number")
    if not abs(value) < MAX_MAGNITUDE:
        raise ExpressionError(f"the result is too large (at most {MAX_MAGNITUDE:.0e} in magnitude)")
    return value


def format_number(value: Number) -> str:
    """The text a model reads. One rule: an int prints as itself ("56088"); a float is rounded to
    SIGNIFICANT_DIGITS significant digits (which hides binary noise: 0.1 + 0.2 gives "0.3") and printed
    as Python's repr of that, less a trailing ".0" ("6" for 12 / 2; "1e+20" for 1e20 stays)."""
    if isinstance(value, int):
        return str(value)
    text = repr(float(f"{value:.{SIGNIFICANT_DIGITS}g}"))
    return text.removesuffix(".0")
