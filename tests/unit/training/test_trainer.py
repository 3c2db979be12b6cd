"""The training loop on one process: loss falls, records are complete, accumulation is exact, a
non-finite loss stops the run with the step number, the host reads the device only on logging and
checkpoint steps, and the loaded config is only read while the run's decisions go to config.toml."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import tomllib
import torch

from titan_tpu.config import ConfigError, ResolvedConfig, TrainConfig, load_config, write_resolved_config
from titan_tpu.config.batch import split_global_batch
from titan_tpu.models.registry import get_model_spec
from titan_tpu.training.trainer import Trainer, TrainingStopped

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
        # Per-process throughput of a single process is its items over the window's time.
        expected = 4 * 64 / record.step_time_s
        assert data["tokens_per_sec"] == pytest.approx(expected, rel=1e-6)
        assert data["tflops"] == pytest.approx(expected * trainer.flops_per_item / 1e12, rel=1e-6)
        # The peak is the best of the dtypes this run computes in, so MFU cannot pass 100%.
        assert 0 < data["mfu"] <= 100
    resolved = load_config(str(tmp_path / "config.toml"), [])
    assert resolved.training.steps == 25


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    losses = []
    for local in (4, 1):
        config = small_config(
            tmp_path / str(local),
            "--training.steps=4",
            "--metrics.log_freq=1",
            "--training.dtype=float32",
            f"--training.local_batch_size={local}",
        )
        trainer = Trainer(config)
        assert trainer.grad_accum_steps == 4 // local
        losses.append([r.loss for r in trainer.train()])
        trainer.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def poison_loss(trainer: Trainer, at_call: int) -> None:
    """Make the task's loss nan at its `at_call`-th micro-batch."""
    real_loss = trainer.task.loss_fn
    calls = {"n": 0}

    def loss_fn(output: torch.Tensor, labels: torch.Tensor, chunk_elements: int) -> torch.Tensor:
        calls["n"] += 1
        loss = real_loss(output, labels, chunk_elements)
        return loss * float("nan") if calls["n"] == at_call else loss

    trainer.task.loss_fn = loss_fn


def test_non_finite_loss_on_a_logging_step_never_reaches_the_weights(tmp_path: Path) -> None:
    trainer = Trainer(small_config(tmp_path, "--training.steps=10", "--metrics.log_freq=1"))
    poison_loss(trainer, at_call=3)
    weights_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(TrainingStopped, match=r"step 3: loss is nan"):
        trainer.train()
    trainer.close()
    assert trainer.step == 2  # the bad step never reached the optimizer
    assert any(not torch.equal(weights_before[k], v) for k, v in trainer.model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_non_finite_loss_between_logs_is_caught_before_the_next_checkpoint(tmp_path: Path) -> None:
    """Step 3 is poisoned; nothing reads the loss until step 4, which saves a checkpoint: the run
    must stop there, naming step 3, and write no checkpoint of the poisoned weights."""
    trainer = Trainer(
        small_config(
            tmp_path,
            "--training.steps=10",
            "--metrics.log_freq=10",
            "--checkpoint.enable=true",
            "--checkpoint.interval=2",
        )
    )
    poison_loss(trainer, at_call=3)
    with pytest.raises(TrainingStopped, match=r"step 3: loss is nan"):
        trainer.train()
    trainer.close()
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == ["step-2"]


def test_device_values_are_read_only_on_logging_and_checkpoint_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss check and the record are the only host reads; they run on steps 1, 4 (log), 6
    (checkpoint), 8 (log) and 9 (last), not on every step."""
    trainer = Trainer(
        small_config(
            tmp_path,
            "--training.steps=9",
            "--metrics.log_freq=4",
            "--checkpoint.enable=true",
            "--checkpoint.interval=6",
        )
    )
    checked: list[int] = []
    real_read = trainer._read_losses

    def counting_read(losses: list[torch.Tensor], first_step: int) -> list[float]:
        checked.append(first_step + len(losses) - 1)
        return real_read(losses, first_step)

    monkeypatch.setattr(trainer, "_read_losses", counting_read)
    records = trainer.train()
    trainer.close()
    assert checked == [1, 4, 6, 8, 9]
    assert [r.step for r in records] == [1, 4, 8, 9]


def test_tokenizer_larger_than_vocab_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_model_spec("llama3")
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
    """A rerun with the same config leaves one file; a changed one keeps the earlier as config.N.toml."""
    runs = {}
    for description in ("a", "b", "c"):
        config = TrainConfig()
        config.job.description = description
        runs[description] = ResolvedConfig(config, "float32", {}, "language_model")
    for description in ("a", "a", "b", "c"):
        write_resolved_config(tmp_path, runs[description])
    assert (tmp_path / "config.toml").read_text() == runs["c"].to_toml()
    assert (tmp_path / "config.1.toml").read_text() == runs["a"].to_toml()
    assert (tmp_path / "config.2.toml").read_text() == runs["b"].to_toml()
    assert not (tmp_path / "config.3.toml").exists()


def test_the_loaded_config_is_never_written_and_config_toml_shows_the_run(tmp_path: Path) -> None:
    """Building and running a Trainer leaves the loaded config as it was (the bugs: the trainer wrote
    the resolved dtype into training.dtype, the loader stored the checked overrides into
    model.overrides), while dump_folder/config.toml comes from the resolved record: the dtype, the
    task and the overrides as the run used them, and it loads back into that same record's config."""
    config = small_config(tmp_path, "--training.steps=2", "--model.overrides.norm_eps=1")
    loaded = copy.deepcopy(config)
    trainer = Trainer(config)
    trainer.train()
    trainer.close()
    assert config == loaded
    assert (config.training.dtype, config.training.task) == ("auto", "auto")
    assert type(config.model.overrides["norm_eps"]) is int
    written = tomllib.loads((tmp_path / "config.toml").read_text())
    assert written["training"]["dtype"] == str(trainer.compute_dtype).removeprefix("torch.")
    assert written["training"]["task"] == "language_model"
    assert written["model"]["overrides"] == {"norm_eps": 1.0}
    assert type(written["model"]["overrides"]["norm_eps"]) is float
    assert load_config(str(tmp_path / "config.toml"), []) == trainer.resolved.effective()


def test_a_probe_taken_on_a_busy_host_is_measured_again(tmp_path: Path) -> None:
    """A start-up CPU probe that ran while other processes held the cores reads low; the first
    window that beats it triggers a new probe, so no record claims more than 100% MFU (the bug: MFU
    of 300-460% from a deflated probe)."""
    trainer = Trainer(small_config(tmp_path, "--training.steps=3", "--metrics.log_freq=1"))
    trainer.peak_flops = 1e6  # what a probe starved of CPU could read
    records = trainer.train()
    trainer.close()
    assert trainer.peak_flops > 1e6
    assert all(r.mfu is not None and 0 < r.mfu <= 100 for r in records)
    last = records[-1]
    assert last.mfu == pytest.approx(100 * last.tflops * 1e12 / trainer.peak_flops)
