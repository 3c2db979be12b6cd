"""A generated chat task: conversations made from a seed, for fine-tuning without a download.

Each conversation asks for one or two string transformations of a made-up word ("Spell grofa." ->
"g-r-o-f-a", "Shout grofa." -> "GROFA"), sometimes after a system prompt. The answers follow from
the question exactly, so a model that learned the format answers held-out questions exactly: the
fine-tuning learning test and the debug config measure that (`sft.eval_generations`).

Words are split by a hash into training and held-out words, so no held-out answer is ever trained
on. Conversation i of a split is a pure function of (seed, split, i): a record is rebuilt from its
index alone, which is its cursor.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any, Literal

Split = Literal["train", "held_out"]
_LETTERS = "abcdefghijklmnoprstuvwy"
_SYSTEM = "Answer with the word only."
_HELD_OUT_SHARE = 8  # one word in 8 is held out


def _is_held_out(word: str) -> bool:
    return hashlib.sha256(word.encode()).digest()[0] % _HELD_OUT_SHARE == 0


def _word(rng: random.Random, split: Split) -> str:
    while True:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))
        if _is_held_out(word) == (split == "held_out"):
            return word


def _exchange(rng: random.Random, word: str) -> tuple[str, str]:
    if rng.random() < 0.5:
        return f"Spell {word}.", "-".join(word)
    return f"Shout {word}.", word.upper()


def conversation(seed: int, split: Split, index: int) -> list[dict[str, str]]:
    """Conversation `index` of `split`: a system prompt half of the time, then one or two exchanges."""
    rng = random.Random(f"titan_tpu.generated_chat:{seed}:{split}:{index}")
    messages = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 2)):
        question, answer = _exchange(rng, _word(rng, split))
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


class GeneratedChat:
    """`count` conversations of one split as records `{"messages": [...]}` (sft_records' shape)."""

    def __init__(self, seed: int, split: Split, count: int, messages_field: str = "messages") -> None:
        self.seed, self.split, self.count, self.field = seed, split, count, messages_field
        self.description = f"generated chat ({split}, {count} conversations)"

    def records(self, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[tuple[int, int], str, dict[str, Any]]]:
        for index in range(start[1], self.count):
            yield (0, index), f"{self.description}: conversation {index}", {self.field: self.conversation(index)}

    def conversation(self, index: int) -> list[dict[str, str]]:
        return conversation(self.seed, self.split, index)
