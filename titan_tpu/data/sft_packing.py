"""Fine-tuning examples -> training rows: inputs, labels and document ids of `seq_len` tokens each.

An example of n tokens (`MaskedTokens`: ids and which of them are trained) trains n - 1 positions:
inputs ids[:-1], labels ids[1:] where the next token is trained, IGNORE_INDEX elsewhere. Each
example is one document of its row (`document_ids`), so with document masking no example sees
another; the rest of a row is padding (pad token in, no label, a document of its own).

With packing, the examples of one block (`pack_rows`' input: a few hundred rows' worth, read in
order) go into rows by best fit decreasing: the longest first, each into the row it fills most
tightly. Filling rows in arrival order instead leaves about half an example of padding per row (a
fifth of a row of 256 tokens holding 100-token conversations); best fit leaves a few percent. The
result depends on the block's examples only, so a block is rebuilt exactly from where it starts.
Without packing every row holds one example, in order.

An example longer than a row (n - 1 > seq_len) is cut to its first seq_len + 1 tokens
(`overflow = "truncate"`) or left out (`"drop"`); one that keeps no trained token is left out either
way (it would add nothing but compute). Both are counted, and the first of each kind is reported once.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from titan_tpu.data.chat_masks import MaskedTokens

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # as the loss (titan_tpu/models/common/loss.py) ignores it
Overflow = Literal["truncate", "drop"]


@dataclass(frozen=True)
class Row:
    """One training row: input_ids, labels and document_ids, each seq_len long; the first `length`
    positions hold examples, the rest is padding."""

    input_ids: list[int]
    labels: list[int]
    document_ids: list[int]
    length: int

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
    silent: bool = False  # a pass whose problems an earlier pass has reported
    _reported: set[str] = field(default_factory=set)

    def report_once(self, kind: str, message: str) -> None:
        if not self.silent and kind not in self._reported:
            self._reported.add(kind)
            logger.warning("%s (counted in the sft summary at start-up; reported once)", message)


def _fit(
    where: str, example: MaskedTokens, seq_len: int, overflow: Overflow, counts: PackingCounts
) -> MaskedTokens | None:
    """The example as it goes into a row, or None when it is left out."""
    if len(example.ids) - 1 > seq_len:
        if overflow == "drop":
            counts.dropped_too_long += 1
            counts.report_once(
                "dropped_too_long",
                f"{where}: {len(example.ids)} tokens, longer than a row "
                f"({seq_len} + 1); sft.overflow = 'drop' leaves such examples out",
            )
            return None
        counts.truncated += 1
        counts.report_once(
            "truncated",
            f"{where}: {len(example.ids)} tokens, longer than a row ({seq_len} + 1); "
            "sft.overflow = 'truncate' keeps the first ones",
        )
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


def _row(pieces: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Row:
    inputs: list[int] = []
    labels: list[int] = []
    documents: list[int] = []
    for document, (piece_inputs, piece_labels) in enumerate(pieces):
        inputs += piece_inputs
        labels += piece_labels
        documents += [document] * len(piece_inputs)
    padding = seq_len - len(inputs)
    return Row(
        inputs + [pad_id] * padding, labels + [IGNORE_INDEX] * padding, documents + [len(pieces)] * padding, len(inputs)
    )


def _best_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Example indices per row: longest first, each into the open row with the least room that
    still holds it (a new row when none does); rows in the order they were opened."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(room, (lengths[index], -1))
        if at == len(room):
            rows.append([index])
            free, row = seq_len - lengths[index], len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(index)
            free -= lengths[index]
        if free > 0:
            bisect.insort(room, (free, row))
    return rows


def pack_rows(
    examples: Iterable[tuple[str, MaskedTokens]],
    seq_len: int,
    pad_id: int,
    packing: bool,
    overflow: Overflow,
    counts: PackingCounts,
) -> list[Row]:
    """The rows of one block of (where, example) pairs; `counts` records what was cut or left out."""
    pieces: list[tuple[list[int], list[int]]] = []
    for where, example in examples:
        counts.examples += 1
        fitted = _fit(where, example, seq_len, overflow, counts)
        if fitted is not None:
            pieces.append(_piece(fitted))
    if not packing:
        return [_row([piece], seq_len, pad_id) for piece in pieces]
    groups = _best_fit_decreasing([len(inputs) for inputs, _ in pieces], seq_len)
    return [_row([pieces[i] for i in group], seq_len, pad_id) for group in groups]
