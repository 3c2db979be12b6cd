"""A generated preference task: sums with a right and a wrong answer, for preference training without a
download.

Each pair asks for the sum of two numbers from 1 to 99 ("What is 37+45?"); the chosen answer is the
sum ("82"), the rejected one a wrong answer of the kinds a model that has not learned to add gives:
the difference of the two numbers ("8"), or one of them repeated ("37", "45"), each a third of the
time. Telling them apart takes reading the question: the sum is larger than both numbers and is
neither of them. Questions are split by a hash into training and held-out questions, so no held-out
question is ever trained on, and with about 10,000 questions a model cannot learn the answers by
heart: it prefers the right answer to an unseen question only if it learned that rule. The debug
config, the learning test and the recipe measure that as the held-out reward accuracy.

Pair i of a split is a pure function of (seed, split, i): a record is rebuilt from its index alone,
which is its cursor.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any, Literal

from titan_tpu.data.preference_records import PreferenceFields

Split = Literal["train", "held_out"]
LARGEST_OPERAND = 99
_HELD_OUT_SHARE = 8  # one question in 8 is held out


def _is_held_out(a: int, b: int) -> bool:
    return hashlib.sha256(f"{a}+{b}".encode()).digest()[0] % _HELD_OUT_SHARE == 0


def preference(seed: int, split: Split, index: int) -> tuple[str, str, str]:
    """(question, right answer, wrong answer) of pair `index` of `split`."""
    rng = random.Random(f"titan_tpu.preference_generated:{seed}:{split}:{index}")
    while True:
        a, b = rng.randint(1, LARGEST_OPERAND), rng.randint(1, LARGEST_OPERAND)
        if _is_held_out(a, b) == (split == "held_out"):
            break
    wrong = rng.choice([abs(a - b), a, b])  # never the sum: both numbers are at least 1
    return f"What is {a}+{b}?", str(a + b), str(wrong)


class GeneratedPreferences:
    """`count` pairs of one split as conversational records (TRL's preference shape): the prompt a
    user turn, chosen and rejected one assistant turn each."""

    def __init__(self, seed: int, split: Split, count: int, fields: PreferenceFields | None = None) -> None:
        self.seed, self.split, self.count, self.fields = seed, split, count, fields or PreferenceFields()
        self.description = f"generated sums ({split}, {count} pairs)"

    def records(self, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[tuple[int, int], str, dict[str, Any]]]:
        for index in range(start[1], self.count):
            yield (0, index), f"{self.description}: pair {index}", self.record(index)

    def record(self, index: int) -> dict[str, Any]:
        question, right, wrong = preference(self.seed, self.split, index)
        return {
            self.fields.prompt: [{"role": "user", "content": question}],
            self.fields.chosen: [{"role": "assistant", "content": right}],
            self.fields.rejected: [{"role": "assistant", "content": wrong}],
        }
