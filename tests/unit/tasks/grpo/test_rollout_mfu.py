"""A GRPO run's rollout FLOPs, rollout_tflops and rollout_mfu: the task charges what its rollout
computes (FlopCounterMode on the real rollout), the record carries the rollout's MFU against the
trainer's peak beside the training MFU, and none when that peak is unknown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import titan_tpu.training.trainer as trainer_module
from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.tasks.grpo.rollout_flops import ForwardCost, rollout_flops
from titan_tpu.training.trainer import Trainer

# One layer, plain SDPA (what the counter sees through the math backend), float32.
SMALL = [
    "--model.overrides={ n_layers = 1 }",
    "--model.attention_block=0",
    "--training.dtype=float32",
    "--rl.max_new_tokens=4",
    "--rl.max_operand=9",
    "--metrics.eval_freq=0",
    REWARDS,
]


def grpo_trainer(tmp_path: Path, *overrides: str) -> Trainer:
    return Trainer(load_config("grpo_qwen3_debug", [f"--job.dump_folder={tmp_path / 'run'}", *SMALL, *overrides]))


def test_the_rollout_is_charged_what_it_computes(tmp_path: Path) -> None:
    """One prompt x 4 completions that never stop, so nothing in the rollout is padding, in two
    mini-batches of 2: the task's count equals the counter's on sampling (one prefill of the shared
    prompt) and the reference's log-prob pass (the policy's log-probs come from the sampling,
    tests/unit/tasks/grpo/test_old_logps.py). Catches a pass left out (the reference's: a negative
    control) or charged where none runs (the policy's: the other), a prefill charged per row (the
    third), a row's prompt or completion length miscounted, and a rollout_tflops not made of that
    count over the rollout's time."""
    trainer = grpo_trainer(
        tmp_path, "--rl.prompts_per_step=1", "--rl.group_size=4", "--training.global_batch_size=2", "--rl.beta=0.04"
    )
    try:
        task = trainer.task
        task.params = dataclasses.replace(task.params, stop_ids=())  # every row runs to max_new_tokens
        counter = FlopCounterMode(display=False)
        with sdpa_kernel(SDPBackend.MATH), counter:
            batch = task.next_batch(trainer.model)
        charged, seconds = task._stats["rollout_flops"], task._stats["rollout_time"]
        metrics = task.step_metrics()
    finally:
        trainer.close()
    counted = counter.get_total_flops()
    prompt_len = int(batch.tokens.shape[1]) - 4
    print(f"charged {charged:.4e}, counted {counted:.4e}, ratio {charged / counted:.5f}")
    # Within the RMSNorm weights the convention counts and the counter does not (tests/unit/tasks/grpo/test_rollout_flops.py).
    assert charged == pytest.approx(counted, rel=0.002)
    cost = ForwardCost.of_family(task.ctx.spec.flops_per_token, task.args)
    group = [(prompt_len, [4] * 4)]
    without_reference = rollout_flops(cost, group, scoring_passes=0)
    with_a_policy_pass = rollout_flops(cost, group, scoring_passes=2)
    a_prefill_per_row = rollout_flops(cost, [(prompt_len, [4])] * 4, scoring_passes=1)
    for wrong in (without_reference, with_a_policy_pass, a_prefill_per_row):
        assert wrong != pytest.approx(counted, rel=0.002)
    assert metrics["rollout_tflops"] == pytest.approx(charged / seconds / 1e12)


@pytest.mark.parametrize("peak_known", [True, False], ids=["peak", "no_peak"])
def test_the_record_carries_the_rollout_mfu_beside_the_training_mfu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peak_known: bool
) -> None:
    """rollout_mfu is rollout_tflops over the trainer's own peak, a share of it (0 < mfu <= 100), and
    absent where the trainer has no peak (its mfu is None there). Catches an MFU against another peak
    or scale, one above 100% (wrong accounting), and a number written where no peak is known."""
    if not peak_known:
        monkeypatch.setattr(trainer_module, "host_peak_flops", lambda device, dtype: None)
    trainer = grpo_trainer(
        tmp_path,
        "--training.steps=2",
        "--rl.prompts_per_step=2",
        "--rl.group_size=4",
        "--training.global_batch_size=8",
        "--metrics.log_freq=1",
    )
    try:
        records = [r.to_dict() for r in trainer.train()]
        peak = trainer.peak_flops
    finally:
        trainer.close()
    for record in records:
        assert record["rollout_tflops"] > 0
        if peak_known:
            assert record["rollout_mfu"] == pytest.approx(100 * record["rollout_tflops"] * 1e12 / peak)
            assert 0 < record["rollout_mfu"] <= 100 and record["mfu"] is not None
        else:
            assert "rollout_mfu" not in record and record["mfu"] is None


def test_a_low_peak_is_measured_again_when_the_rollout_beats_it(tmp_path: Path) -> None:
    """A start-up CPU probe taken on a busy host reads low; when only the rollout's rate beats it (the
    training rate is held far below here), the peak is measured again, so rollout_mfu stays a share.
    Catches a trainer that checks its peak against the training rate alone (thousands of percent)."""
    trainer = grpo_trainer(
        tmp_path,
        "--training.steps=1",
        "--rl.prompts_per_step=2",
        "--rl.group_size=4",
        "--training.global_batch_size=8",
        "--metrics.log_freq=1",
    )
    trainer.peak_flops = 1e6  # what a probe starved of CPU could read
    trainer.flops_per_item = 1e-6  # the training window's FLOP/s stay below that peak
    try:
        (record,) = [r.to_dict() for r in trainer.train()]
    finally:
        trainer.close()
    assert trainer.peak_flops > 1e6
    assert 0 < record["mfu"] < record["rollout_mfu"] <= 100
