"""GRPO's console: a step line that fits a terminal, the note that explains a loss of exactly 0 (every
group of the step tied), the tied share in metrics.jsonl, and a sampled completion at evaluations."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.metrics.console import ConsoleView
from titan_tpu.metrics.logger import StepRecord
from titan_tpu.tasks.grpo.step_lines import console_view, mini_batch_ties, tied_groups
from titan_tpu.training.trainer import Trainer

# The values one GRPO record carries (a run with a KL penalty, two rewards, an evaluation).
EXTRAS = {
    "kl": 0.00123,
    "clip_fraction": 0.01,
    "train_tokens_per_sec": 52.6,
    "reward_mean": 0.4123,
    "reward_std": 0.31,
    "tied_groups": 0.25,
    "completion_length": 5.95,
    "rollout_tokens_per_sec": 239.1,
    "rollout_tflops": 0.0015,
    "rollout_mfu": 1.51,
    "reward/exact": 0.38,
    "reward/format": 0.95,
    "rollout/staleness": 0.0,
    "rollout/sample_seconds": 3.16,
    "heldout_accuracy": 0.4375,
}


def _record(loss: float, view_beta: float) -> StepRecord:
    return StepRecord(
        step=1234,
        loss=loss,
        grad_norm=0.5,
        lr=3e-5,
        unit="tokens",
        items_per_sec=123456.7,
        tflops=12.3,
        mfu=45.6,
        memory_gib=70.1,
        step_time_s=12.345,
        extras=dict(EXTRAS),
        total_steps=10000,
        eta_s=123456.0,
        console=console_view(loss, view_beta, (3, 8)),
    )


def test_the_line_fits_a_terminal_with_the_values_that_matter() -> None:
    """Negative control: the same record on the full line (every value) is three times too wide."""
    line = _record(-0.0123, view_beta=0.04).console_line()
    assert len(line) <= 160, line
    for part in ("step  1234/10000", "loss  -0.0123", "reward 0.4123", "held-out acc 0.4375", "kl 0.00123"):
        assert part in line
    assert "tok/s  123456.7" in line and "12.345 s/step" in line and "eta 1d10h" in line
    assert "kl" not in _record(-0.0123, view_beta=0.0).console_line()  # no penalty: KL is 0, not shown
    full = dataclasses.replace(_record(-0.0123, view_beta=0.0), console=ConsoleView())
    assert len(full.console_line()) > 400


def test_tied_groups_per_mini_batch() -> None:
    """Groups of 4: tied, not, tied. Mini-batches of 6 rows hold rows of two groups each; of 4 rows,
    one group each (a group split between mini-batches counts in both)."""
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1, 2, 2, 2, 2], dtype=torch.float64)
    tied = tied_groups(rewards, 4)
    assert tied.tolist() == [True, False, True]
    assert mini_batch_ties(tied, 12, 6, 4) == [(1, 2), (1, 2)]
    assert mini_batch_ties(tied, 12, 4, 4) == [(1, 1), (0, 1), (1, 1)]


def test_the_note_explains_a_zero_loss_only_when_every_group_tied() -> None:
    assert console_view(0.0, 0.0, (8, 8)).note == (
        "all 8 groups tied (every completion of each group got the same reward, so every advantage is 0): "
        "no learning signal this step"
    )
    assert console_view(0.0, 0.0, (7, 8)).note is None  # a 0 that ties do not explain is not explained away
    assert console_view(0.01, 0.04, (8, 8)).note is None  # the KL penalty still trains


SMALL = [
    "--model.overrides={ n_layers = 1 }",
    "--training.dtype=float32",
    "--rl.max_new_tokens=4",
    "--rl.max_operand=9",
    "--rl.prompts_per_step=2",
    "--rl.group_size=4",
    "--training.global_batch_size=8",  # one optimizer step per rollout, both groups in it
    "--rl.eval_prompts=4",
    "--training.steps=2",
    "--metrics.log_freq=1",
    "--metrics.eval_freq=2",
    "--metrics.plot_loss=false",
]


def _run(tmp_path: Path, rewards: str, caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[dict]]:
    config = load_config("grpo_qwen3_debug", [f"--job.dump_folder={tmp_path}", *SMALL, rewards])
    trainer = Trainer(config)
    try:
        with caplog.at_level(logging.INFO, logger="titan_tpu"):
            trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r.getMessage() for r in caplog.records], records


def test_a_run_whose_groups_all_tie_says_so_and_shows_a_sample(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every completion matches '.*' and gets reward 1: both groups tie, every advantage and the loss
    are exactly 0, and the line under each step says why. Negative control: the token-sum reward
    varies within groups, its loss is not 0 and no note appears."""
    lines, records = _run(tmp_path / "tied", "--rl.rewards=[{ fn = \"format\", pattern = '.*' }]", caplog)
    assert [r["loss"] for r in records] == [0.0, 0.0] and records[0]["tied_groups"] == 1.0
    # Synchronous: each rollout is sampled by the weights of its own step (the tie bookkeeping once
    # reused the rollout's index variable, and the second rollout logged a staleness of -1).
    assert [r["rollout/staleness"] for r in records] == [0.0, 0.0]
    notes = [line for line in lines if "groups tied" in line]
    assert notes == [
        f"step {s}: all 2 groups tied (every completion of each group got the same reward, so every "
        "advantage is 0): no learning signal this step"
        for s in (1, 2)
    ]
    assert all(len(line) <= 160 for line in lines if line.startswith("step ") and " | " in line)
    sample = lines.index("step 2: a completion of the latest rollout (reward 1):")
    assert lines[sample + 1].startswith("  prompt:     '") and lines[sample + 2].startswith("  completion: '")
    assert lines[sample + 3].startswith("  reference:  '")

    caplog.clear()
    lines, records = _run(tmp_path / "varied", REWARDS, caplog)
    assert all(r["loss"] != 0.0 for r in records) and records[0]["tied_groups"] < 1.0
    assert not any("tied" in line for line in lines)
