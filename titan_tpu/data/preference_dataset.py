"""Preference pairs -> fixed-width samples, dealt to data-parallel ranks and resumed exactly (Stateful).

The global stream: records in order (`RecordSource`), each turned into a `PreferencePair` of ids
(`preference_records.py`) and fitted to `max_length` tokens per sequence; consecutive pairs are read
into blocks of `block_pairs`, whose order is permuted with a generator seeded by (seed, epoch,
block) when shuffling. An epoch ends with the records and the next re-reads them from the first. How
ranks share the pairs and what the checkpoint holds is `sharded_blocks.ShardedBlocks`'s, with one pair
per sample, so a global batch holds the same pairs whatever the number of processes.

Fitting, as TRL's DPOTrainer with `max_length` (its only truncation mode, "keep_start"): a sequence
(prompt + completion) longer than `max_length` keeps its first `max_length` tokens; a pair whose
prompt alone fills `max_length` keeps no completion token and is left out, counted and reported
once. With `overflow = "refuse"` the first pair that does not fit stops the run with one line
naming it instead.

A sample is `{"chosen", "rejected"}`: each int64 [max_length], the sequence's ids then padding, and
`{"prompt_length", "chosen_length", "rejected_length"}`: where the completions start (after the
shared prompt) and where each sequence ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.preference_records import PreferencePair
from titan_tpu.data.sft_dataset import NewBlock, RecordAt, RecordSource, SftBlockStart, epochs_of_blocks
from titan_tpu.data.sharded_blocks import ShardedBlocks

logger = logging.getLogger(__name__)

Overflow = Literal["truncate", "refuse"]
# (record, where) -> the record's pair; raises ConfigError for a record it cannot use.
EncodePair = Callable[[dict[str, Any], str], PreferencePair]


@dataclass(frozen=True)
class Fitting:
    max_length: int  # tokens of one sequence (prompt + completion)
    pad_id: int
    overflow: Overflow
    block_pairs: int  # pairs read into one block
    shuffle: bool
    seed: int


@dataclass
class PreferenceCounts:
    """What fitting did to the pairs it saw; the first of each problem is logged once."""

    pairs: int = 0
    truncated: int = 0
    dropped: int = 0  # the prompt alone fills max_length
    silent: bool = False  # a pass whose problems an earlier pass has reported
    _reported: set[str] = field(default_factory=set)

    def report_once(self, kind: str, message: str) -> None:
        if not self.silent and kind not in self._reported:
            self._reported.add(kind)
            logger.warning("%s (counted in the dpo summary at start-up; reported once)", message)


def fit_pair(pair: PreferencePair, where: str, fitting: Fitting, counts: PreferenceCounts) -> PreferencePair | None:
    """The pair as it is trained on: whole, cut to max_length tokens per sequence, or None (left out)."""
    longest = fitting.max_length
    counts.pairs += 1
    sizes = len(pair.prompt) + len(pair.chosen), len(pair.prompt) + len(pair.rejected)
    if max(sizes) <= longest:
        return pair
    if fitting.overflow == "refuse":
        raise ConfigError(
            f"{where}: prompt + completion is {max(sizes)} tokens, longer than training.seq_len = {longest}; "
            "dpo.overflow = 'refuse' stops here (set dpo.overflow = 'truncate' to keep the first "
            f"{longest} tokens of each sequence, as TRL's max_length does, or raise training.seq_len)"
        )
    if len(pair.prompt) >= longest:
        counts.dropped += 1
        counts.report_once(
            "dropped",
            f"{where}: the prompt alone is {len(pair.prompt)} tokens, training.seq_len = {longest} leaves no "
            "completion token; such pairs are left out",
        )
        return None
    counts.truncated += 1
    counts.report_once(
        "truncated",
        f"{where}: prompt + completion is {max(sizes)} tokens, longer than training.seq_len = {longest}; "
        "dpo.overflow = 'truncate' keeps the first ones of each sequence",
    )
    room = longest - len(pair.prompt)
    return PreferencePair(pair.prompt, pair.chosen[:room], pair.rejected[:room])


@dataclass
class PreferenceBlock:
    start: SftBlockStart
    sequences: torch.Tensor  # int64 [n, 2, max_length]: chosen, rejected (ids, then padding); shuffled
    lengths: torch.Tensor  # int64 [n, 3]: prompt, chosen sequence and rejected sequence lengths

    def __len__(self) -> int:
        return len(self.sequences)


def _block_tensors(pairs: list[PreferencePair], fitting: Fitting) -> tuple[torch.Tensor, torch.Tensor]:
    width = fitting.max_length
    sequences = torch.full((len(pairs), 2, width), fitting.pad_id, dtype=torch.long)
    lengths = torch.empty((len(pairs), 3), dtype=torch.long)
    for k, pair in enumerate(pairs):
        for side, completion in enumerate((pair.chosen, pair.rejected)):
            ids = pair.prompt + completion
            sequences[k, side, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths[k] = torch.tensor(
            [len(pair.prompt), len(pair.prompt) + len(pair.chosen), len(pair.prompt) + len(pair.rejected)]
        )
    return sequences, lengths


def iterate_preference_blocks(
    source: RecordSource,
    encode: EncodePair,
    fitting: Fitting,
    start: SftBlockStart,
    counts: PreferenceCounts,
    forever: bool = True,
) -> Iterator[PreferenceBlock]:
    """The global stream of blocks from `start` on (`sft_dataset.epochs_of_blocks`): `block_pairs`
    records a block, each pair fitted."""

    def fitted(records: Iterator[RecordAt]) -> Iterator[NewBlock]:
        pending = next(records, None)
        while pending is not None:
            block_cursor = pending[0]
            pairs: list[PreferencePair] = []
            read = 0
            while pending is not None and read < fitting.block_pairs:
                _, where, record = pending
                pair = fit_pair(encode(record, where), where, fitting, counts)
                if pair is not None:
                    pairs.append(pair)
                read += 1
                pending = next(records, None)
            if pairs:
                yield block_cursor, _block_tensors(pairs, fitting)

    blocks = epochs_of_blocks(
        source, start, fitted, fitting.shuffle, fitting.seed, forever, "preference pair that fits"
    )
    for block_start, (sequences, lengths) in blocks:
        yield PreferenceBlock(block_start, sequences, lengths)


class PreferenceDataset(ShardedBlocks):
    """Infinite stream of one data-parallel rank's pairs (see the module's docstring for a sample)."""

    def __init__(
        self,
        source: RecordSource,
        encode: EncodePair,
        fitting: Fitting,
        dp_rank: int,
        dp_world_size: int,
        fingerprint: dict[str, Any],
    ) -> None:
        self.source, self.encode, self.fitting = source, encode, fitting
        # The stream's problems are those `first_epoch_summary` reported when the run started.
        self.counts = PreferenceCounts(silent=True)
        super().__init__(dp_rank, dp_world_size, SftBlockStart(0, 0, 0, (0, 0)), {**asdict(fitting), **fingerprint})

    def blocks(self, start: SftBlockStart) -> Iterator[PreferenceBlock]:
        return iterate_preference_blocks(self.source, self.encode, self.fitting, start, self.counts)

    def start_from_state(self, state: dict[str, Any]) -> SftBlockStart:
        return SftBlockStart.from_state(state)

    def sample(self, block: PreferenceBlock, index: int) -> dict[str, torch.Tensor]:
        chosen, rejected = block.sequences[index]
        prompt_length, chosen_length, rejected_length = block.lengths[index]
        return {
            "chosen": chosen,
            "rejected": rejected,
            "prompt_length": prompt_length,
            "chosen_length": chosen_length,
            "rejected_length": rejected_length,
        }


@dataclass(frozen=True)
class PreferenceSummary:
    """One epoch of the stream: what fitting made of the records."""

    counts: PreferenceCounts
    pairs: int  # kept
    tokens: int  # of both sequences of every kept pair
    completion_tokens: int  # of those, the completions' (what is scored)

    def describe(self) -> str:
        c = self.counts
        return (
            f"{c.pairs} pairs ({self.pairs} kept, {c.truncated} truncated, {c.dropped} left out: prompt longer "
            f"than a sequence), {self.tokens} tokens, {self.completion_tokens} of them in completions"
        )


def first_epoch_summary(source: RecordSource, encode: EncodePair, fitting: Fitting) -> PreferenceSummary:
    """Read, check and fit every record once: a record that cannot be used stops the run here, before
    the model is built, with its file and line; the counts are reported once."""
    counts = PreferenceCounts()
    pairs = tokens = completions = 0
    start = SftBlockStart(0, 0, 0, (0, 0))
    for block in iterate_preference_blocks(source, encode, fitting, start, counts, forever=False):
        pairs += len(block)
        prompt, chosen, rejected = block.lengths.sum(dim=0).tolist()
        tokens += chosen + rejected
        completions += chosen + rejected - 2 * prompt
    return PreferenceSummary(counts, pairs, tokens, completions)
