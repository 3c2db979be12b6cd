"""The packed dataset, sharded by global sample index, served by torchdata's `StatefulDataLoader`.

Rank r of W takes global samples r, r+W, r+2W, ... of the stream `packing.iterate_blocks` makes. With
equal local batches, after k samples per rank the ranks together have consumed exactly the first k*W
samples: the union of a step's samples is the same for any W, so 1 and 4 processes with one global
batch train on the same data.

The state is layout-independent and the same on every rank: the global number of samples consumed
and the start of a block at or before the next sample. Loading it with another W (4 processes -> 1)
continues at the next global sample: nothing is replayed or skipped. A new `iter()` over the loader
also continues where the last one stopped.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import DataConfig
from titan_tpu.data.documents import DocumentSource
from titan_tpu.data.files import FileSource
from titan_tpu.data.packing import BlockStart, iterate_blocks
from titan_tpu.data.sources import EmbeddedSource, HuggingFaceSource
from titan_tpu.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_START = BlockStart(epoch=0, block=0, first_sample=0, cursor=None, offset=0)


class PackedDataset(IterableDataset):
    """Infinite stream of `{"input_ids", "labels"}` samples for one data-parallel rank (Stateful)."""

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        shuffle: bool = True,
        shuffle_buffer: int = 1024,
        fingerprint: dict[str, Any] | None = None,
    ) -> None:
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        if seq_len < 1 or shuffle_buffer < 1:
            raise ValueError(f"seq_len ({seq_len}) and shuffle_buffer ({shuffle_buffer}) must be >= 1")
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.dp_rank, self.dp_world_size = seq_len, dp_rank, dp_world_size
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        # What the saved positions mean: resuming with other values would silently read other data.
        self.fingerprint = {
            "seq_len": seq_len,
            "shuffle": shuffle,
            "shuffle_buffer": shuffle_buffer,
            "seed": seed,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            **(fingerprint or {}),
        }
        # The position the current (or next) iteration started from ...
        self._resume = _START
        self._base = 0  # global samples consumed at that position
        # ... and how far it got since: samples yielded, and the blocks it may still need to name.
        self._yielded = 0
        self._blocks: deque[BlockStart] = deque()

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
                f"checkpoint: data loader state has version {state.get('version')!r}; "
                f"allowed: {STATE_VERSION}"
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
        self._resume = BlockStart.from_state(state["block_start"])
        self._base = int(state["samples_consumed"])
        self._yielded = 0
        self._blocks.clear()

    # -- iteration --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._resume, self._base = self._position()
        self._yielded = 0
        self._blocks.clear()
        base, world, rank = self._base, self.dp_world_size, self.dp_rank
        blocks = iterate_blocks(
            self.source,
            self.tokenizer,
            self.seq_len + 1,
            self.shuffle_buffer,
            self.shuffle,
            self.seed,
            self._resume,
        )
        for block in blocks:
            self._blocks.append(block.start)
            first, end = block.start.first_sample, block.start.first_sample + len(block.samples)
            # This rank's samples: global indices base + rank + j * world, for j = 0, 1, ...
            index = max(first, base + rank)
            index += (base + rank - index) % world
            for global_index in range(index, end, world):
                row = block.samples[global_index - first].long()
                self._yielded += 1
                self._forget_blocks_before(self._base + (self._yielded - 1) * world)
                yield {"input_ids": row[:-1], "labels": row[1:]}

    def _forget_blocks_before(self, last_of_rank0: int) -> None:
        while len(self._blocks) > 1 and self._blocks[1].first_sample <= last_of_rank0:
            self._blocks.popleft()


def build_source(cfg: DataConfig) -> DocumentSource:
    """The document source `cfg.source` names; bad paths fail here, before any training starts."""
    if cfg.source == "embedded":
        source = EmbeddedSource()
        _ = source.files  # list them now: an install without sources fails at start-up
        return source
    if cfg.source in ("files", "huggingface") and not cfg.path:
        raise ConfigError(f"data.path: is required when data.source = '{cfg.source}'")
    if cfg.source == "files":
        return FileSource(cfg.path, cfg.text_field)
    if cfg.source == "huggingface":
        return HuggingFaceSource(cfg.path, cfg.hf_split, cfg.text_field)
    raise ConfigError(
        f"data.source: unknown source '{cfg.source}'; allowed: embedded, files, huggingface"
    )


def _source_fingerprint(cfg: DataConfig) -> dict[str, Any]:
    if cfg.source == "embedded":
        return {"source": cfg.source}
    found = {"source": cfg.source, "path": cfg.path, "text_field": cfg.text_field}
    if cfg.source == "huggingface":
        found["hf_split"] = cfg.hf_split
    return found


def build_dataloader(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
) -> StatefulDataLoader:
    """Batches `{"input_ids": LongTensor[B, S], "labels": LongTensor[B, S]}` for one dp rank, forever.

    `labels` are `input_ids` shifted by one: each row is cut from one packed sample of S + 1 tokens.
    """
    if local_batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    source = build_source(cfg)
    dataset = PackedDataset(
        source,
        tokenizer,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        shuffle=cfg.shuffle,
        shuffle_buffer=cfg.shuffle_buffer,
        fingerprint=_source_fingerprint(cfg),
    )
    return stateful_loader(dataset, local_batch_size, seed)


def stateful_loader(dataset: IterableDataset, local_batch_size: int, seed: int) -> StatefulDataLoader:
    """The checkpointable loader every task's pipeline ends in. In the loading process (workers would
    each hold a copy of the dataset's position), and with its own generator: creating an iterator
    must not draw from the global RNG that seeds training."""
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch API that newer torch releases deprecate; not our user's concern.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(
            dataset, batch_size=local_batch_size, num_workers=0, generator=torch.Generator().manual_seed(seed)
        )
