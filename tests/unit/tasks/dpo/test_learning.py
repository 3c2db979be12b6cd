"""Preference training learns: a tiny Qwen 3 (2 layers of width 64, from random weights, no SFT) trained
with DPO on the generated sums ranks the right answer above the wrong one on held-out questions it
never saw, and does not when the training preferences are random (the negative control: the same
pairs with chosen and rejected swapped at random, so nothing about sums can be learned from them).

Bugs caught: a loss whose sign, pairing or reference makes it learn nothing or the opposite (held-out
accuracy at or below chance), a held-out accuracy that rises whatever the preferences say (an
artifact of lengths or of the evaluation, not learning)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.support.launch import fixed_kernels
from tests.support.one_thread import one_intra_op_thread
from titan_tpu.config import load_config
from titan_tpu.data.preference_generated import GeneratedPreferences
from titan_tpu.training.trainer import Trainer

pytestmark = pytest.mark.slow
TINY = "{ n_layers = 2, dim = 64, n_heads = 4, n_kv_heads = 2, head_dim = 16, ffn_hidden_dim = 192 }"
STEPS = 40
HELD_OUT_PAIRS = 256


def _write(path: Path, split: str, count: int, swap_share: float) -> Path:
    rng = random.Random(0)
    with path.open("w") as handle:
        for index in range(count):
            record = GeneratedPreferences(0, split, count).record(index)  # type: ignore[arg-type]
            if rng.random() < swap_share:
                record["chosen"], record["rejected"] = record["rejected"], record["chosen"]
            handle.write(json.dumps(record) + "\n")
    return path


def _held_out_accuracy(tmp_path: Path, swap_share: float) -> float:
    tmp_path.mkdir()
    overrides = [
        *fixed_kernels("dpo_qwen3_debug"),
        f"--model.overrides={TINY}",
        "--training.dtype=float32",
        f"--training.steps={STEPS}",
        "--optimizer.lr=3e-3",
        f"--metrics.eval_freq={STEPS}",
        f"--validation.batches={HELD_OUT_PAIRS // 16}",
        f"--job.dump_folder={tmp_path / 'run'}",
        "--dpo.dataset=data",
        "--data.source=files",
        f"--data.path={_write(tmp_path / 'train.jsonl', 'train', 1024, swap_share)}",
        "--validation.source=files",
        f"--validation.path={_write(tmp_path / 'held_out.jsonl', 'held_out', HELD_OUT_PAIRS, 0.0)}",
    ]
    with one_intra_op_thread():
        trainer = Trainer(load_config("dpo_qwen3_debug", overrides))
        records = trainer.train()
        trainer.close()
    return records[-1].extras["heldout_reward_accuracy"]


def test_dpo_learns_to_prefer_the_right_sum_on_unseen_questions(tmp_path: Path) -> None:
    learned = _held_out_accuracy(tmp_path / "preferences", swap_share=0.0)
    chance = _held_out_accuracy(tmp_path / "random", swap_share=0.5)
    # Measured: 0.86 after 40 steps, 0.51 with random preferences.
    assert learned > 0.75, learned
    assert abs(chance - 0.5) < 0.12, chance
