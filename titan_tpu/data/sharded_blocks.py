"""A global stream of sample blocks, dealt to data-parallel ranks by global sample index (Stateful).

Every rank computes the same stream of blocks (a block: consecutive samples, maybe permuted, with
a start from which it and everything after it is rebuilt exactly). Rank r of W takes global samples
r, r+W, r+2W, ... With equal local batches, after k samples per rank the ranks together have
consumed exactly the first k*W samples: the union of a step's samples is the same for any W, so 1
and 4 processes with one global batch train on the same data.

The state is layout-independent and the same on every rank: the global number of samples consumed
and the start of a block at or before the next sample. Loading it with another W (4 processes -> 1)
continues at the next global sample: nothing is replayed or skipped. A new `iter()` also continues
where the last one stopped.

Pretraining's packed text (`loader.PackedDataset`) and fine-tuning's packed conversations
(`sft_dataset.SftDataset`) are two such streams; they differ in what a block holds and how a
sample is cut from it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset

from titan_tpu.config.errors import ConfigError

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class BlockStart(Protocol):
    # Read-only: block starts are frozen dataclasses.
    @property
    def epoch(self) -> int: ...

    @property
    def first_sample(self) -> int:
        """Global index of the block's first sample."""
        ...

    def to_state(self) -> dict[str, Any]: ...


class Block(Protocol):
    start: Any  # a BlockStart

    def __len__(self) -> int: ...


class ShardedBlocks(IterableDataset, ABC):
    """One data-parallel rank's share of a block stream; subclasses say what the blocks are."""

    def __init__(self, dp_rank: int, dp_world_size: int, first: BlockStart, fingerprint: dict[str, Any]) -> None:
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        # What the saved positions mean: resuming with other values would silently read other data.
        self.fingerprint = fingerprint
        # The position the current (or next) iteration started from ...
        self._resume = first
        self._base = 0  # global samples consumed at that position
        # ... and how far it got since: samples yielded, and the blocks it may still need to name.
        self._yielded = 0
        self._blocks: deque[BlockStart] = deque()

    @abstractmethod
    def blocks(self, start: Any) -> Iterator[Block]:
        """The global stream of blocks from `start` on, forever."""

    @abstractmethod
    def start_from_state(self, state: dict[str, Any]) -> BlockStart:
        """The inverse of a block start's `to_state()`."""

    @abstractmethod
    def sample(self, block: Any, index: int) -> dict[str, torch.Tensor]:
        """Sample `index` of `block` as the loader yields it."""

    # -- Stateful ---------------------------------------------------------------------------------

    def _position(self) -> tuple[BlockStart, int]:
        """(a block start at or before the next global sample, global samples consumed)."""
        if self._yielded == 0:
            return self._resume, self._base
        consumed = self._base + self._yielded * self.dp_world_size
        # Rank 0's last sample: every rank has passed the block holding it, so all ranks agree.
        last_of_rank0 = consumed - self.dp_world_size
        block = next(b for b in reversed(self._blocks) if b.first_sample <= last_of_rank0)
        return block, consumed

    def state_dict(self) -> dict[str, Any]:
        block, consumed = self._position()
        return {
            "version": STATE_VERSION,
            "samples_consumed": consumed,
            "epoch": block.epoch,
            "block_start": block.to_state(),
            "fingerprint": dict(self.fingerprint),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"checkpoint: data loader state has version {state.get('version')!r}; allowed: {STATE_VERSION}"
            )
        saved = state["fingerprint"]
        changed = [
            f"{key} {saved.get(key)!r} -> {value!r}"
            for key, value in self.fingerprint.items()
            if key != "path" and saved.get(key) != value
        ]
        if changed:
            raise ConfigError(
                "checkpoint: the data settings differ from the checkpoint's ("
                + "; ".join(changed)
                + "); resume with the same data settings, or start a new run in another dump_folder"
            )
        if saved.get("path") != self.fingerprint.get("path"):
            logger.warning(
                "data: resuming with data.path %r, the checkpoint used %r; assuming the same files",
                self.fingerprint.get("path"),
                saved.get("path"),
            )
        self._resume = self.start_from_state(state["block_start"])
        self._base = int(state["samples_consumed"])
        self._yielded = 0
        self._blocks.clear()

    # -- iteration --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._resume, self._base = self._position()
        self._yielded = 0
        self._blocks.clear()
        base, world, rank = self._base, self.dp_world_size, self.dp_rank
        for block in self.blocks(self._resume):
            self._blocks.append(block.start)
            first, end = block.start.first_sample, block.start.first_sample + len(block)
            # This rank's samples: global indices base + rank + j * world, for j = 0, 1, ...
            index = max(first, base + rank)
            index += (base + rank - index) % world
            for global_index in range(index, end, world):
                sample = self.sample(block, global_index - first)
                self._yielded += 1
                self._forget_blocks_before(self._base + (self._yielded - 1) * world)
                yield sample

    def _forget_blocks_before(self, last_of_rank0: int) -> None:
        while len(self._blocks) > 1 and self._blocks[1].first_sample <= last_of_rank0:
            self._blocks.popleft()
