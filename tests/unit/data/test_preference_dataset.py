"""Preference pairs -> fitted, shuffled, sharded samples (titan_tpu/data/preference_dataset.py).

Bugs caught: a long pair cut differently from TRL's max_length (keep_start: the first tokens of each
sequence, the prompt whole), a pair whose prompt fills the row kept with no completion token, a
refusal that does not name the record, ranks that read overlapping or missing pairs, a resume that
replays or skips pairs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from titan_tpu.config import ConfigError
from titan_tpu.data.preference_dataset import (
    Fitting,
    PreferenceCounts,
    PreferenceDataset,
    first_epoch_summary,
    fit_pair,
)
from titan_tpu.data.preference_records import PreferencePair


class Pairs:
    """`count` records; pair i: prompt of 1 + i % 3 tokens, completions of 2 + i % 4 and 1 tokens."""

    description = "test pairs"

    def __init__(self, count: int) -> None:
        self.count = count

    def records(self, start: tuple[int, int] = (0, 0)) -> Iterator[tuple[tuple[int, int], str, dict[str, Any]]]:
        for index in range(start[1], self.count):
            yield (0, index), f"pairs:{index + 1}", {"index": index}


def encode(record: dict[str, Any], where: str) -> PreferencePair:
    i = record["index"]
    return PreferencePair([100 + i] * (1 + i % 3), [200 + i] * (2 + i % 4), [300 + i])


def fitting(max_length: int = 8, overflow: str = "truncate", block_pairs: int = 4, shuffle: bool = True) -> Fitting:
    return Fitting(max_length, 0, overflow, block_pairs, shuffle, seed=3)  # type: ignore[arg-type]


def test_a_long_pair_keeps_its_first_tokens_and_one_whose_prompt_fills_the_row_is_left_out() -> None:
    counts = PreferenceCounts()
    pair = PreferencePair([1, 2, 3], [4, 5, 6, 7], [8])
    assert fit_pair(pair, "r:1", fitting(max_length=7), counts) == pair
    assert fit_pair(pair, "r:1", fitting(max_length=5), counts) == PreferencePair([1, 2, 3], [4, 5], [8])
    assert fit_pair(pair, "r:1", fitting(max_length=3), counts) is None
    assert (counts.pairs, counts.truncated, counts.dropped) == (3, 1, 1)


def test_refuse_names_the_record() -> None:
    with pytest.raises(
        ConfigError, match=r"^r:7: prompt \+ completion is 7 tokens, longer than training.seq_len = 5; "
    ):
        fit_pair(PreferencePair([1, 2, 3], [4, 5, 6, 7], [8]), "r:7", fitting(5, "refuse"), PreferenceCounts())


def _indices(dataset: PreferenceDataset, count: int) -> list[int]:
    samples = iter(dataset)
    return [int(next(samples)["chosen"][0]) - 100 for _ in range(count)]


def test_ranks_share_the_global_stream_and_resume_where_they_stopped() -> None:
    single = _indices(PreferenceDataset(Pairs(10), encode, fitting(), 0, 1, {}), 16)
    assert sorted(single[:10]) == list(range(10)) and single[:10] != list(range(10))  # one shuffled epoch
    ranks = [PreferenceDataset(Pairs(10), encode, fitting(), r, 2, {}) for r in range(2)]
    halves = [_indices(d, 8) for d in ranks]
    assert [i for pair in zip(*halves) for i in pair] == single
    # Resumed from rank 0's state after 3 of its samples: the pairs after them, none twice.
    first = PreferenceDataset(Pairs(10), encode, fitting(), 0, 2, {})
    assert _indices(first, 3) == halves[0][:3]
    resumed = PreferenceDataset(Pairs(10), encode, fitting(), 0, 1, {})
    resumed.load_state_dict(first.state_dict())
    assert _indices(resumed, 10) == single[6:16]


def test_a_sample_holds_the_pairs_sequences_and_lengths() -> None:
    sample = next(iter(PreferenceDataset(Pairs(3), encode, fitting(shuffle=False), 0, 1, {})))
    assert sample["chosen"].tolist() == [100, 200, 200, 0, 0, 0, 0, 0]
    assert sample["rejected"].tolist() == [100, 300, 0, 0, 0, 0, 0, 0]
    assert [int(sample[k]) for k in ("prompt_length", "chosen_length", "rejected_length")] == [1, 3, 2]


def test_the_summary_counts_every_pair() -> None:
    summary = first_epoch_summary(Pairs(10), encode, fitting(max_length=5))
    assert (summary.counts.pairs, summary.pairs) == (10, 10)
    assert summary.counts.truncated == sum(1 + i % 3 + 2 + i % 4 > 5 for i in range(10))
    # (prompt, chosen, rejected) tokens as fitted: each completion cut to the 5 - prompt left.
    fitted = [(1 + i % 3, min(2 + i % 4, 4 - i % 3), 1) for i in range(10)]
    assert summary.tokens == sum(2 * prompt + chosen + rejected for prompt, chosen, rejected in fitted)
    assert summary.completion_tokens == sum(chosen + rejected for _, chosen, rejected in fitted)
    with pytest.raises(ConfigError, match="holds no preference pair that fits"):
        first_epoch_summary(Pairs(3), lambda record, where: PreferencePair([1] * 9, [2], [3]), fitting())
