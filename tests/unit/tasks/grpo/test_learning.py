"""The GRPO learning run in miniature (scripts/grpo_arithmetic.py): our pretraining loop on generated
arithmetic text, export to a Hugging Face folder, GRPO from that folder through the one trainer, with
reward and held-out accuracy recorded.

Bugs caught: a pretrained policy that does not reach GRPO (export/import of the initial weights), a
GRPO step record without its reward or accuracy, and an evaluation that disagrees with itself
between the start and steps that changed nothing (lr 1e-12). The full run (1000 + 200 steps, +15 points
or more) is the script's; its numbers are in docs/benchmarks/ (grpo_arithmetic_*.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.cpu_kinds import DECISIONS
from tests.support.paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))

from grpo_arithmetic import grpo, pretrain  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 steps of float32 pretraining (the script's own dtype), exported to a Hugging Face folder."""
    initial = pretrain(tmp_path_factory.mktemp("pretrain"), steps=60, carry_error_rate=0.7, max_operand=99)
    assert (initial / "config.json").exists()
    return initial


@pytest.mark.parametrize("decision", list(DECISIONS))
def test_pretrain_then_grpo_records_reward_and_accuracy(
    pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decision: str
) -> None:
    """GRPO under both CPU decisions (float32 + SDPA, bf16 + blocked attention) from the same policy."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: DECISIONS[decision])
    # lr 1e-12 is below half an ulp of every weight, so the policy stays the pretrained one and the
    # held-out accuracy after the steps must equal the one measured before them.
    result = grpo(
        tmp_path,
        pretrained,
        steps=2,
        max_operand=99,
        extra=["--optimizer.lr=1e-12", "--metrics.log_freq=1", "--rl.eval_prompts=64"],
    )
    records = result["records"]
    assert [r["step"] for r in records] == [1, 2]
    assert 0.0 <= records[0]["reward_mean"] <= 1.1  # exact match 1 + format 0.1 at most
    # The reward is its parts with their weights (exact match 1, format 0.1), over the same rows.
    first = records[0]
    assert first["reward_mean"] == pytest.approx(first["reward/exact"] + 0.1 * first["reward/format"], rel=1e-6)
    # 60 pretraining steps already give the "a+b=c\n" shape (measured: every completion); random
    # weights almost never answer digits then a newline, so this fails when the weights do not arrive.
    assert first["reward/format"] > 0.5
    assert 0.0 <= result["before"] <= 1.0
    assert result["after"] == result["before"]
