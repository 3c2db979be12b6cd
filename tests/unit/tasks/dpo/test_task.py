"""The preference task on one process (titan_tpu/tasks/dpo/): bad records and settings stop the run
with one line before the model is built, the loss is the mean over the global batch's pairs whatever
the split into micro-batches, and a record carries TRL's metric names.

Bugs caught: a record error without its file and line (or a traceback instead of exit 2), a bad record
found only mid-run after outputs were written, a value that does nothing accepted (label smoothing
with IPO, generated pairs with your records), the chosen and rejected rows of different pairs
compared when a step has several micro-batches, a loss normalised per micro-batch of unequal size,
metrics under other names than TRL's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import fixed_kernels
from tests.support.paths import REPO
from titan_tpu.config import ConfigError, TrainConfig, load_config
from titan_tpu.tasks.dpo.batch import PreferenceBatch
from titan_tpu.training.registered_names import check_registered_names
from titan_tpu.training.trainer import Trainer

GOOD = {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five."}
SMALL = [
    *fixed_kernels("dpo_qwen3_debug"),
    "--model.overrides={ n_layers = 1 }",
    "--training.seq_len=48",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--validation.batches=1",
]


def _records(path: Path, *records: object) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(tmp_path: Path, *overrides: str) -> TrainConfig:
    """On 64 generated pairs."""
    dump = f"--job.dump_folder={tmp_path / 'run'}"
    return load_config("dpo_qwen3_debug", [*SMALL, "--dpo.generated_pairs=64", dump, *overrides])


def _files(tmp_path: Path, *records: object) -> list[str]:
    path = _records(tmp_path / "train.jsonl", *records)
    return ["--dpo.dataset=data", "--data.source=files", f"--data.path={path}", "--validation.enable=false"]


def _config_of_files(tmp_path: Path, *records: object) -> TrainConfig:
    return load_config(
        "dpo_qwen3_debug", [*SMALL, f"--job.dump_folder={tmp_path / 'run'}", *_files(tmp_path, *records)]
    )


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, r"train.jsonl:2: no 'rejected' field \(the record has chosen, prompt\)"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, r"train.jsonl:2: 'chosen' and 'rejected' are identical"),
        ({"text": "hello"}, r"train.jsonl:2: no 'prompt' field \(the record has text\)"),
    ],
    ids=["missing", "identical", "pretraining"],
)
def test_a_bad_record_is_one_line_with_its_place_before_the_model_is_built(
    tmp_path: Path, record: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        Trainer(_config_of_files(tmp_path, GOOD, record))
    assert "\n" not in str(caught.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.toml"]  # nothing else started


def test_train_py_exits_2_with_the_line(tmp_path: Path) -> None:
    path = _records(tmp_path / "pairs.jsonl", GOOD, {"prompt": "q", "chosen": "same", "rejected": "same"})
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "dpo_qwen3_debug", f"--job.dump_folder={tmp_path / 'run'}"]
        + ["--dpo.dataset=data", "--data.source=files", f"--data.path={path}", "--validation.enable=false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {path}:2: 'chosen' and 'rejected' are identical; a preference pair needs two different completions "
        "(leave such records out)"
    ], done.stderr[-2000:]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--dpo.loss_type=ipo", "--dpo.label_smoothing=0.1"], r"^dpo.label_smoothing: is read by loss_type"),
        (["--dpo.label_smoothing=0.5"], r"^dpo.label_smoothing: must be in \[0, 0.5\)"),
        (["--dpo.beta=0"], r"^dpo.beta: must be > 0"),
        (["--dpo.dataset=data"], r"^data.source: 'embedded' is pretraining text"),
        (["--data.source=files", "--data.path=x.jsonl"], r"^data.path: 'x.jsonl' is not read while dpo.dataset"),
        (["--data.tokenizer=byte"], r"^data.tokenizer: DPO renders pairs with a chat template"),
        (
            ["--dpo.dataset=data", "--data.source=files", "--data.path=x.jsonl"],  # with _config's generated_pairs
            r"^dpo.generated_pairs: is read only with dpo.dataset = 'generated'",
        ),
    ],
)
def test_a_setting_that_does_nothing_or_cannot_work_is_one_line(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        config = _config(tmp_path, *overrides)
        check_registered_names(config)
        Trainer(config)
    assert "\n" not in str(caught.value)


def test_a_held_out_set_smaller_than_one_evaluation_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^validation.batches: generated sums \(held_out, 3 pairs\) holds 3 rows"):
        Trainer(_config(tmp_path, "--dpo.generated_held_out=3"))


def _step(tmp_path: Path, local_batch: int, mispaired: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step's loss and gradients, the policy moved off its reference first (else every
    pair ties and the gradient is the same whatever the pairing). `mispaired`: the bug the layout of a
    micro-batch prevents, each chosen row compared with the next pair's rejected row."""
    trainer = Trainer(_config(tmp_path / f"{local_batch}{mispaired}", f"--training.local_batch_size={local_batch}"))
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    if mispaired:
        task, next_batch = trainer.task, trainer.task.next_batch

        def rolled(model: torch.nn.Module) -> PreferenceBatch:
            batch = next_batch(model)
            n = batch.pairs
            order = torch.cat([torch.arange(n), n + torch.arange(n).roll(1)])
            assert batch.reference_logps is not None
            batch.tokens, batch.scored = batch.tokens[order], batch.scored[order]
            batch.completion_tokens, batch.reference_logps = (
                batch.completion_tokens[order],
                batch.reference_logps[order],
            )
            return batch

        task.next_batch = rolled  # type: ignore[method-assign]
    loss, _ = trainer.forward_backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.close()
    return float(loss), grads


def _largest_difference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in reference.items())


def test_the_loss_is_the_mean_over_the_global_batch_whatever_the_micro_batches(tmp_path: Path) -> None:
    loss_4, grads_4 = _step(tmp_path, local_batch=4)
    assert abs(loss_4 - 0.6931) > 1e-3  # the policy is not its reference
    for local_batch in (2, 1):
        loss, grads = _step(tmp_path, local_batch)
        assert loss == pytest.approx(loss_4, rel=1e-6)
        assert _largest_difference(grads, grads_4) < 1e-5
    # Negative control: pairs mixed up inside a micro-batch give another loss and other gradients.
    loss, grads = _step(tmp_path, 4, mispaired=True)
    assert abs(loss - loss_4) > 1e-4 and _largest_difference(grads, grads_4) > 1e-3


def test_a_record_has_trls_metrics_and_the_held_out_accuracy(tmp_path: Path) -> None:
    trainer = Trainer(_config(tmp_path, "--training.steps=2", "--metrics.log_freq=1", "--metrics.eval_freq=2"))
    trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    # At the first step the policy is its reference: every reward is 0 and every pair ties.
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[name] == 0.0, name
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert 0.0 <= last["heldout_reward_accuracy"] <= 1.0 and last["validation/pairs"] == 4
    assert last["rewards/margins"] == pytest.approx(last["rewards/chosen"] - last["rewards/rejected"], rel=1e-5)
