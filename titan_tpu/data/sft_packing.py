"""Fine-tuning examples -> training rows: inputs, labels and document ids of `seq_len` tokens each.

An example of n tokens (`MaskedTokens`: ids and which of them are trained) trains n - 1 positions:
inputs ids[:-1], labels ids[1:] where the next token is trained, IGNORE_INDEX elsewhere. With
packing, examples go into a row one after another (in the order they come, so a row is rebuilt
exactly from where the stream stood) until the next one does not fit; the rest of the row is
padding (pad token in, no label, a document of its own). Each example is one document
(`document_ids`), so with document masking no example sees another. Without packing every row holds
one example.

An example longer than a row (n - 1 > seq_len) is cut to its first seq_len + 1 tokens
(`overflow = "truncate"`) or left out (`"drop"`); one that keeps no trained token is left out either
way (it would add nothing but compute). Both are counted, and the first of each kind is reported once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from titan_tpu.data.chat_masks import MaskedTokens

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # as the loss (models/common/loss.py) ignores it
Overflow = Literal["truncate", "drop"]


@dataclass(frozen=True)
class Row:
    """One training row: input_ids, labels and document_ids, each seq_len long."""

    input_ids: list[int]
    labels: list[int]
    document_ids: list[int]

    @property
    def targets(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


@dataclass
class PackingCounts:
    """What packing did to the examples it saw; the first of each problem is logged once."""

    examples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    _reported: set[str] = field(default_factory=set)

    def report_once(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            logger.warning("%s (counted in the run's sft/%s metric; reported once)", message, kind)


def _fit(
    where: str, example: MaskedTokens, seq_len: int, overflow: Overflow, counts: PackingCounts
) -> MaskedTokens | None:
    """The example as it goes into a row, or None when it is left out."""
    if len(example.ids) - 1 > seq_len:
        if overflow == "drop":
            counts.dropped_too_long += 1
            counts.report_once("dropped_too_long", f"{where}: {len(example.ids)} tokens, longer than a row "
                               f"({seq_len} + 1); sft.overflow = 'drop' leaves such examples out")  # fmt: skip
            return None
        counts.truncated += 1
        counts.report_once("truncated", f"{where}: {len(example.ids)} tokens, longer than a row ({seq_len} + 1); "
                           "sft.overflow = 'truncate' keeps the first ones")  # fmt: skip
        example = MaskedTokens(example.ids[: seq_len + 1], example.trained[: seq_len + 1])
    if len(example.ids) < 2 or not any(example.trained[1:]):
        counts.dropped_no_target += 1
        counts.report_once("dropped_no_target", f"{where}: no trained token (after truncation); left out")
        return None
    return example


def _piece(example: MaskedTokens) -> tuple[list[int], list[int]]:
    """Inputs and labels of one example (n - 1 positions each)."""
    labels = [token if trained else IGNORE_INDEX for token, trained in zip(example.ids[1:], example.trained[1:])]
    return example.ids[:-1], labels


def pack_examples(
    examples: Iterable[tuple[str, MaskedTokens]],
    seq_len: int,
    pad_id: int,
    packing: bool,
    overflow: Overflow,
    counts: PackingCounts,
) -> Iterator[Row]:
    """Rows of `seq_len` from (where, example) pairs; `counts` records what was cut or left out."""
    inputs: list[int] = []
    labels: list[int] = []
    documents: list[int] = []

    def flush() -> Row:
        padding = seq_len - len(inputs)
        pad_document = (documents[-1] + 1) if documents else 0
        row = Row(inputs + [pad_id] * padding, labels + [IGNORE_INDEX] * padding, documents + [pad_document] * padding)
        inputs.clear()
        labels.clear()
        documents.clear()
        return row

    for where, example in examples:
        counts.examples += 1
        fitted = _fit(where, example, seq_len, overflow, counts)
        if fitted is None:
            continue
        piece_inputs, piece_labels = _piece(fitted)
        if inputs and (not packing or len(inputs) + len(piece_inputs) > seq_len):
            yield flush()
        document = (documents[-1] + 1) if documents else 0
        inputs += piece_inputs
        labels += piece_labels
        documents += [document] * len(piece_inputs)
    if inputs:
        yield flush()
