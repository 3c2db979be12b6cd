"""GRPO under FSDP on 2 CPU processes, and a MoE policy under EP 2 in FSDP 4 and TP 2 x FSDP 2 on 4
(gloo): the first steps' losses equal one process's.

At the first step of a rollout the ratio is exactly 1, so with equal completion lengths the loss is the
mean advantage, 0 up to rounding, on any layout; the first step is compared by its gradient norm, and
the second step (the rollout's second mini-batch, after one update, ratio != 1) by its loss.

Rows are sampled with per-row random streams and rewards are shared between ranks before the group
advantages, so every layout trains the same first mini-batch; tensor-parallel ranks of one group
sample the same tokens from replicated logits (a rank that sampled differently would hang or change
the rewards). This file is also the worker that
torchrun starts. From random weights the arithmetic reward is always 0 (so every loss would be 0); the
run uses a test reward that depends on the sampled tokens, through `rl.rewards`
(tests/support/token_sum_reward.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.token_sum_reward import REWARDS

ROOT = REPO
OVERRIDES = [
    "--training.steps=2",
    "--training.global_batch_size=16",
    "--rl.prompts_per_step=8",
    "--rl.group_size=4",
    "--rl.max_new_tokens=4",
    "--rl.max_operand=9",
    "--metrics.eval_freq=0",
    "--rl.beta=0.04",
    "--model.overrides={ n_layers = 2 }",
    "--metrics.log_freq=1",
    "--optimizer.lr=1e-2",
    REWARDS,
]


TP_2_FSDP_2 = ["--parallelism.tp=2", "--parallelism.sequence_parallel=false"]
EP_2_FSDP_4 = ["--parallelism.ep=2"]
# Held-out decoding at the last step, 3 prompts: under EP 2 in FSDP 4 the fourth rank has none of its own.
MOE = ["--model.name=qwen3_moe", "--model.flavor=debug_moe", "--metrics.eval_freq=2", "--rl.eval_prompts=3"]


def worker(out: Path, decision: str, *layout: str) -> None:
    import torch.distributed as dist

    from tests.support.cpu_kinds import pretend_cpu
    from titan_tpu.config.loader import load_config
    from titan_tpu.training.trainer import Trainer

    pretend_cpu(decision)
    config = load_config("grpo_qwen3_debug", [*OVERRIDES, f"--job.dump_folder={out / 'run'}", *layout])
    trainer = Trainer(config)
    records = trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        (out / "result.json").write_text(json.dumps([r.to_dict() for r in records]))
    trainer.close()


def _run(tmp_path: Path, nproc: int, decision: str, *layout: str) -> list[dict]:
    from tests.support.launch import torchrun

    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}-{decision}-p{nproc}"
    out.mkdir()
    torchrun(nproc, Path(__file__), str(out), decision, *layout)
    return json.loads((out / "result.json").read_text())


def _assert_layouts_match_one_process(tmp_path: Path, model: list[str], layouts: list[tuple[int, list[str]]]) -> dict:
    """The checks of every layout against one process; returns the one process's second record."""
    one, one_next = _run(tmp_path, 1, "fp32", *model)
    assert one["reward_std"] > 0, "the test reward must vary within groups, or nothing is learned"
    assert one["grad_norm"] > 1e-3
    assert abs(one_next["loss"]) > 1e-5
    for nproc, layout in layouts:
        first, second = _run(tmp_path, nproc, "fp32", *model, *layout)
        print(
            f"{nproc} processes {layout}: rollout tokens/s {first['rollout_tokens_per_sec']:.1f} "
            f"(1 process {one['rollout_tokens_per_sec']:.1f})"
        )
        assert first["reward_mean"] == pytest.approx(one["reward_mean"], rel=1e-12)  # the same completions
        assert first["completion_length"] == pytest.approx(one["completion_length"], rel=1e-12)
        assert first["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert second["loss"] == pytest.approx(one_next["loss"], rel=1e-4)
        assert second.get("heldout_accuracy") == one_next.get("heldout_accuracy")  # greedy: the same answers
    return one_next


@pytest.mark.slow
def test_fsdp_first_step_loss_matches_one_process(tmp_path: Path) -> None:
    """In float32 (the decision of CPUs without native bf16, pretended on every CPU), FSDP 2 against
    one process (tensor parallelism: the MoE test below, whose attention and head are dense)."""
    _assert_layouts_match_one_process(tmp_path, [], [(2, [])])


@pytest.mark.slow
def test_moe_expert_and_tensor_parallel_match_one_process(tmp_path: Path) -> None:
    """A Qwen 3 MoE policy, EP 2 in FSDP 4 and TP 2 x FSDP 2 against one process. Under EP the ranks of
    an ep group sample other prompts yet exchange tokens in every MoE layer, so they decode in
    lockstep (sampler.generate; its semantics: test_grpo_sampler.py): a rank that stopped decoding on
    its own, or one without a held-out prompt that skipped the evaluation's decoding, would leave the
    others waiting in an all-to-all (a hang, reported by the launcher's timeout)."""
    one_next = _assert_layouts_match_one_process(tmp_path, MOE, [(4, EP_2_FSDP_4), (4, TP_2_FSDP_2)])
    assert "heldout_accuracy" in one_next  # else the held-out comparison above compared two absences


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_matches_one_process_within_bf16(tmp_path: Path) -> None:
    """In bf16 with the blocked kernel (the decision of CPUs with native bf16, pretended on every CPU):
    FSDP's mixed precision (bf16 parameters, float32 reduction) against one process's autocast, which
    keeps float32 weights and residual stream, so they agree only to bf16 rounding. Measured here: the
    first step's grad norm 15.97 vs 15.60 (2.3% apart). At the rollout's first step the ratio is 1 and
    the policy equals the reference, so nothing is clipped and the KL is 0 on both layouts: the rollout
    log-probabilities come from the precision that trains."""
    one, two = (_run(tmp_path, nproc, "bf16")[0] for nproc in (1, 2))
    for first in (one, two):
        assert first["clip_fraction"] == 0 and first["kl"] == 0
        assert math.isfinite(first["loss"]) and first["grad_norm"] > 1e-3
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=0.1)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
