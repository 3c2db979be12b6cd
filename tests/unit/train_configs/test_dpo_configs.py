"""The shipped 8B preference-training config, run as a user runs it: every path pointed at a checkpoint
folder (here a debug-sized model exported to Hugging Face format with Qwen 3's published chat template
and special tokens) and at preference records, two steps on one process.

Bugs caught: a key in the shipped config that the task refuses or ignores (a wrong template switch
name, a validation section the dpo task cannot read), an initial load applied to the policy but not to
the reference (the first loss would not be log 2: a reference other than the starting policy) or to
neither (the first log-probabilities would be those of freshly initialised weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.chat_fixtures import checkpoint_folder
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
PAIR = {
    "prompt": [{"role": "user", "content": "What is two plus two?"}],
    "chosen": [{"role": "assistant", "content": "Four."}],
    "rejected": [{"role": "assistant", "content": "Five."}],
}


def _pairs(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps(PAIR) + "\n" for _ in range(count)))
    return path


def _first_record(tmp_path: Path, initial_load: bool) -> dict:
    tmp_path.mkdir()
    folder = tmp_path / "checkpoint"  # weights, tokenizer and template together, as published
    overrides = [
        *SMALL,
        f"--job.dump_folder={tmp_path / 'run'}",
        f"--data.tokenizer={folder}",
        f"--data.path={_pairs(tmp_path / 'pairs.jsonl', 8)}",
        f"--validation.path={_pairs(tmp_path / 'held_out.jsonl', 2)}",
    ]
    config = load_config("dpo_qwen3_8b", overrides)
    spec = get_model_spec(config.model.name)
    args = spec.args_for(config)
    torch.manual_seed(1)
    model = spec.model_cls(args)
    model.init_weights()
    with torch.no_grad():  # far from a fresh init, so a load that is not applied shows in the log-probabilities
        model.output.weight.mul_(8.0)
    tokenizer = tokenizer_export_files(str(checkpoint_folder(tmp_path / "tokenizer", "qwen3")))
    export_model_to_hf(model, folder, spec.state_dict_adapter, args, extra_files=tokenizer)
    load = [f"--checkpoint.initial_load_path={folder}"] if initial_load else ["--checkpoint.initial_load_path="]
    Trainer(load_config("dpo_qwen3_8b", [*overrides, *load])).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("heldout_reward_accuracy" in r for r in rows), rows
    return rows[0]


def test_the_8b_dpo_config_trains_from_a_checkpoint_folder(tmp_path: Path) -> None:
    loaded = _first_record(tmp_path / "loaded", initial_load=True)
    fresh = _first_record(tmp_path / "fresh", initial_load=False)
    # Policy and reference both start from the folder: the first loss is log 2 ...
    assert loaded["loss"] == pytest.approx(math.log(2), abs=1e-6) and fresh["loss"] == pytest.approx(
        math.log(2), abs=1e-6
    )
    # ... and the folder's weights are the ones scored.
    assert abs(loaded["logps/chosen"] - fresh["logps/chosen"]) > 1.0, (loaded, fresh)
