"""Documents -> one global stream of packed samples, cut into seeded shuffle blocks, epoch after epoch.

Every data-parallel rank computes the same stream, so the stream (and therefore what a global batch
holds) does not depend on how many ranks there are. Layout:

- each document becomes `[bos] + encode(text) + [eos]` (no bos when the tokenizer has none);
- the token stream is cut into samples of `sample_len = seq_len + 1` tokens, documents running across
  sample boundaries; the tail of an epoch that does not fill a sample is dropped;
- consecutive samples form blocks of `block_size` (= `data.shuffle_buffer`) samples; with shuffling on,
  each block is permuted with a generator seeded by (seed, epoch, block), so a block can be rebuilt
  exactly on resume;
- global sample indices run on across epochs; an epoch re-reads the source from its first document.

A `BlockStart` is enough to rebuild a block and everything after it: the epoch, the block's index in
its epoch, the global index of its first sample, and where that sample's first token is in the source.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.documents import Cursor, DocumentSource
from titan_tpu.data.tokenizer import Tokenizer

# Documents tokenized per call: enough for the Rust tokenizer's batch parallelism to pay off, small
# enough that the first batch does not wait for a large slice of the corpus.
_ENCODE_BATCH_DOCS = 32
_ENCODE_BATCH_CHARS = 1 << 18

Position = tuple[Cursor, int]  # (document cursor, token offset inside [bos] + tokens + [eos])


@dataclass(frozen=True)
class BlockStart:
    epoch: int
    block: int  # index of the block in its epoch: seeds its permutation
    first_sample: int  # global index of the block's first sample
    cursor: Cursor | None  # document holding the block's first token; None = the source's start
    offset: int  # token offset of that first token in the document

    def to_state(self) -> dict[str, Any]:
        state = asdict(self)
        state["cursor"] = None if self.cursor is None else list(self.cursor)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BlockStart:
        cursor = state["cursor"]
        return cls(
            epoch=int(state["epoch"]),
            block=int(state["block"]),
            first_sample=int(state["first_sample"]),
            cursor=None if cursor is None else tuple(int(c) for c in cursor),
            offset=int(state["offset"]),
        )


@dataclass
class Block:
    start: BlockStart
    samples: torch.Tensor  # int32 [n, sample_len], already in shuffled order

    def __len__(self) -> int:
        return len(self.samples)


def _encode_many(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if encode_batch is not None:
        return encode_batch(texts)
    return [tokenizer.encode(text) for text in texts]


def tokenized(documents: Iterable[tuple[Cursor, str]], tokenizer: Tokenizer) -> Iterator[tuple[Cursor, torch.Tensor]]:
    """Each document as an int32 tensor `[bos] + tokens + [eos]`, tokenized a few at a time."""
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    tail = [tokenizer.eos_id]
    iterator = iter(documents)
    while True:
        group: list[tuple[Cursor, str]] = []
        chars = 0
        for cursor, text in iterator:
            group.append((cursor, text))
            chars += len(text)
            if len(group) >= _ENCODE_BATCH_DOCS or chars >= _ENCODE_BATCH_CHARS:
                break
        if not group:
            return
        for (cursor, _), ids in zip(group, _encode_many(tokenizer, [t for _, t in group])):
            yield cursor, torch.tensor(head + ids + tail, dtype=torch.int32)


def pack(
    documents: Iterable[tuple[Cursor, torch.Tensor]], sample_len: int, first_offset: int = 0
) -> Iterator[tuple[Position, torch.Tensor]]:
    """Tokenized documents -> samples of `sample_len` tokens, each with its first token's position.

    `first_offset` drops that many tokens of the first document (resuming inside a document).
    """
    pending: list[torch.Tensor] = []
    pending_len = 0
    pending_start: Position | None = None
    skip = first_offset
    for cursor, tokens in documents:
        base, skip = skip, 0
        tokens = tokens[base:]
        count = tokens.numel()
        pos = 0
        if pending_len:
            need = sample_len - pending_len
            if count < need:
                pending.append(tokens)
                pending_len += count
                continue
            pending.append(tokens[:need])
            assert pending_start is not None
            yield pending_start, torch.cat(pending)
            pending, pending_len, pos = [], 0, need
        while count - pos >= sample_len:
            yield (cursor, base + pos), tokens[pos : pos + sample_len]
            pos += sample_len
        if pos < count:
            pending, pending_len, pending_start = [tokens[pos:]], count - pos, (cursor, base + pos)


def block_permutation(size: int, seed: int, epoch: int, block: int) -> torch.Tensor:
    digest = hashlib.sha256(f"titan_tpu.data:{seed}:{epoch}:{block}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(size, generator=generator)


def iterate_blocks(
    source: DocumentSource,
    tokenizer: Tokenizer,
    sample_len: int,
    block_size: int,
    shuffle: bool,
    seed: int,
    start: BlockStart,
) -> Iterator[Block]:
    """The global stream of blocks from `start` on, forever (one epoch after another)."""
    epoch, block, first = start.epoch, start.block, start.first_sample
    cursor, offset = start.cursor, start.offset
    while True:
        from_source_start = cursor is None and offset == 0
        samples = pack(tokenized(source.documents(cursor), tokenizer), sample_len, offset)
        produced = 0
        while True:
            chunk = list(islice(samples, block_size))
            if not chunk:
                break
            (first_cursor, first_offset), _ = chunk[0]
            rows = torch.stack([row for _, row in chunk])
            if shuffle:
                rows = rows[block_permutation(len(chunk), seed, epoch, block)]
            yield Block(BlockStart(epoch, block, first, first_cursor, first_offset), rows)
            first += len(chunk)
            block += 1
            produced += len(chunk)
        if produced == 0 and from_source_start:
            raise ConfigError(
                f"data.path: {source.description} holds fewer tokens than one sample of "
                f"training.seq_len + 1 = {sample_len}; add data or lower training.seq_len"
            )
        epoch, block, cursor, offset = epoch + 1, 0, None, 0
