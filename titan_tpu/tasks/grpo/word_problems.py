"""Word problems with worked solutions and a GSM8K-style final answer (`#### 12`), small enough for a
debug-size model to learn on a CPU: "Ann has 7 apples and buys 5 more. How many apples does she have
now?" -> "7 + 5 = 12. #### 12".

Half the problems take one step (add or take away), half take two (add then take away, or take away
then add). Numbers stay below 20 so the arithmetic is a few hundred facts.

Every problem lives in exactly one split: a hash of its question puts a fixed share into the held-out
set, which no phase of training ever draws from.

`solution(..., forget_last_step=True)` is the systematic mistake of the noisy demonstrations: on a
two-step problem the worked steps are right but the final answer repeats the first step's result,
like a student who stops one step early. A model trained on a share of such demonstrations answers
two-step problems wrongly when it decodes greedily but still samples the right answer some of the
time, which reinforcement learning with a checker (the `math` reward) can repair.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kim", "Leo")
PRONOUNS = {"Ann": "she", "Cara": "she", "Eva": "she", "Hana": "she", "Ivy": "she", "Kim": "she"}
ITEMS = ("apples", "pens", "cards", "books", "eggs", "coins", "cups", "shells", "stamps", "toys")
MAX_NUMBER = 19
GSM8K_MARK = "####"


@dataclass(frozen=True)
class WordProblem:
    name: str
    item: str
    start: int
    first: int  # added in the first step (or taken away, when negative)
    second: int  # the second step's change; 0 for a one-step problem

    @property
    def steps(self) -> list[tuple[int, int]]:
        """(value before, change) of each step."""
        steps = [(self.start, self.first)]
        if self.second:
            steps.append((self.start + self.first, self.second))
        return steps

    @property
    def answer(self) -> str:
        return str(self.start + self.first + self.second)

    @property
    def question(self) -> str:
        pronoun = PRONOUNS.get(self.name, "he")
        changes = [_change(change) for _, change in self.steps]
        told = f" and {changes[0]}" if len(changes) == 1 else f", {changes[0]} and then {changes[1]}"
        return f"{self.name} has {self.start} {self.item}{told}. How many {self.item} does {pronoun} have now?"

    def solution(self, forget_last_step: bool = False) -> str:
        """The worked steps and the final answer; with `forget_last_step`, the final answer of a
        two-step problem is the first step's result (one-step problems are always right)."""
        lines = [
            f"{before} {'+' if change > 0 else '-'} {abs(change)} = {before + change}." for before, change in self.steps
        ]
        final = str(self.start + self.first) if forget_last_step and self.second else self.answer
        return " ".join(lines) + f" {GSM8K_MARK} {final}"


def _change(amount: int) -> str:
    return f"buys {amount} more" if amount > 0 else f"gives {-amount} away"


def held_out(problem: WordProblem, share: float) -> bool:
    """Whether the problem is in the held-out split: a fixed hash of its question, so the split does
    not depend on the order or the seed problems are drawn with."""
    digest = hashlib.sha256(problem.question.encode()).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64


def _random_problem(rng: random.Random) -> WordProblem:
    start = rng.randint(2, MAX_NUMBER)
    first = _random_change(rng, start)
    second = _random_change(rng, start + first) if rng.random() < 0.5 else 0
    return WordProblem(rng.choice(NAMES), rng.choice(ITEMS), start, first, second)


def _random_change(rng: random.Random, value: int) -> int:
    """+k keeping the value at most MAX_NUMBER, or -k leaving at least one; never 0."""
    gains = list(range(1, MAX_NUMBER - value + 1))
    losses = [-k for k in range(1, value)]
    return rng.choice(gains if gains and (not losses or rng.random() < 0.5) else losses)


def problems(split: str, seed: int, held_out_share: float) -> Iterator[WordProblem]:
    """An endless seeded stream of the split's problems ("train" or "held_out"); held-out problems
    are distinct from each other, training ones repeat as a corpus would."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if not 0 < held_out_share < 1:
        raise ValueError(f"held_out_share must be in (0, 1), got {held_out_share}")
    rng = random.Random(f"{split}-{seed}")
    seen: set[WordProblem] = set()
    while True:
        problem = _random_problem(rng)
        if held_out(problem, held_out_share) != (split == "held_out"):
            continue
        if split == "held_out":
            if problem in seen:
                continue
            seen.add(problem)
        yield problem
