"""The training loop on one process: loss falls, records are complete, accumulation is exact,
and a non-finite loss stops the run with the step number."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import models
from titan_tpu.config import ConfigError, load_config
from titan_tpu.trainer import Trainer, TrainingStopped, split_global_batch, write_resolved_config

RECORD_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib", "step_time_s"}


def small_config(tmp_path: Path, *overrides: str):
    return load_config(
        "llama3_debug",
        [
            f"--job.dump_folder={tmp_path}",
            "--training.seq_len=64",
            "--training.global_batch_size=4",
            "--training.local_batch_size=4",
            *overrides,
        ],
    )


def test_loss_falls_and_every_record_is_complete(tmp_path: Path) -> None:
    trainer = Trainer(small_config(tmp_path, "--training.steps=25", "--metrics.log_freq=5"))
    records = trainer.train()
    trainer.close()
    assert [r.step for r in records] == [1, 5, 10, 15, 20, 25]
    assert records[-1].loss < 0.7 * records[0].loss
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(records)
    for line, record in zip(lines, records):
        data = json.loads(line)
        assert set(data) == RECORD_KEYS
        assert data["loss"] == pytest.approx(record.loss)
        assert data["tokens_per_sec"] > 0 and data["mfu"] > 0 and data["memory_gib"] > 0
    resolved = load_config(str(tmp_path / "config.toml"), [])
    assert resolved.training.steps == 25


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    losses = []
    for local in (4, 1):
        config = small_config(
            tmp_path / str(local), "--training.steps=4", "--metrics.log_freq=1",
            "--training.dtype=float32", f"--training.local_batch_size={local}",
        )
        trainer = Trainer(config)
        assert trainer.grad_accum_steps == 4 // local
        losses.append([r.loss for r in trainer.train()])
        trainer.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_non_finite_loss_stops_with_step_number(tmp_path: Path) -> None:
    trainer = Trainer(small_config(tmp_path, "--training.steps=10", "--metrics.log_freq=1"))
    real_loss = trainer.loss_fn
    calls = {"n": 0}

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = real_loss(output, labels)
        return loss * float("nan") if calls["n"] == 3 else loss

    trainer.loss_fn = loss_fn
    weights_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(TrainingStopped, match=r"step 3: loss is nan"):
        trainer.train()
    trainer.close()
    assert trainer.step == 2  # the bad step never reached the optimizer
    assert any(not torch.equal(weights_before[k], v) for k, v in trainer.model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_tokenizer_larger_than_vocab_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = models.get_model_spec("llama3")
    monkeypatch.setitem(spec.flavors, "debug", dataclasses.replace(spec.flavor("debug"), vocab_size=100))
    with pytest.raises(ConfigError, match=r"data.tokenizer has \d+ tokens but model llama3 debug"):
        Trainer(small_config(tmp_path))


def test_global_batch_is_split_over_ranks_and_micro_batches() -> None:
    assert split_global_batch(8, -1, 2) == (4, 1)
    assert split_global_batch(8, 2, 2) == (2, 2)
    with pytest.raises(ConfigError, match="not divisible by the data-parallel degree 3"):
        split_global_batch(8, -1, 3)
    with pytest.raises(ConfigError, match=r"local_batch_size 4 x data-parallel degree 4 = 16"):
        split_global_batch(8, 4, 4)


def test_an_earlier_runs_config_is_kept_not_overwritten(tmp_path: Path) -> None:
    write_resolved_config(tmp_path, "a")
    write_resolved_config(tmp_path, "a")
    write_resolved_config(tmp_path, "b")
    write_resolved_config(tmp_path, "c")
    assert (tmp_path / "config.toml").read_text() == "c"
    assert (tmp_path / "config.1.toml").read_text() == "a"
    assert (tmp_path / "config.2.toml").read_text() == "b"
