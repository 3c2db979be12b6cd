"""The metrics sinks: JSON lines always, TensorBoard and Weights & Biases (offline) when enabled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.config.sections import MetricsConfig
from titan_tpu.metrics.logger import MetricsLogger, StepRecord


def record(step: int, unit: str = "tokens", extras: dict[str, float] | None = None) -> StepRecord:
    return StepRecord(
        step=step,
        loss=2.5,
        grad_norm=1.0,
        lr=1e-3,
        unit=unit,
        items_per_sec=100.0,
        tflops=0.1,
        mfu=None,
        memory_gib=0.5,
        step_time_s=0.2,
        extras=extras or {},
    )


def test_the_throughput_is_named_after_the_tasks_unit_and_extras_join_the_record(tmp_path: Path) -> None:
    """A FLUX record says samples_per_sec and a GRPO record carries its reward (bug caught: every
    task's throughput written as tokens_per_sec, or the task's own values dropped)."""
    sink = MetricsLogger(MetricsConfig(), tmp_path, is_writer=True, run_config={})
    sink.log(record(1, unit="samples"))
    sink.log(record(2, extras={"reward_mean": 0.25}))
    sink.close()
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["samples_per_sec"] == 100.0 and "tokens_per_sec" not in first
    assert second["tokens_per_sec"] == 100.0 and second["reward_mean"] == 0.25
    assert "reward_mean 0.25" in record(2, extras={"reward_mean": 0.25}).console_line()


def test_only_the_writer_writes(tmp_path: Path) -> None:
    silent = MetricsLogger(MetricsConfig(), tmp_path, is_writer=False, run_config={})
    silent.log(record(1))
    silent.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_and_offline_wandb_receive_each_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = MetricsConfig(enable_tensorboard=True, enable_wandb=True, wandb_project="unit")
    sink = MetricsLogger(cfg, tmp_path, is_writer=True, run_config={"training": {"steps": 2}})
    assert sink._wandb_run is not None and sink._wandb_run.settings.mode == "offline"
    sink.log(record(1))
    sink.log(record(2))
    sink.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and lines[0]["mfu"] is None

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [s.step for s in events.Scalars("loss")] == [1, 2]
    assert "mfu" not in events.Tags()["scalars"]  # an unknown MFU is left out, not logged as 0

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
