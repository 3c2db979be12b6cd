"""The frozen reference of preference training (titan_tpu/tasks/dpo/reference.py, built by
titan_tpu/tasks/reference_model.py): a copy of the initial model without LoRA; with LoRA, no copy but
the policy with its adapters switched off.

Bugs caught: a second model built (twice the memory) when the adapters can give the reference, a
reference that is the adapted policy itself (every reward 0 forever), adapters left switched off
after the reference's forward (the policy would train without them), a LoRA run that also trains
other weights accepted (switching the adapters off would not give back the initial model), a copy
that is not the policy's initial weights or that runs in training mode (dropout in the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.launch import fixed_kernels
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.common.lora import lora_layers
from titan_tpu.tasks import reference_model
from titan_tpu.tasks.dpo.batch import sequence_logps
from titan_tpu.tasks.dpo.reference import Reference
from titan_tpu.tasks.dpo.task import DpoTask
from titan_tpu.training.trainer import Trainer

SMALL = [
    *fixed_kernels("dpo_qwen3_debug"),
    "--model.overrides={ n_layers = 1 }",
    "--training.seq_len=48",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--dpo.generated_pairs=16",
    "--validation.enable=false",
    "--training.steps=2",
]


def _trainer(tmp_path: Path, *overrides: str) -> tuple[Trainer, DpoTask]:
    trainer = Trainer(load_config("dpo_qwen3_debug", [*SMALL, f"--job.dump_folder={tmp_path}", *overrides]))
    assert isinstance(trainer.task, DpoTask)
    return trainer, trainer.task


def test_with_lora_no_copy_is_built_and_the_adapters_off_are_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_copy(*args: object) -> None:
        raise AssertionError("a reference copy was built beside a LoRA policy")

    monkeypatch.setattr(reference_model, "frozen_initial_copy", no_copy)
    trainer, task = _trainer(tmp_path, "--lora.enable=true", "--lora.rank=4")
    assert task.reference is not None and task.reference.is_adapter_switch
    model = trainer.model
    batch = task.next_batch(model)  # the reference's log-probabilities, with B = 0: the base's
    assert batch.reference_logps is not None
    layers = [layer for _, layer in lora_layers(model)]
    assert layers and all(layer.adapter_enabled for layer in layers)  # switched back on
    with torch.no_grad():
        assert torch.equal(sequence_logps(model(batch.tokens), batch), batch.reference_logps)
        for layer in layers:  # the adapters now change the policy ...
            layer.lora_B.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
        adapted = sequence_logps(model(batch.tokens), batch)
        assert (adapted - batch.reference_logps).abs().max() > 1e-2
        # ... and not the reference: the adapters switched off give the base's log-probabilities again.
        assert torch.equal(task.reference.logps(model, batch), batch.reference_logps)
    trainer.close()


def test_lora_that_trains_other_weights_is_refused(tmp_path: Path) -> None:
    trainer, task = _trainer(tmp_path, "--lora.enable=true", "--lora.rank=4")
    trainer.model.norm.weight.requires_grad_(True)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"^training.task = 'dpo' with LoRA: 1 parameter\(s\) besides the adapters"):
        Reference.for_policy(trainer.model, task.ctx)
    trainer.close()


def test_without_lora_the_reference_is_a_frozen_copy_of_the_initial_model(tmp_path: Path) -> None:
    trainer, task = _trainer(tmp_path)
    assert task.reference is not None and task.reference.model is not None
    copy = dict(task.reference.model.named_parameters())
    for name, param in trainer.model.named_parameters():
        assert copy[name] is not param and torch.equal(copy[name], param) and not copy[name].requires_grad, name
    trainer.train()  # the policy moves, the reference does not
    moved = sum(not torch.equal(copy[name], param) for name, param in trainer.model.named_parameters())
    assert moved == len(copy)
    assert not task.reference.model.training  # never dropped out, while the policy trains
    trainer.close()
