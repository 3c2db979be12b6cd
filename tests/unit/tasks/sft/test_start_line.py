"""The fine-tuning run's start-up line: its records, what one epoch of them packs into, and how many
epochs training.steps amounts to."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

WORDS = ["abc", "bcd", "cde", "def", "efg", "fgh", "ghi", "hij", "ijk", "jkl", "klm", "lmn"]


def _conversation(word: str) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Spell {word}."}, {"role": "assistant", "content": "-".join(word)}]
    }


def test_the_start_line_counts_epochs_in_rows_of_the_global_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """12 conversations, one per row (no packing), and one too long for a row, which is dropped: an
    epoch is 12 rows, and 6 steps of 4 rows are 2 epochs. Negative controls: epochs counted in
    records (13: 1.85), or in the local batch of 2 rows (1.00), or the steps alone (0.50) would
    each show another number."""
    records = [_conversation(w) for w in WORDS] + [_conversation("x" * 100)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load_config(
        "sft_qwen3_debug",
        [
            f"--job.dump_folder={tmp_path / 'run'}",
            "--sft.dataset=data",
            "--data.source=files",
            f"--data.path={path}",
            "--sft.packing=false",
            "--sft.overflow=drop",
            "--training.seq_len=64",
            "--training.global_batch_size=4",
            "--training.local_batch_size=2",
            "--training.steps=6",
            "--training.dtype=float32",
            "--validation.enable=false",
            "--metrics.eval_freq=0",
            "--metrics.plot_loss=false",
        ],
    )
    trainer = Trainer(config)
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        trainer.train()
    trainer.close()
    lines = [r.getMessage() for r in caplog.records]
    first = next(line for line in lines if line.startswith("run: "))
    assert first.startswith("run: model qwen3 debug (Qwen3Model), ") and "| float32 |" in first
    assert f"data: data.path '{path}' (1 file): 12 examples -> 12 rows of 64, " in first
    assert " an epoch; 6 steps x 4 rows = 2.00 epochs | 6 steps |" in first
    assert lines[-1].startswith("done: 6 steps in ") and lines[-1].endswith(": metrics.jsonl")
