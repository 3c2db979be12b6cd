"""`data.document_mask`: packed documents kept apart in every decoder family and in training.

Bugs caught: document ids that start a new document at the eos rather than after it; a family whose
forward drops document_ids (Qwen 3's QK-norm path, the MoE block's own forward); a training task that
ignores the switch, or passes document ids without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from titan_tpu.config import load_config
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model, Qwen3MoeModel
from titan_tpu.tasks.language_model import documents_after_eos
from titan_tpu.training.trainer import Trainer

EOS = 9


def test_a_document_begins_after_each_eos() -> None:
    tokens = torch.tensor([[5, EOS, 7, 8, EOS, 3], [EOS, EOS, 1, 2, 3, 4]])
    assert documents_after_eos(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_packed_logits_equal_each_document_alone(family: str) -> None:
    """Our own model packed against our own model per document (transformers parity is in
    tests/parity/models/test_document_mask.py); the MoE routes each token alone, so its logits agree too."""
    torch.manual_seed(0)
    if family == "qwen3":
        model: torch.nn.Module = Qwen3Model(dataclasses.replace(QWEN3_FLAVORS["debug"], n_layers=2))
    else:
        args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], n_layers=2, expert_impl="loop")
        model = Qwen3MoeModel(args)
    model.init_weights(torch.device("cpu"))
    lengths = [7, 12, 5]
    tokens = torch.randint(0, 200, (1, sum(lengths)))
    documents = torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)]])

    def logits(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        out = model(*args, **kwargs)
        return out if isinstance(out, torch.Tensor) else out.logits

    with torch.no_grad():
        packed = logits(tokens, document_ids=documents)
        alone = torch.cat([logits(piece) for piece in tokens.split(lengths, dim=1)], dim=1)
        unmasked = logits(tokens)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (unmasked - alone).abs().max() > 1e-3  # negative control


def test_the_language_model_task_hands_document_ids_to_the_model(tmp_path: Path) -> None:
    overrides = ["--training.steps=1", "--data.document_mask=true", f"--job.dump_folder={tmp_path}"]
    trainer = Trainer(load_config("llama3_debug", overrides))
    seen: list[dict] = []
    handle = trainer.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        eos = trainer.task.tokenizer.eos_id  # type: ignore[attr-defined]
        tokens = torch.randint(0, 200, (2, 16))
        tokens[0, 5] = tokens[1, 9] = eos
        batch = {"input_ids": tokens, "labels": torch.randint(0, 200, (2, 16))}
        trainer.task.loss(trainer.model, batch)
        trainer.config.data.document_mask = False
        trainer.task.loss(trainer.model, batch)
    finally:
        handle.remove()
        trainer.close()
    assert torch.equal(seen[0]["document_ids"], documents_after_eos(tokens, eos))
    assert "document_ids" not in seen[1]
