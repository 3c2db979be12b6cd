"""A pretraining run's first and last lines, from the trainer: what it trains (model, parameters,
layout, dtype, data, steps, outputs), `step N/T` with the time left between, and the totals."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.support.cpu_kinds import DECISIONS
from titan_tpu.config import load_config
from titan_tpu.metrics.console import count
from titan_tpu.training.trainer import Trainer


@pytest.mark.parametrize(("decision", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_a_pretraining_run_says_what_it_trains_and_what_it_did(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, decision: str, dtype: str
) -> None:
    """Catches a parameter count of one shard or of a model other than the one trained, a dtype that
    is not the run's, a token budget from the local rather than the global batch, totals that miss a
    record's window, and a last line without its outputs."""
    # dtype = "auto" follows the CPU: the line must name the dtype the run computes in on either kind.
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: DECISIONS[decision])
    overrides = ["--training.seq_len=64", "--training.global_batch_size=4", "--training.local_batch_size=2"]
    config = load_config(
        "llama3_debug", [f"--job.dump_folder={tmp_path}", "--training.steps=4", "--metrics.log_freq=2", *overrides]
    )
    trainer = Trainer(config)
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        records = trainer.train()
    trainer.close()
    lines = [r.getMessage() for r in caplog.records]
    first = next(line for line in lines if line.startswith("run: "))
    parameters = sum(p.numel() for p in trainer.model.parameters())
    assert first.startswith(f"run: model llama3 debug (Llama3Model), {count(parameters)} parameters | ")
    assert trainer.resolved.compute_dtype == dtype
    assert f"| 1 process (dp_replicate 1 x dp_shard 1 x tp 1) | {dtype} |" in first
    assert "data: the embedded corpus (Python standard library at " in first
    # 4 rows of 64 tokens a step (2 micro-batches of 2), 4 steps.
    assert "byte tokenizer; 4 rows x 64 tokens a step, 1,024 tokens in all | 4 steps |" in first
    assert first.endswith(f"| outputs in {tmp_path}")

    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1/4", "step 2/4", "step 4/4"]
    assert "eta" not in steps[0] and "eta" in steps[1] and "eta" not in steps[2]

    last = lines[-1]
    assert last.startswith("done: 4 steps in ") and "| 1,024 tokens, " in last
    assert f"| final loss {records[-1].loss:.4f} |" in last
    assert last.endswith(f"| outputs in {tmp_path}: metrics.jsonl, loss.png")
