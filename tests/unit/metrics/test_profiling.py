"""`[profiling]`: a Chrome trace of the chosen steps of a real run, with each step annotated.

Bugs caught: a trace that is not written or not valid JSON; steps traced one off (the window's ends
are checked on both sides); a trace without the model's ops; a run that ends inside its window and
loses the trace; `memory` that records nothing; a start step the run never reaches accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

# SDPA forced: no kernel measurement, and the attention op has one known name.
SMALL = ["--model.attention_block=0", "--training.seq_len=64", "--metrics.plot_loss=false"]


def _train(tmp_path: Path, *overrides: str) -> Path:
    config = load_config("llama3_debug", [f"--job.dump_folder={tmp_path}", *SMALL, *overrides])
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    return tmp_path / "profile_traces"


def _event_names(trace: Path) -> set[str]:
    return {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}


def test_steps_3_and_4_of_llama3_debug_are_traced_with_their_ops(tmp_path: Path) -> None:
    folder = _train(tmp_path, "--training.steps=5", "--profiling.enable=true")
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_steps3-4.json"]
    names = _event_names(folder / "rank0_steps3-4.json")
    steps = {name for name in names if name.startswith("train_step ")}
    assert steps == {"train_step 3", "train_step 4"}
    assert any("scaled_dot_product" in name for name in names), "attention"
    assert names & {"aten::mm", "aten::addmm"}, "matmuls"
    assert "aten::_fused_adamw_" in names or any("adamw" in name.lower() for name in names), "optimizer step"


def test_a_run_ending_inside_the_window_keeps_its_trace_and_memory_adds_allocations(tmp_path: Path) -> None:
    folder = _train(
        tmp_path,
        "--training.steps=2",
        "--profiling.enable=true",
        "--profiling.start_step=2",
        "--profiling.active_steps=5",
        "--profiling.memory=true",
    )
    names = _event_names(folder / "rank0_steps2-2.json")
    assert {name for name in names if name.startswith("train_step ")} == {"train_step 2"}
    assert "[memory]" in names


def test_profiling_off_writes_nothing(tmp_path: Path) -> None:
    assert not _train(tmp_path, "--training.steps=2").exists()


def test_a_start_step_after_the_last_step_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"profiling.start_step: 7 is after the run's last step \(training.steps = 5\)"
    ):
        load_config("llama3_debug", ["--training.steps=5", "--profiling.enable=true", "--profiling.start_step=7"])


def test_the_tpu_trace_options_are_built_by_torch_tpus_public_class(tmp_path: Path) -> None:
    """torch_tpu checks its options when built (worker_rank must be a string, run_dir a path), so a
    wrong argument fails here rather than on the first TPU run."""
    import torch

    from titan_tpu.device.tracing import profiler_activities, profiler_options

    options = profiler_options("tpu", tmp_path, rank=3)
    assert isinstance(options, torch.profiler._ExperimentalConfig)
    assert type(options).__name__ == "TpuProfilerConfig"
    assert profiler_options("cpu", tmp_path, rank=0) is None
    assert torch.profiler.ProfilerActivity.PrivateUse1 in profiler_activities("tpu")
