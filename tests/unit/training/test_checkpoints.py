"""The trainer with checkpoints on one process: exact resume (bitwise), resuming by itself from the dump
folder, and the seed checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.trained_losses import trained_losses
from titan_tpu.checkpoint import layout
from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

BASE = [
    "--training.seq_len=64",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--training.deterministic=true",
    "--metrics.log_freq=1",
    "--checkpoint.enable=true",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why


def make_trainer(dump: Path, *overrides: str) -> Trainer:
    return Trainer(load_config("llama3_debug", [f"--job.dump_folder={dump}", *BASE, *overrides]))


def train(dump: Path, *overrides: str) -> tuple[int, dict[int, float]]:
    return trained_losses(make_trainer(dump, *overrides))


def test_resume_is_bitwise_exact_and_automatic(tmp_path: Path) -> None:
    # The uninterrupted run saves step 10 and 20 in the background (async).
    start, straight = train(
        tmp_path / "a", "--training.steps=20", "--checkpoint.interval=10", "--checkpoint.async_mode=async"
    )
    assert start == 0 and sorted(straight) == list(range(1, 21))
    assert layout.complete_steps(tmp_path / "a" / "checkpoint") == [10, 20]
    # "Stopped after step 10": a fresh dump folder holding only what that run had saved by then.
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-10", tmp_path / "b" / "checkpoint" / "step-10")
    start, resumed = train(tmp_path / "b", "--training.steps=20", "--checkpoint.interval=10")
    assert start == 10 and sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        assert resumed[step] == straight[step], f"step {step}: {resumed[step]!r} != {straight[step]!r}"
    # A restart with the same dump folder finds step 20 by itself: nothing left to train.
    trainer = make_trainer(tmp_path / "a", "--training.steps=20")
    assert trainer.step == 20
    trainer.close()


def test_seed_checkpoint_gives_every_run_the_same_start(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    seeder = make_trainer(dump, "--checkpoint.enable=false", "--checkpoint.create_seed_checkpoint=true")
    seed_weights = {k: v.clone() for k, v in seeder.model.state_dict().items()}
    assert seeder.train() == []
    seeder.close()
    root = dump / "checkpoint"
    assert layout.complete_steps(root) == [0]
    assert layout.read_manifest(root / "step-0")["components"] == ["model"]
    # Another training seed would initialise other weights; the seed checkpoint wins.
    trainer = make_trainer(dump, "--training.seed=7", "--training.steps=1")
    try:
        assert trainer.step == 0
        for key, value in trainer.model.state_dict().items():
            assert torch.equal(value, seed_weights[key]), key
    finally:
        trainer.close()


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    """A byte flipped in the newest checkpoint's largest file: the restart (checkpoint.on_damage at its
    default, fallback) moves that folder aside untouched, resumes from the checkpoint before it, and
    every later loss equals the uninterrupted run's bit for bit. Catches a damaged checkpoint loaded,
    deleted or altered, a fallback that skips past the previous one, and a resume that is not exact."""
    start, straight = train(tmp_path / "a", "--training.steps=6", "--checkpoint.interval=2")
    assert start == 0 and layout.complete_steps(tmp_path / "a" / "checkpoint") == [2, 4, 6]
    # "Stopped after step 4", whose save was then damaged on disk.
    root = tmp_path / "b" / "checkpoint"
    root.mkdir(parents=True)
    for step in (2, 4):
        shutil.copytree(tmp_path / "a" / "checkpoint" / f"step-{step}", root / f"step-{step}")
    largest = max((p for p in (root / "step-4").iterdir() if p.name != layout.MANIFEST), key=lambda p: p.stat().st_size)
    raw = bytearray(largest.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    largest.write_bytes(bytes(raw))
    start, resumed = train(tmp_path / "b", "--training.steps=6", "--checkpoint.interval=2")
    assert start == 2 and sorted(resumed) == [3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert resumed[step] == straight[step], f"step {step}: {resumed[step]!r} != {straight[step]!r}"
    aside = root / "step-4.damaged-corrupted"
    assert (aside / largest.name).read_bytes() == bytes(raw)
    assert largest.name in (aside / layout.DAMAGE_NOTE).read_text()
    # The resumed run saved its own step 4 and 6 beside the damaged folder; retention left it alone.
    assert layout.complete_steps(root) == [2, 4, 6]
