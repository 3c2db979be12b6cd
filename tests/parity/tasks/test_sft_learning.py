"""The fine-tuning path end to end: the shipped `sft_qwen3_debug` run learns its generated chat task
(held-out exact answers from near 0 to at least 80%), and the folder it exports is a Hugging Face
model that transformers loads and chats with, generating the same greedy tokens as our sampler.

Bugs caught: a loss mask or packing that trains on the wrong tokens (the model never learns to
answer, or never stops), document masking or positions that differ between training and
generation, an export that renames, transposes or drops a weight, a chat template or special
token lost on export (transformers' prompt ids differ from ours)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.convert_checkpoint import main as convert_checkpoint
from tests.support.paths import REPO
from titan_tpu.config import load_config
from titan_tpu.data.generated_chat import conversation
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.tasks.grpo.hf_greedy import greedy_ours, greedy_transformers, load_exported
from titan_tpu.tasks.sft.data import ChatEncoding

transformers = pytest.importorskip("transformers")

ROOT = REPO
PROMPTS = 16
MAX_NEW_TOKENS = 24


def _exact_answer_rates(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["sft/exact_answers"]) for r in records if "sft/exact_answers" in r]


def _our_model(folder: Path, config, broken: bool = False) -> torch.nn.Module:
    model, _ = load_exported(folder, config.model.name, config.model.flavor)
    if broken:  # negative control: one layer's gate and up projections crossed, as a mixed-up adapter would
        feed_forward = model.layers["0"].feed_forward
        feed_forward.w1.weight, feed_forward.w3.weight = feed_forward.w3.weight, feed_forward.w1.weight
    return model


@torch.no_grad()
def _logits_gap(ours: torch.nn.Module, theirs: torch.nn.Module, sequences: list[list[int]]) -> float:
    """Largest difference of the two models' logits over every position of every sequence."""
    return max(float((ours(torch.tensor([s])) - theirs(torch.tensor([s])).logits).abs().max()) for s in sequences)


@pytest.mark.slow
def test_the_debug_run_learns_the_format_and_its_export_chats_the_same_in_transformers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [f"--job.dump_folder={run}", "--checkpoint.enable=true"]
    done = subprocess.run(
        [sys.executable, "train.py", "--config", "sft_qwen3_debug", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rates = _exact_answer_rates(run)
    assert rates[0][1] <= 0.1 and rates[-1][1] >= 0.8, rates

    folder = tmp_path / "hf"
    assert convert_checkpoint(["dcp-to-hf", str(folder), "--config", "sft_qwen3_debug", *overrides]) == 0
    config = load_config("sft_qwen3_debug", overrides)
    encoding = ChatEncoding.from_config(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = []
    for index in range(PROMPTS):
        messages = conversation(config.training.seed, "held_out", index)[:-1]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ours = encoding.tokenizer.encode(encoding.template.render(messages, add_generation_prompt=True))
        assert list(ids) == ours, messages
        prompts.append(ours)

    theirs = greedy_transformers(folder, prompts, MAX_NEW_TOKENS, encoding.stop_ids, encoding.pad_id)
    ours = _our_model(folder, config)
    assert greedy_ours(ours, DECODER_DECODING, prompts, MAX_NEW_TOKENS, encoding.stop_ids, encoding.pad_id) == theirs
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answered = [p + t for p, t in zip(prompts, theirs)]
    assert _logits_gap(ours, hf_model, answered) < 1e-4
    # The answers are the task's, so the comparison is between two models that learned it ...
    answers = [tokenizer.decode(t) for t in theirs]
    assert sum(a.endswith("<|im_end|>") for a in answers) >= PROMPTS * 3 // 4, answers
    # ... and it sees two weights of one layer exchanged (negative control).
    assert _logits_gap(_our_model(folder, config, broken=True), hf_model, answered) > 1e-2
