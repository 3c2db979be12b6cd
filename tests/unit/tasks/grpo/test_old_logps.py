"""The rollout policy's log-probabilities (GRPO's old log-probs): the sampler's own where the weights
that train a micro-batch are no longer those that sampled it; the first mini-batch of a rollout used
once is trained before any update, so it trains on its own forward's, detached."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.generation.logprobs import token_logps
from titan_tpu.tasks.grpo.rollout import MicroBatch
from titan_tpu.tasks.grpo.task import GRPOTask
from titan_tpu.training.trainer import Trainer

# One prompt x 4 completions in two mini-batches of 2 (two optimizer steps per rollout), float32.
SMALL = [
    "--model.overrides={ n_layers = 1 }",
    "--training.dtype=float32",
    "--rl.max_new_tokens=4",
    "--rl.max_operand=9",
    "--metrics.eval_freq=0",
    "--rl.prompts_per_step=1",
    "--rl.group_size=4",
    "--training.global_batch_size=2",
    REWARDS,
]


def grpo_trainer(tmp_path: Path, *overrides: str) -> Trainer:
    return Trainer(load_config("grpo_qwen3_debug", [f"--job.dump_folder={tmp_path / 'run'}", *SMALL, *overrides]))


def loss_and_grads(task: GRPOTask, model: torch.nn.Module, batch: MicroBatch) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = task.loss(model, batch).loss
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_the_first_mini_batch_trains_on_its_own_log_probs(tmp_path: Path) -> None:
    """The first mini-batch comes without old log-probs, and its loss and every gradient equal those
    with a forward pass's log-probs; the second carries the sampler's, which equal a forward pass's
    at its completion positions (before any update). Catches old log-probs not detached (the
    ratio's gradient vanishes: a negative control) or taken from another forward, and a later
    mini-batch's placed off its completion tokens."""
    trainer = grpo_trainer(tmp_path)
    try:
        task, model = trainer.task, trainer.model
        first, second = task.next_batch(model), task.next_batch(model)
        assert first.old_logps is None and second.old_logps is not None
        with torch.no_grad():
            scored = dataclasses.replace(first, old_logps=token_logps(model, first.tokens))
            forward = token_logps(model, second.tokens)
        on = second.mask.bool()
        torch.testing.assert_close(second.old_logps[on], forward[on], rtol=1e-5, atol=1e-5)
        assert (second.old_logps[~on] == 0).all()
        # Negative control: the same log-probs one position off are not within the tolerance.
        assert not torch.allclose(second.old_logps[:, 1:][on[:, 1:]], forward[:, :-1][on[:, 1:]], atol=1e-3)
        loss, grads = loss_and_grads(task, model, first)
        scored_loss, scored_grads = loss_and_grads(task, model, scored)
        assert abs(loss - scored_loss) <= 1e-6 * max(1.0, abs(loss))
        assert len(grads) == len(scored_grads) > 0
        for grad, scored_grad in zip(grads, scored_grads):
            torch.testing.assert_close(grad, scored_grad, rtol=1e-5, atol=1e-7)
        # Negative control: old log-probs that carry the gradient cancel it in the ratio.
        original = task.loss
        task.loss = lambda m, b: original(m, dataclasses.replace(b, old_logps=token_logps(m, b.tokens)))  # type: ignore[method-assign]
        _, cancelled = loss_and_grads(task, model, first)
        assert max(float(g.abs().max()) for g in cancelled) < 1e-6 < max(float(g.abs().max()) for g in grads)
    finally:
        trainer.close()


def test_a_rollout_used_twice_carries_the_sampled_log_probs_everywhere(tmp_path: Path) -> None:
    """With updates_per_rollout = 2 the second pass over the first mini-batch comes after updates, so
    every micro-batch carries the sampled policy's log-probs. Catches the first one's left out there too."""
    trainer = grpo_trainer(tmp_path, "--rl.updates_per_rollout=2")
    try:
        task, model = trainer.task, trainer.model
        batches = [task.next_batch(model) for _ in range(2 * 2)]
        assert all(batch.old_logps is not None for batch in batches)
    finally:
        trainer.close()
