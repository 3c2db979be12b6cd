"""The shipped 8B fine-tuning configs, run as a user runs them: every path pointed at a checkpoint
folder (here a debug-sized model exported to Hugging Face format, with the family's published chat
template and special tokens), two steps on one process.

Bugs caught: a key in the shipped config that the task refuses or ignores (a wrong template switch
name, a validation section the sft task cannot read), an initial load that is not applied (the
first loss is that of freshly initialised weights), the checkpoint's template not used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.chat_fixtures import CONVERSATION, checkpoint_folder
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.config import load_config
from titan_tpu.data.chat_tokenizer import tokenizer_export_files
from titan_tpu.models.registry import get_model_spec
from titan_tpu.training.trainer import Trainer

SMALL = [
    "--model.flavor=debug",
    "--model.overrides.vocab_size=640",
    "--training.seq_len=128",
    "--training.global_batch_size=2",
    "--training.local_batch_size=1",
    "--training.steps=2",
    "--training.dtype=float32",
    "--checkpoint.enable=false",
    "--validation.batches=1",
    "--metrics.log_freq=1",
    "--metrics.eval_freq=2",
]


def _records(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(count)))
    return path


def _first_loss(tmp_path: Path, name: str, family: str, initial_load: bool) -> float:
    tmp_path.mkdir()
    folder = tmp_path / "checkpoint"  # weights, tokenizer and template together, as published
    overrides = [
        *SMALL,
        f"--job.dump_folder={tmp_path / 'run'}",
        f"--data.tokenizer={folder}",
        f"--data.path={_records(tmp_path / 'train.jsonl', 16)}",
        f"--validation.path={_records(tmp_path / 'held_out.jsonl', 4)}",
    ]
    config = load_config(name, overrides)
    spec = get_model_spec(config.model.name)
    args = spec.args_for(config)
    torch.manual_seed(1)
    model = spec.model_cls(args)
    model.init_weights()
    with torch.no_grad():  # far from a fresh init, so a load that is not applied shows in the loss
        model.output.weight.mul_(8.0)
    tokenizer = tokenizer_export_files(str(checkpoint_folder(tmp_path / "tokenizer", family)))
    export_model_to_hf(model, folder, spec.state_dict_adapter, args, extra_files=tokenizer)
    load = [f"--checkpoint.initial_load_path={folder}"] if initial_load else ["--checkpoint.initial_load_path="]
    Trainer(load_config(name, [*overrides, *load])).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("validation/loss" in r for r in rows), rows
    return next(r["loss"] for r in rows if "loss" in r)


@pytest.mark.parametrize(
    ("name", "family"), [("sft_qwen3_8b", "qwen3"), ("sft_qwen3_8b_lora", "qwen3"), ("sft_llama3_8b", "llama3_1")]
)
def test_the_8b_sft_config_trains_from_a_checkpoint_folder(tmp_path: Path, name: str, family: str) -> None:
    loaded = _first_loss(tmp_path / "loaded", name, family, initial_load=True)
    fresh = _first_loss(tmp_path / "fresh", name, family, initial_load=False)
    assert abs(loaded - fresh) > 0.5, (loaded, fresh)  # the folder's weights are the ones trained
