"""Config combinations where a value the user gave would be ignored: each is refused before anything
runs, with one line naming the key to change (exit 2), and the combination the line advises runs.
Each case replays a path a user took with their own files that used to train something else and
exit 0 (the SFT data path under the generated dataset, prompt records under the arithmetic task, a
task's section under another task, a resume step with checkpoints off)."""

from __future__ import annotations

import re

import pytest

import train
from tests.unit.config.test_loader import main_error

SFT_FILES = ["--config", "sft_qwen3_debug", "--data.source=files", "--data.path=chat.jsonl"]
GRPO_FILES = ["--config", "grpo_qwen3_debug", "--data.source=files", "--data.path=prompts.jsonl"]


@pytest.mark.parametrize(
    ("args", "message", "fixed"),
    [
        (
            SFT_FILES,
            r"^error: data.path: 'chat.jsonl' is not read while sft.dataset = 'generated' .*set sft.dataset = 'data'",
            ["--sft.dataset=data", "--validation.enable=false", "--sft.eval_generations=0"],
        ),
        (
            [*SFT_FILES, "--sft.dataset=data"],
            r"^error: validation.source: 'generated' .* validation.enable = true and sft.eval_generations = 64 read "
            r".*validation.path = HELD_OUT.jsonl, or set validation.enable = false and sft.eval_generations = 0$",
            ["--validation.enable=false", "--sft.eval_generations=0"],
        ),
        # Turning validation off alone leaves the generated answers, which read held-out records too.
        (
            [*SFT_FILES, "--sft.dataset=data", "--validation.enable=false"],
            r"^error: validation.source: .* and sft.eval_generations = 64 reads held-out conversations",
            ["--sft.eval_generations=0"],
        ),
        (
            [*SFT_FILES, "--sft.dataset=data", "--validation.enable=false", "--validation.source=files"],
            r"^error: sft.eval_generations: 64 held-out conversations .* from validation.path, which is empty",
            ["--validation.path=held_out.jsonl"],
        ),
        (
            ["--config", "sft_qwen3_debug", "--sft.dataset=data"],
            r"^error: data.source: 'embedded' is pretraining text; sft.dataset = 'data' reads records",
            ["--data.source=files", "--data.path=chat.jsonl", "--validation.enable=false", "--sft.eval_generations=0"],
        ),
        (
            [
                *SFT_FILES,
                "--sft.dataset=data",
                "--validation.enable=false",
                "--sft.eval_generations=0",
                "--sft.generated_examples=10",
            ],
            r"^error: sft.generated_examples: is read only with sft.dataset = 'generated'",
            ["--sft.generated_examples=4096"],
        ),
        (
            GRPO_FILES,
            r"^error: data.path: 'prompts.jsonl' is not read while rl.task = 'arithmetic' .*set rl.task = 'data'",
            ["--rl.task=data", "--data.tokenizer=chatml_bytes"],
        ),
        (
            ["--config", "grpo_qwen3_debug", "--rl.eval_path=test.jsonl"],
            r"^error: rl.eval_path: applies to rl.task = 'data'",
            [*GRPO_FILES[2:], "--rl.task=data", "--data.tokenizer=chatml_bytes"],
        ),
        (
            [
                *GRPO_FILES,
                "--rl.task=data",
                "--data.tokenizer=chatml_bytes",
                "--rl.eval_path=test.jsonl",
                "--rl.held_out_fraction=0.2",
            ],
            r"^error: rl.held_out_fraction: splits data.path's records when rl.eval_path is empty",
            ["--rl.held_out_fraction=0.05"],
        ),
        (
            ["--config", "grpo_qwen3_debug", "--validation.enable=true", "--validation.path=x.jsonl"],
            r"^error: validation.enable: GRPO measures held-out accuracy .*set validation.enable = false",
            ["--validation.enable=false"],
        ),
        (
            ["--config", "llama3_debug", "--rl.group_size=4"],
            r"^error: \[rl\] applies to training.task = 'grpo', not 'language_model'",
            ["--training.task=grpo"],
        ),
        (
            ["--config", "llama3_debug", "--sft.packing=false"],
            r"^error: \[sft\] applies to training.task = 'sft', not 'language_model'",
            ["--training.task=sft", "--data.tokenizer=chatml_bytes", "--sft.dataset=generated"],
        ),
        (
            ["--config", "flux_debug", "--data.source=files", "--data.path=images"],
            r"^error: data.path: 'images' is not read by the rectified_flow task; .*flux.data_path",
            ["--data.source=embedded", "--data.path="],
        ),
        (
            ["--config", "flux_debug", "--flux.data_path=images"],
            r"^error: flux.data_path: 'images' is not read while flux.dataset = 'generated'",
            ["--flux.dataset=folder"],
        ),
        (
            [
                *SFT_FILES,
                "--sft.dataset=data",
                "--validation.enable=false",
                "--sft.eval_generations=0",
                "--data.text_field=body",
            ],
            r"^error: data.text_field: is the text of pretraining records; SFT reads sft.messages_field",
            ["--data.text_field=text"],
        ),
        (
            ["--config", "sft_qwen3_debug", "--data.document_mask=true"],
            r"^error: data.document_mask: .*SFT keeps packed examples apart by itself",
            ["--data.document_mask=false"],
        ),
        (
            ["--config", "grpo_qwen3_debug", "--data.chat_template=t.jinja"],
            r"^error: data.chat_template: renders the prompt records of rl.task = 'data'",
            ["--data.chat_template="],
        ),
        (
            ["--config", "llama3_debug", "--data.chat_template=t.jinja"],
            r"^error: data.chat_template: .* training.task 'language_model' reads no chat",
            ["--data.chat_template="],
        ),
        (
            ["--config", "llama3_debug", "--checkpoint.load_step=5"],
            r"^error: checkpoint.load_step: 5 is a step to resume from, .*set checkpoint.enable = true",
            ["--checkpoint.enable=true"],
        ),
    ],
)
def test_an_ignored_value_is_one_line_and_its_fix_runs(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str, fixed: list[str]
) -> None:
    assert re.search(message, main_error(capsys, *args, "--print-config")), message
    assert train.main([*args, *fixed, "--print-config"]) == 0, capsys.readouterr().err
