"""GRPO's KL reference under LoRA: no second model; the policy with its adapters switched off, which is
the base the run started from however far the adapters have trained.

Bugs caught: a reference that keeps the adapters on (its KL against the policy is then zero forever,
so rl.beta does nothing: the negative control), a reference copy built beside a LoRA policy (memory
for nothing), adapters left switched off after scoring the reference (the policy would train the
base's outputs)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit.tasks.grpo.test_old_logps import grpo_trainer
from titan_tpu.generation.logprobs import token_logps
from titan_tpu.models.common.lora import adapters_disabled, lora_layers

LORA = ["--rl.beta=0.1", "--lora.enable=true", "--lora.rank=4", "--optimizer.lr=0.05"]


def test_the_reference_is_the_policy_with_its_adapters_off(tmp_path: Path) -> None:
    trainer = grpo_trainer(tmp_path, *LORA)
    try:
        task, model = trainer.task, trainer.model
        assert task.reference is not None and task.reference.model is None
        # Both mini-batches of the first rollout: the adapters move away from B = 0, and the next batch
        # comes from a rollout scored after that.
        trainer.train_step()
        trainer.train_step()
        assert not task.queue
        assert any(float(layer.lora_B.detach().abs().max()) > 0 for _, layer in lora_layers(model))
        batch = task.next_batch(model)
        assert batch.ref_logps is not None
        assert all(layer.adapter_enabled for _, layer in lora_layers(model))
        with torch.no_grad():
            with adapters_disabled(model):
                base = token_logps(model, batch.tokens)
            policy = token_logps(model, batch.tokens)
        on = batch.mask.bool()
        torch.testing.assert_close(batch.ref_logps[on], base[on], rtol=1e-5, atol=1e-6)
        # Negative control: the trained policy's own log-probs are not the reference's.
        assert float((policy[on] - base[on]).abs().max()) > 1e-4
    finally:
        trainer.close()
