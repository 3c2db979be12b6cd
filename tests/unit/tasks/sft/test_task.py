"""The fine-tuning task on one process (titan_tpu/tasks/sft/): bad records stop the run before the
model is built with one line naming the record, and the loss is the mean per trained token of the
whole global batch, whatever the split into micro-batches.

Bugs caught: a record error without its file and line (or a traceback instead of exit 2), a bad
record found only mid-run after outputs were written, pretraining text accepted as fine-tuning
data, a loss normalised per micro-batch (a mean of means weighs a token of a short answer more),
a logged loss that is not the global per-token mean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.tasks.base import TaskLoss
from titan_tpu.training.trainer import Trainer

ROOT = REPO
GOOD = {"messages": [{"role": "user", "content": "Spell abc."}, {"role": "assistant", "content": "a-b-c"}]}


def _records(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(tmp_path: Path, *overrides: str):
    return load_config(
        "sft_qwen3_debug",
        [
            f"--job.dump_folder={tmp_path / 'run'}",
            "--training.seq_len=64",
            "--training.global_batch_size=4",
            "--training.dtype=float32",
            "--validation.enable=false",
            "--metrics.eval_freq=0",
            *overrides,
        ],
    )


def _files(tmp_path: Path, *records: object) -> list[str]:
    return ["--sft.dataset=data", "--data.source=files", f"--data.path={_records(tmp_path, *records)}"]


@pytest.mark.parametrize(
    ("record", "extra", "message"),
    [
        (
            {"text": "hello"},
            [],
            r"train.jsonl:2: no 'messages' field and no 'prompt'/'completion' pair \(the record has text\)",
        ),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            [],
            r"train.jsonl:2: turn 0 has unknown role 'robot'; allowed: system, user, assistant, tool",
        ),
        ({"messages": []}, [], r"train.jsonl:2: an empty conversation"),
        (
            {"prompt": "2+2=", "completion": "4"},
            [],
            r"train.jsonl:2: sft.train_on = 'assistant' needs messages records",
        ),
        (
            {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]},
            ["bad_template"],
            r"train.jsonl:2: chat template .*bad.jinja: cannot render boom",
        ),
    ],
)
def test_a_bad_record_is_one_line_with_its_place_before_the_model_is_built(
    tmp_path: Path, record: dict, extra: list[str], message: str
) -> None:
    overrides = _files(tmp_path, GOOD, record)
    if extra:
        template = tmp_path / "bad.jinja"
        template.write_text(
            "{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('cannot render boom') }}{% endif %}"
            "{{ m['content'] }}<|im_end|>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
        )
        overrides.append(f"--data.chat_template={template}")
    with pytest.raises(ConfigError, match=message) as caught:
        Trainer(_config(tmp_path, *overrides))
    assert "\n" not in str(caught.value)
    # Nothing a run leaves behind was started: no metrics, no checkpoint.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.toml"]


def test_train_py_exits_2_with_the_line(tmp_path: Path) -> None:
    path = _records(tmp_path, GOOD, {"messages": []})
    done = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "sft_qwen3_debug",
            f"--job.dump_folder={tmp_path / 'run'}",
            "--sft.dataset=data",
            "--data.source=files",
            f"--data.path={path}",
            "--validation.enable=false",
            "--sft.eval_generations=0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {path}:2: an empty conversation"], done.stderr[-2000:]


def test_pretraining_text_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.source: 'embedded' is pretraining text"):
        Trainer(_config(tmp_path, "--sft.dataset=data"))


def _step_gradients(tmp_path: Path, local_batch: int, per_micro_batch_mean: bool = False):
    trainer = Trainer(_config(tmp_path / str(local_batch), f"--training.local_batch_size={local_batch}"))
    task = trainer.task
    batches: list[dict] = []
    if per_micro_batch_mean:
        # The bug the normalisation prevents: each micro-batch's own mean, averaged.
        task.loss = lambda model, batch: TaskLoss(
            task.loss_fn(
                model(batch["input_ids"], document_ids=batch["document_ids"]), batch["labels"], task.loss_chunk_elements
            ),
            1,
        )
    next_batch = task.next_batch
    task.next_batch = lambda model: batches.append(next_batch(model)) or batches[-1]
    loss, _ = trainer.forward_backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    with torch.no_grad():
        logits = torch.cat([trainer.model(b["input_ids"], document_ids=b["document_ids"]) for b in batches])
        by_hand = cross_entropy_loss(logits, torch.cat([b["labels"] for b in batches]))
    trainer.close()
    return float(loss), float(by_hand), grads


def test_loss_is_per_trained_token_of_the_global_batch_whatever_the_micro_batches(tmp_path: Path) -> None:
    loss_1, by_hand_1, grads_1 = _step_gradients(tmp_path, local_batch=4)
    assert loss_1 == pytest.approx(by_hand_1, rel=1e-6)
    for local_batch in (2, 1):
        loss, by_hand, grads = _step_gradients(tmp_path, local_batch)
        assert loss == pytest.approx(by_hand_1, rel=1e-6) and by_hand == pytest.approx(by_hand_1, rel=1e-6)
        assert max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in grads_1.items()) < 1e-5
    # Negative control: a mean of micro-batch means is another loss and other gradients.
    loss_bad, _, grads_bad = _step_gradients(tmp_path / "bad", local_batch=1, per_micro_batch_mean=True)
    assert abs(loss_bad - by_hand_1) > 1e-3
    assert max(float((grads_bad[n] - g).abs().max() / g.abs().max()) for n, g in grads_1.items()) > 1e-3


def test_a_held_out_set_smaller_than_one_evaluation_is_refused(tmp_path: Path) -> None:
    """4 batches of 4 rows are wanted; 3 short conversations pack into one row."""
    with pytest.raises(
        ConfigError, match=r"^validation.batches: generated chat \(held_out, 3 conversations\) holds 1 rows"
    ):
        Trainer(_config(tmp_path, "--validation.enable=true", "--sft.generated_held_out=3"))
