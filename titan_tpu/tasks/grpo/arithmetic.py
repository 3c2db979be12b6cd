"""Arithmetic with a verifiable answer: "a+b=" -> "c\\n", a and b in [0, max_operand].

Every problem lives in exactly one split: a seeded permutation of all (a, b) pairs puts a fixed share
into the held-out set, which training prompts never draw from (prompts.py makes them prompts).

`pretraining_corpus` writes the text a language model first learns the format from. Its optional
`carry_error_rate` makes the demonstrations systematically wrong on problems whose units digits
carry (it writes the answer without the carry), like a student who forgets to carry: a model trained
on it answers carry problems wrongly when it decodes greedily but still samples the right answer some
of the time, which is the situation reinforcement learning with a checker can repair.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

STOP_TEXT = "\n"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def record(self, reference_field: str) -> dict[str, str]:
        """The problem as the rewards read a dataset record: its prompt and reference answer."""
        return {"prompt": self.prompt, reference_field: self.answer}

    @property
    def carries(self) -> bool:
        return self.a % 10 + self.b % 10 >= 10

    @property
    def answer_without_carry(self) -> str:
        """The sum with the units carry dropped (the systematic error of the noisy corpus)."""
        return str(self.a + self.b - 10) if self.carries else self.answer


class ArithmeticProblems:
    """All a+b problems with operands in [0, max_operand], split once into train and held out."""

    def __init__(self, max_operand: int, held_out_fraction: float, split_seed: int = 1234) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
        pairs = [Problem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        random.Random(split_seed).shuffle(pairs)
        n_held_out = max(1, round(held_out_fraction * len(pairs)))
        self.held_out: list[Problem] = pairs[:n_held_out]
        self.train: list[Problem] = pairs[n_held_out:]


def pretraining_corpus(
    problems: ArithmeticProblems, path: Path, lines: int, carry_error_rate: float, seed: int
) -> Path:
    """Write `lines` lines "a+b=c" drawn from the training split (never the held-out one) to `path`;
    on problems that carry, a `carry_error_rate` share of lines give the answer without the carry."""
    if not 0 <= carry_error_rate <= 1:
        raise ValueError(f"carry_error_rate must be in [0, 1], got {carry_error_rate}")
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            problem = rng.choice(problems.train)
            wrong = problem.carries and rng.random() < carry_error_rate
            answer = problem.answer_without_carry if wrong else problem.answer
            f.write(f"{problem.prompt}{answer}{STOP_TEXT}")
    return path
