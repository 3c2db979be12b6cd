"""GRPO on a mixture-of-experts policy (qwen3_moe): rollouts through the MoE model's KV cache, the
policy loss on its logits plus the routers' load-balancing loss, a gradient that reaches the experts.

Bugs caught: the MoE forward refusing the sampler's cache arguments, the sampler or the log-probs
indexing the MoE output tuple instead of its logits, expert weights left out of the update."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer


def test_grpo_trains_a_moe_policy(tmp_path: Path) -> None:
    config = load_config(
        "grpo_qwen3_debug",
        [
            "--model.name=qwen3_moe",
            "--model.flavor=debug_moe",
            "--model.overrides={ n_layers = 2 }",
            f"--job.dump_folder={tmp_path / 'run'}",
            "--training.steps=2",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--rl.max_new_tokens=4",
            "--rl.max_operand=9",
            "--training.dtype=float32",
            "--metrics.log_freq=1",
            "--metrics.eval_freq=0",
            "--optimizer.lr=1e-2",
            REWARDS,
        ],
    )
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


def test_the_routers_load_balancing_loss_is_part_of_the_grpo_loss(tmp_path: Path) -> None:
    """The micro-batch loss of an MoE policy is the policy objective plus router_aux_loss_coef x the
    aux loss (as pretraining's and TRL's GRPO), which gives the routers a gradient the objective alone
    does not; the record logs aux_loss. Catches the aux loss dropped (the negative control: coef 0
    changes the routers' gradient) or weighted otherwise."""

    def router_grads(coef: float) -> tuple[float, float, dict[str, torch.Tensor], dict[str, float]]:
        config = load_config(
            "grpo_qwen3_debug",
            [
                "--model.name=qwen3_moe",
                "--model.flavor=debug_moe",
                f"--model.overrides={{ n_layers = 2, router_aux_loss_coef = {coef} }}",
                f"--job.dump_folder={tmp_path / str(coef)}",
                "--training.steps=1",
                "--rl.prompts_per_step=2",
                "--rl.group_size=4",
                "--training.global_batch_size=8",
                "--rl.max_new_tokens=4",
                "--rl.max_operand=9",
                "--training.dtype=float32",
                "--metrics.eval_freq=0",
                REWARDS,
            ],
        )
        trainer = Trainer(config)
        try:
            task, model = trainer.task, trainer.model
            batch = task.next_batch(model)
            loss = task.loss(model, batch).loss
            loss.backward()
            output = model(batch.tokens)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n and p.grad is not None}
            metrics = task.step_metrics()
            return float(loss), float(output.aux_loss), grads, metrics
        finally:
            trainer.close()

    loss, aux, grads, metrics = router_grads(0.5)
    plain_loss, _, plain_grads, _ = router_grads(0.0)
    assert aux > 0 and math.isclose(loss, plain_loss + 0.5 * aux, rel_tol=1e-5, abs_tol=1e-7)
    assert metrics["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert grads and grads.keys() == plain_grads.keys()
    assert any(not torch.allclose(grads[n], plain_grads[n], atol=1e-8) for n in grads)
