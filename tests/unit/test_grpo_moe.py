"""GRPO on a mixture-of-experts policy (qwen3_moe): rollouts through the MoE model's KV cache, the
policy loss on its logits, a gradient that reaches the experts.

Bugs caught: the MoE forward refusing the sampler's cache arguments, the sampler or the log-probs
indexing the MoE output tuple instead of its logits, expert weights left out of the update."""

from __future__ import annotations

import math
from pathlib import Path

from tests.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.trainer import Trainer


def test_grpo_trains_a_moe_policy(tmp_path: Path) -> None:
    config = load_config("grpo_qwen3_debug", [
        "--model.name=qwen3_moe", "--model.flavor=debug_moe", "--model.overrides={ n_layers = 2 }",
        f"--job.dump_folder={tmp_path / 'run'}", "--training.steps=2", "--rl.prompts_per_step=2",
        "--rl.group_size=4", "--training.global_batch_size=8", "--rl.max_new_tokens=4", "--rl.max_operand=9",
        "--training.dtype=float32", "--metrics.log_freq=1", "--metrics.eval_freq=0", "--optimizer.lr=1e-2",
        REWARDS,
    ])  # fmt: skip
    trainer = Trainer(config)
    try:
        experts = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "experts" in n}
        records = [r.to_dict() for r in trainer.train()]
        moved = [n for n, p in trainer.model.named_parameters() if n in experts and not p.detach().equal(experts[n])]
    finally:
        trainer.close()
    first, second = records
    assert first["reward_std"] > 0, "the test reward must vary within groups, or nothing is learned"
    assert first["grad_norm"] > 1e-3 and math.isfinite(second["loss"])
    assert experts and len(moved) == len(experts)  # every expert tensor took a step
