"""Fine-tuning records -> packed rows, dealt to data-parallel ranks and resumed exactly (Stateful).

The global stream: records in order (`RecordSource`), each tokenized with its loss mask
(`sft_examples.record_tokens`); consecutive records are read into blocks of about `block_rows`
rows' worth of tokens, each block packed on its own (`sft_packing.pack_rows`) and its rows permuted
with a generator seeded by (seed, epoch, block) when shuffling. An epoch ends with the records and
the next re-reads them from the first. A block starts at a record, so its start (`SftBlockStart`:
epoch, block index, its first row's global index and the cursor of its first record) rebuilds it
and everything after it. How ranks share the rows and what the checkpoint holds is
`sharded_blocks.ShardedBlocks`'s.

A sample is `{"input_ids", "labels", "document_ids"}` of `seq_len` each (labels already shifted;
IGNORE_INDEX where nothing is learned) and its `length`, the positions before its padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.chat_masks import MaskedTokens
from titan_tpu.data.packing import block_permutation
from titan_tpu.data.sft_packing import IGNORE_INDEX, Overflow, PackingCounts, Row, pack_rows
from titan_tpu.data.sft_records import RecordCursor
from titan_tpu.data.sharded_blocks import ShardedBlocks

# (record, where) -> the record's ids and mask; raises ConfigError for a record it cannot use.
Encode = Callable[[dict[str, Any], str], MaskedTokens]
# A record as a source yields it: its cursor, where it is (file and line) and its fields.
RecordAt = tuple[RecordCursor, str, dict[str, Any]]


class RecordSource(Protocol):
    description: str

    def records(self, start: RecordCursor = (0, 0)) -> Iterator[RecordAt]: ...


@dataclass(frozen=True)
class SftBlockStart:
    epoch: int
    block: int  # index of the block in its epoch: seeds its permutation
    first_sample: int  # global index of the block's first row
    cursor: RecordCursor  # the block's first record

    def to_state(self) -> dict[str, Any]:
        return {**asdict(self), "cursor": list(self.cursor)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SftBlockStart:
        file_index, record = state["cursor"]
        cursor = (int(file_index), int(record))
        return cls(int(state["epoch"]), int(state["block"]), int(state["first_sample"]), cursor)


@dataclass
class SftBlock:
    start: SftBlockStart
    rows: torch.Tensor  # int64 [n, 3, seq_len]: input ids, labels, document ids; in shuffled order
    lengths: torch.Tensor  # int64 [n]: the positions of each row that hold examples (not padding)

    def __len__(self) -> int:
        return len(self.rows)


def _tensors(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([[r.input_ids, r.labels, r.document_ids] for r in rows], dtype=torch.long)
    return tokens, torch.tensor([r.length for r in rows], dtype=torch.long)


@dataclass(frozen=True)
class Packing:
    seq_len: int
    pad_id: int
    packing: bool
    overflow: Overflow
    block_rows: int  # rows' worth of tokens read into one block
    shuffle: bool
    seed: int


# A block before its place in the stream: the cursor of its first record and its tensors (samples
# along the first dimension).
NewBlock = tuple[RecordCursor, tuple[torch.Tensor, ...]]
# Records from a cursor -> their blocks; a group of records that gives no sample yields none.
BlocksOf = Callable[[Iterator[RecordAt]], Iterator[NewBlock]]


def epochs_of_blocks(
    source: RecordSource,
    start: SftBlockStart,
    blocks_of: BlocksOf,
    shuffle: bool,
    seed: int,
    forever: bool,
    sample: str,
) -> Iterator[tuple[SftBlockStart, tuple[torch.Tensor, ...]]]:
    """The global stream of blocks from `start` on, each with its start: forever, one epoch after
    another, or to the end of `start`'s epoch. A block's samples are permuted with a generator seeded
    by (seed, epoch, block) when shuffling. An epoch read from its first record that gives no block
    stops the run (`sample` names what it holds none of)."""
    epoch, block, first, cursor = start.epoch, start.block, start.first_sample, start.cursor
    while True:
        from_first_record = cursor == (0, 0)
        produced = 0
        for block_cursor, tensors in blocks_of(source.records(cursor)):
            samples = len(tensors[0])
            if shuffle:
                order = block_permutation(samples, seed, epoch, block)
                tensors = tuple(tensor[order] for tensor in tensors)
            yield SftBlockStart(epoch, block, first, block_cursor), tensors
            first += samples
            block += 1
            produced += samples
        if produced == 0 and from_first_record:
            raise ConfigError(f"data.path: {source.description} holds no {sample}")
        if not forever:
            return
        epoch, block, cursor = epoch + 1, 0, (0, 0)


def iterate_sft_blocks(
    source: RecordSource,
    encode: Encode,
    packing: Packing,
    start: SftBlockStart,
    counts: PackingCounts,
    forever: bool = True,
) -> Iterator[SftBlock]:
    """The global stream of blocks from `start` on (`epochs_of_blocks`): records read until a
    block's worth of tokens, then packed."""
    budget = packing.block_rows * packing.seq_len

    def packed(records: Iterator[RecordAt]) -> Iterator[NewBlock]:
        pending = next(records, None)
        while pending is not None:
            block_cursor = pending[0]
            examples: list[tuple[str, MaskedTokens]] = []
            token_count = 0
            while pending is not None and (token_count < budget or not examples):
                _, where, record = pending
                example = encode(record, where)
                examples.append((where, example))
                token_count += len(example.ids) - 1
                pending = next(records, None)
            rows = pack_rows(examples, packing.seq_len, packing.pad_id, packing.packing, packing.overflow, counts)
            if rows:
                yield block_cursor, _tensors(rows)

    blocks = epochs_of_blocks(
        source, start, packed, packing.shuffle, packing.seed, forever, "example with a token to train on"
    )
    for block_start, (tokens, lengths) in blocks:
        yield SftBlock(block_start, tokens, lengths)


class SftDataset(ShardedBlocks):
    """Infinite stream of `{"input_ids", "labels", "document_ids"}` rows for one data-parallel rank."""

    def __init__(
        self,
        source: RecordSource,
        encode: Encode,
        packing: Packing,
        dp_rank: int,
        dp_world_size: int,
        fingerprint: dict[str, Any],
    ) -> None:
        self.source, self.encode, self.packing = source, encode, packing
        # The stream's problems are those `first_epoch_summary` reported when the run started.
        self.counts = PackingCounts(silent=True)
        identity = {**asdict(packing), **fingerprint}
        super().__init__(dp_rank, dp_world_size, SftBlockStart(0, 0, 0, (0, 0)), identity)

    def blocks(self, start: SftBlockStart) -> Iterator[SftBlock]:
        return iterate_sft_blocks(self.source, self.encode, self.packing, start, self.counts)

    def start_from_state(self, state: dict[str, Any]) -> SftBlockStart:
        return SftBlockStart.from_state(state)

    def sample(self, block: SftBlock, index: int) -> dict[str, torch.Tensor]:
        inputs, labels, documents = block.rows[index]
        return {"input_ids": inputs, "labels": labels, "document_ids": documents, "length": block.lengths[index]}


@dataclass(frozen=True)
class SftSummary:
    """One epoch of the stream: what packing made of the records."""

    counts: PackingCounts
    rows: int
    positions: int  # rows x seq_len
    tokens: int  # positions holding examples
    targets: int  # positions the loss trains on

    def describe(self) -> str:
        c = self.counts
        kept = c.examples - c.dropped_too_long - c.dropped_no_target
        return (
            f"{c.examples} examples ({kept} kept, {c.truncated} truncated, {c.dropped_too_long} dropped as too "
            f"long, {c.dropped_no_target} with nothing to learn) -> {self.rows} rows, {self.tokens} tokens "
            f"({100 * self.tokens / self.positions:.1f}% of the rows' positions), {self.targets} trained on"
        )


def first_epoch_summary(source: RecordSource, encode: Encode, packing: Packing) -> SftSummary:
    """Read, check and pack every record once: a record that cannot be used stops the run here,
    before the model is built, with its file and line; the counts are reported once."""
    counts = PackingCounts()
    rows = tokens = targets = 0
    for block in iterate_sft_blocks(source, encode, packing, SftBlockStart(0, 0, 0, (0, 0)), counts, forever=False):
        rows += len(block)
        tokens += int(block.lengths.sum())
        targets += int((block.rows[:, 1] != IGNORE_INDEX).sum())
    return SftSummary(counts, rows, rows * packing.seq_len, tokens, targets)
