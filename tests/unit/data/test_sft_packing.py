"""Fine-tuning examples packed into rows (titan_tpu/data/sft_packing.py).

Bugs caught: labels not shifted by one (or shifted across examples), untrained tokens kept as
targets, an example split across rows, padding that carries labels or joins the last document,
rows of the wrong length, over-long examples silently kept whole or reported once per example,
examples with nothing to learn kept, a packer that leaves rows emptier than best fit would, or
that loses or repeats an example.
"""

from __future__ import annotations

import logging

import pytest

from titan_tpu.data.chat_masks import MaskedTokens
from titan_tpu.data.sft_packing import IGNORE_INDEX, PackingCounts, pack_rows

X = IGNORE_INDEX
PAD = 0


def _example(ids: list[int], trained_from: int) -> MaskedTokens:
    return MaskedTokens(ids, [i >= trained_from for i in range(len(ids))])


def _pack(examples: list[MaskedTokens], seq_len: int = 8, packing: bool = True, overflow: str = "truncate"):
    counts = PackingCounts()
    rows = pack_rows([(f"r{i}", e) for i, e in enumerate(examples)], seq_len, PAD, packing, overflow, counts)  # type: ignore[arg-type]
    return rows, counts


def test_examples_pack_best_fit_decreasing_with_shifted_labels_and_their_own_documents() -> None:
    examples = [_example([11, 12, 13, 14, 15], 3), _example([21, 22, 23], 1), _example(list(range(31, 38)), 2)]
    rows, counts = _pack(examples)
    # 6 positions open a row, 4 open a second (6 + 4 > 8), 2 fill the first: arrival order would
    # give [4 + 2], [6] instead.
    assert [r.input_ids for r in rows] == [[31, 32, 33, 34, 35, 36, 21, 22], [11, 12, 13, 14, PAD, PAD, PAD, PAD]]
    assert [r.labels for r in rows] == [[X, 33, 34, 35, 36, 37, 22, 23], [X, X, 14, 15, X, X, X, X]]
    assert [r.document_ids for r in rows] == [[0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]]
    assert [r.targets for r in rows] == [7, 2] and [r.length for r in rows] == [8, 4] and counts.examples == 3


def test_best_fit_fills_rows_and_keeps_every_example_once() -> None:
    import random

    rng = random.Random(0)
    examples = [_example([100 * i + j for j in range(rng.randint(2, 40))], 1) for i in range(300)]
    rows, _ = _pack(examples, seq_len=64)
    # Each example's first input appears exactly once, where its document starts.
    starts = sorted(
        r.input_ids[k]
        for r in rows
        for k in range(64)
        if r.labels[k] != X and (k == 0 or r.document_ids[k] != r.document_ids[k - 1])
    )
    assert starts == sorted(100 * i for i in range(300))
    positions = sum(len(e.ids) - 1 for e in examples)
    # Never more than one row beyond the lower bound ceil(positions / 64) on these sizes.
    assert len(rows) <= -(-positions // 64) + 1


def test_without_packing_every_row_holds_one_example() -> None:
    rows, _ = _pack([_example([11, 12, 13], 1), _example([21, 22, 23], 1)], packing=False)
    assert [r.input_ids for r in rows] == [[11, 12] + [PAD] * 6, [21, 22] + [PAD] * 6]
    assert [r.labels[:3] for r in rows] == [[12, 13, X], [22, 23, X]]


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_over_long_examples_are_cut_or_left_out_counted_and_reported_once(
    overflow: str, caplog: pytest.LogCaptureFixture
) -> None:
    long = [_example(list(range(100, 112)), 1), _example(list(range(200, 215)), 1)]
    with caplog.at_level(logging.WARNING):
        rows, counts = _pack([*long, _example([1, 2, 3], 1)], overflow=overflow)
    if overflow == "truncate":
        assert counts.truncated == 2 and rows[0].input_ids == list(range(100, 108))
        assert rows[0].labels == list(range(101, 109)) and len(rows) == 3
    else:
        assert counts.dropped_too_long == 2 and [r.input_ids[:2] for r in rows] == [[1, 2]]
    assert len(caplog.records) == 1 and "r0: 12 tokens" in caplog.text


def test_an_example_with_nothing_to_learn_is_left_out() -> None:
    # The prompt alone fills the row once truncated: no trained token survives.
    rows, counts = _pack([_example(list(range(20)), 15), _example([5, 6], 1)])
    assert counts.dropped_no_target == 1 and [r.input_ids[:1] for r in rows] == [[5]]
