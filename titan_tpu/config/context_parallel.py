"""The settings context parallelism (`parallelism.cp`) cannot run with yet, each refused with one line.

Context parallelism splits every sample's sequence into 2 x cp chunks and gives cp rank i chunks i
and 2 x cp - 1 - i (titan_tpu/distributed/context_parallel.py), so the sequence length must divide
into 2 x cp equal chunks. What is not built for it: expert parallelism (carved from dp_shard, where
TorchTitan carves it from dp_shard x cp), packed-document masking (document ids and their positions
would have to be computed on the whole row and split with it), and the held-out evaluation (it runs
the model on whole rows). The family and the task are checked by the trainer, which knows them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.config.errors import ConfigError

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig


def check_context_parallel(config: TrainConfig) -> None:
    cp = config.parallelism.cp
    if cp == 1:
        return
    seq_len = config.training.seq_len
    if seq_len % (2 * cp) != 0:
        raise ConfigError(
            f"parallelism.cp = {cp} splits each sequence into 2 x cp = {2 * cp} equal chunks, but "
            f"training.seq_len {seq_len} is not a multiple of {2 * cp}"
        )
    refused = {
        "parallelism.ep": (config.parallelism.ep > 1, "expert parallelism"),
        "data.document_mask": (config.data.document_mask, "packed-document masking"),
        "validation.enable": (config.validation.enable, "the held-out evaluation"),
    }
    for key, (requested, what) in refused.items():
        if requested:
            raise ConfigError(f"{key}: {what} is not supported with parallelism.cp = {cp} yet; set parallelism.cp = 1")
