"""Pretraining's packed dataset, sharded by global sample index, served by torchdata's `StatefulDataLoader`.

The stream of samples is `packing.iterate_blocks`'s; how ranks share it, and the layout-independent
state that resumes it exactly, are `sharded_blocks.ShardedBlocks`'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import DataConfig
from titan_tpu.data.documents import DocumentSource
from titan_tpu.data.files import FileSource
from titan_tpu.data.packing import Block, BlockStart, iterate_blocks
from titan_tpu.data.sharded_blocks import ShardedBlocks
from titan_tpu.data.sources import EmbeddedSource, HuggingFaceSource
from titan_tpu.data.tokenizer import Tokenizer

_START = BlockStart(epoch=0, block=0, first_sample=0, cursor=None, offset=0)


class PackedDataset(ShardedBlocks):
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
        if seq_len < 1 or shuffle_buffer < 1:
            raise ValueError(f"seq_len ({seq_len}) and shuffle_buffer ({shuffle_buffer}) must be >= 1")
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.seed, self.shuffle, self.shuffle_buffer = seq_len, seed, shuffle, shuffle_buffer
        identity = {
            "seq_len": seq_len,
            "shuffle": shuffle,
            "shuffle_buffer": shuffle_buffer,
            "seed": seed,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            **(fingerprint or {}),
        }
        super().__init__(dp_rank, dp_world_size, _START, identity)

    def blocks(self, start: BlockStart) -> Iterator[Block]:
        return iterate_blocks(
            self.source, self.tokenizer, self.seq_len + 1, self.shuffle_buffer, self.shuffle, self.seed, start
        )

    def start_from_state(self, state: dict[str, Any]) -> BlockStart:
        return BlockStart.from_state(state)

    def sample(self, block: Block, index: int) -> dict[str, torch.Tensor]:
        row = block.samples[index].long()
        return {"input_ids": row[:-1], "labels": row[1:]}


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
    raise ConfigError(f"data.source: unknown source '{cfg.source}'; allowed: embedded, files, huggingface")


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
