"""Held-out validation (titan_tpu/tasks/validation.py and the language-model task's `[validation]`):
the loss is the summed cross-entropy over counted labels / their count, as computed by hand, and not
a version that counts ignored labels, shifts them, adds the router's aux loss or drops the document
ids; every evaluation reads the same rows; bad held-out settings are one line; and a run with
`metrics.eval_freq = 0` still gets its final held-out loss. Multi-process parity of the same number is
in tests/distributed/test_parallelism.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from itertools import islice
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_tpu.config import ConfigError, load_config
from titan_tpu.data.loader import PackedDataset
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.models.common.loss import IGNORE_INDEX
from titan_tpu.models.registry import get_model_spec
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.validation import held_out_loss
from titan_tpu.training.trainer import Trainer

SEQ = 16
WORDS = "the model reads held out text and counts every token it predicts for the loss".split()


def write_held_out(path: Path, records: int = 40) -> Path:
    """A few KB of JSON-lines text, one document per record."""
    rng = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20)))}) for _ in range(records)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def context(config_name: str = "llama3_debug") -> TaskContext:
    config = load_config(config_name, [])
    return TaskContext(
        config=config,
        spec=get_model_spec(config.model.name),
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        parallel=ParallelContext(ParallelDims(1, 1, 1, 1, 1)),
        dp_rank=0,
        dp_world=1,
        local_batch_size=2,
        grad_accum_steps=1,
        dump_folder=Path("."),
        is_writer=True,
    )


def tiny_model(name: str, flavor: str, **changes: object) -> nn.Module:
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavor(flavor), n_layers=1, max_seq_len=SEQ, **changes)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    # Freshly initialised logits are almost uniform, so any label scores about ln V and the controls
    # below could hardly tell a wrong label from the right one; sharper logits make them distinct.
    with torch.no_grad():
        model.output.weight.mul_(5)
    return model


def micro_batches(vocab: int, documents: bool = False) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of 2 rows; about a third of the labels ignored, as fine-tuning masks prompts."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.35] = IGNORE_INDEX
        batch = {"input_ids": tokens[:, :-1], "labels": labels}
        if documents:
            batch["document_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(2, SEQ)
        batches.append(batch)
    return batches


def by_hand(logits: list[torch.Tensor], labels: list[torch.Tensor]) -> float:
    """Sum of -log softmax at the label over counted labels / their count, in float64."""
    total, count = 0.0, 0
    for z, y in zip(logits, labels):
        counted = y != IGNORE_INDEX
        log_p = z.double().log_softmax(-1)
        total -= float(log_p[counted].gather(-1, y[counted].unsqueeze(-1)).sum())
        count += int(counted.sum())
    return total / count


def logits_of_batches(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(b["input_ids"]) for b in batches]


@pytest.mark.parametrize("chunk_elements", [2**26, 3 * 512], ids=["one_chunk", "3_token_chunks"])
def test_loss_is_summed_cross_entropy_over_counted_labels(chunk_elements: int) -> None:
    """Catches a mean of per-batch means, counting ignored labels, a label shifted by one, and (with
    3-token chunks over 32 tokens) a chunk loop that drops the last, partial chunk."""
    model = tiny_model("llama3", "debug")
    batches = micro_batches(512)
    result = held_out_loss(model, batches, context(), chunk_elements)
    logits = logits_of_batches(model, batches)
    expected = by_hand(logits, [b["labels"] for b in batches])
    assert result["validation/loss"] == pytest.approx(expected, rel=1e-6)
    assert result["validation/perplexity"] == math.exp(result["validation/loss"])
    assert result["validation/tokens"] == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    # Negative controls: the same hand computation with the mask ignored, or the labels one
    # position off, is far from the result (so the check above can tell them apart).
    unmasked = by_hand(logits, [b["input_ids"].roll(-1, dims=1) for b in batches])
    shifted = by_hand(logits, [b["labels"].roll(1, dims=1) for b in batches])
    for wrong in (unmasked, shifted):  # 0.07 and 0.18 away
        assert abs(result["validation/loss"] - wrong) > 1e-2


def test_a_mixture_of_experts_loss_is_the_cross_entropy_without_the_router_loss() -> None:
    """The MoE model returns (logits, aux loss, coefficient); validation reads the logits only."""
    spec = get_model_spec("qwen3_moe")
    model = tiny_model("qwen3_moe", "debug_moe", router_aux_loss_coef=1.0, expert_impl="loop")
    batches = micro_batches(512)
    result = held_out_loss(model, batches, context("qwen3_moe_debug"))
    with torch.no_grad():
        outputs = [model(b["input_ids"]) for b in batches]
        training_loss = sum(float(spec.loss_fn(o, b["labels"])) for o, b in zip(outputs, batches)) / len(batches)
    expected = by_hand([o.logits for o in outputs], [b["labels"] for b in batches])
    assert result["validation/loss"] == pytest.approx(expected, rel=1e-6)
    assert abs(result["validation/loss"] - training_loss) > 1e-2  # the control: the aux term is visible


def test_document_ids_reach_the_model() -> None:
    """With `document_ids` in the batch the model keeps the documents apart; dropping them changes
    the loss (the control)."""
    model = tiny_model("llama3", "debug")
    batches = micro_batches(512, documents=True)
    result = held_out_loss(model, batches, context())
    with torch.no_grad():
        separate = [model(b["input_ids"], document_ids=b["document_ids"]) for b in batches]
    labels = [b["labels"] for b in batches]
    assert result["validation/loss"] == pytest.approx(by_hand(separate, labels), rel=1e-6)
    assert abs(result["validation/loss"] - by_hand(logits_of_batches(model, batches), labels)) > 1e-2


def test_the_model_is_given_back_in_training_mode() -> None:
    model = tiny_model("llama3", "debug")
    held_out_loss(model, micro_batches(512), context())
    assert model.training


# One narrow layer: building and initialising the debug model's four layers is most of a run's time.
TINY_RUN = [
    "--model.overrides.n_layers=1",
    "--model.overrides.dim=64",
    "--model.overrides.n_heads=2",
    "--model.overrides.n_kv_heads=2",
    "--training.seq_len=32",
    "--training.global_batch_size=2",
    "--training.local_batch_size=1",
    "--metrics.log_freq=1",
]


def trainer_with_validation(tmp_path: Path, *overrides: str) -> Trainer:
    held_out = write_held_out(tmp_path / "held_out.jsonl")
    config = load_config(
        "llama3_debug",
        [
            f"--job.dump_folder={tmp_path / 'run'}",
            *TINY_RUN,
            "--validation.enable=true",
            f"--validation.path={held_out}",
            "--validation.batches=2",
            *overrides,
        ],
    )
    return Trainer(config)


def test_every_evaluation_reads_the_same_rows(tmp_path: Path) -> None:
    """Two evaluations at different steps with unchanged weights give the same number: catches a
    held-out loader that carries on where the previous evaluation stopped (the control: the rows
    after the evaluated ones give another number, so carrying on would be seen)."""
    trainer = trainer_with_validation(tmp_path, "--training.steps=10")
    trainer.step = 1
    first = trainer.evaluate()
    trainer.step = 7
    again = trainer.evaluate()
    assert first == again
    assert first["validation/tokens"] == 2 * 2 * 32  # validation.batches x global_batch_size rows
    task = trainer.task
    stream = PackedDataset(task.validation_source, task.tokenizer, 32, 0, 1, seed=0, shuffle=False)
    rows = list(islice(stream, 8))
    later = [
        {
            "input_ids": torch.stack([r["input_ids"] for r in rows[i : i + 2]]),
            "labels": torch.stack([r["labels"] for r in rows[i : i + 2]]),
        }
        for i in (4, 6)
    ]
    next_rows = held_out_loss(trainer.model, later, task.ctx)
    assert abs(next_rows["validation/loss"] - first["validation/loss"]) > 1e-3
    trainer.close()


@pytest.mark.parametrize(
    ("eval_freq", "enable", "steps_with_validation"),
    [(0, True, [3]), (2, True, [2, 3]), (0, False, [])],
)
def test_validation_runs_every_eval_freq_and_at_the_last_step(
    tmp_path: Path, eval_freq: int, enable: bool, steps_with_validation: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """eval_freq = 0 turns periodic evaluation off, but an enabled [validation] still gives the final
    number (the trainer used to evaluate only when eval_freq > 0); the numbers land in metrics.jsonl
    and on the console."""
    trainer = trainer_with_validation(
        tmp_path, "--training.steps=3", f"--metrics.eval_freq={eval_freq}", f"--validation.enable={str(enable).lower()}"
    )
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        records = trainer.train()
    trainer.close()
    assert [r.step for r in records if "validation/loss" in r.extras] == steps_with_validation
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "validation/loss" in line] == steps_with_validation
    console = [r.getMessage() for r in caplog.records if "validation/loss" in r.getMessage()]
    assert len(console) == len(steps_with_validation)


def test_generated_held_out_data_is_refused_for_language_models(tmp_path: Path) -> None:
    config = load_config(
        "llama3_debug", [f"--job.dump_folder={tmp_path}", "--validation.enable=true", "--validation.source=generated"]
    )
    with pytest.raises(ConfigError) as error:
        Trainer(config)
    message = str(error.value)
    assert message.startswith("validation.source: 'generated' is the sft task's") and "\n" not in message


@pytest.mark.parametrize(
    ("records", "path", "expected"),
    [
        # 40 records of about 65 bytes: some 80 rows of 33 tokens, not 100 x 2.
        (40, "held_out.jsonl", "validation.batches: "),
        (40, "missing.jsonl", "validation.path: "),
        (0, "held_out.txt", "validation.path: "),  # "hi": less than one row of 33 tokens
    ],
    ids=["fewer_rows_than_asked", "missing_file", "shorter_than_one_row"],
)
def test_bad_held_out_data_is_one_line_naming_the_validation_key(
    tmp_path: Path, records: int, path: str, expected: str
) -> None:
    """The data modules' own messages name data.path; here the value came from validation.path."""
    write_held_out(tmp_path / "held_out.jsonl", records)
    (tmp_path / "held_out.txt").write_text("hi")
    config = load_config(
        "llama3_debug",
        [
            f"--job.dump_folder={tmp_path / 'run'}",
            *TINY_RUN,
            "--validation.enable=true",
            f"--validation.path={tmp_path / path}",
            "--validation.batches=100",
        ],
    )
    with pytest.raises(ConfigError) as error:
        Trainer(config)
    message = str(error.value)
    assert message.startswith(expected) and "\n" not in message, message
