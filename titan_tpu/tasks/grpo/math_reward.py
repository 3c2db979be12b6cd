"""Final-answer equivalence for math problems, through the `math-verify` package: the completion's
answer and the reference are parsed into expressions (numbers, fractions, LaTeX, `\\boxed{...}`) and
compared as values, so `\\frac{1}{2}`, `0.5` and `1/2` are one answer and `1,000` is `1000`.

GSM8K's convention is honoured on both sides: where a text holds `#### answer`, the answer is what
follows the last `####` (a reference's worked solution, a completion's reasoning before it, are not
the answer). Elsewhere math-verify takes the last `\\boxed{}` or, failing that, the last expression.
"""

from __future__ import annotations

import functools
from typing import Any

from math_verify import parse, verify

GSM8K_MARK = "####"


def final_answer_text(text: str) -> str:
    """What follows the last `####`, or the whole text where there is none."""
    return text.rsplit(GSM8K_MARK, 1)[1] if GSM8K_MARK in text else text


# Parsing is most of the reward's time (a millisecond a text), and a rollout repeats its texts: each
# reference once per completion of its group, and the completions of a group often agree.
@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple[Any, ...]:
    answer = final_answer_text(text).strip()
    found = parse(answer)
    # A bare LaTeX reference (`\sqrt{8}`, no $ around it) parses only inside math delimiters.
    return tuple(found if found else parse(f"${answer}$"))


def math_equivalent(completion: str, reference: str) -> bool:
    """True when the completion's final answer has the reference's value."""
    gold = _parsed(reference)
    return bool(gold) and bool(verify(list(gold), list(_parsed(completion))))
