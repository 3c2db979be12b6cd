"""GRPO resumed from a checkpoint continues as the uninterrupted run does: the same prompts reach the
rewards in the same order, and the losses and rewards of every later step are bitwise equal
(deterministic mode, one process).

Bugs caught: a prompt stream that restarts at its beginning (or skips a rollout) after a resume, a
sampling seed that depends on the process's history instead of the step, an optimizer or data state
left out of the checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why

REWARD_MODULE = """
calls = []

def token_sum(prompts, completions, records):
    calls.append(list(prompts))
    return [(sum(c.encode("utf-8", "replace")) % 5) / 4 for c in completions]
"""
COMPARED = ("loss", "grad_norm", "reward_mean", "reward/resume_reward:token_sum", "completion_length", "kl")


def _run(tmp_path: Path, dump: Path, steps: int) -> tuple[int, dict[int, dict], list[list[str]]]:
    records = tmp_path / "prompts.jsonl"
    if not records.exists():
        records.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(40)))
    module = sys.modules.get("resume_reward")
    if module is not None:
        module.calls.clear()
    config = load_config(
        "grpo_qwen3_debug",
        [
            f"--job.dump_folder={dump}",
            "--rl.task=data",
            "--data.source=files",
            f"--data.path={records}",
            "--data.tokenizer=chatml_bytes",
            '--rl.rewards=[{ fn = "resume_reward:token_sum" }]',
            f"--training.steps={steps}",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--rl.max_new_tokens=4",
            "--training.seq_len=96",
            "--model.overrides={ n_layers = 1 }",
            "--training.dtype=float32",
            "--training.deterministic=true",
            "--metrics.log_freq=1",
            "--metrics.eval_freq=0",
            "--optimizer.lr=1e-2",
            "--rl.beta=0.04",
            "--checkpoint.enable=true",
            "--checkpoint.interval=2",
        ],
    )
    trainer = Trainer(config)
    start = trainer.step
    try:
        by_step = {r.step: r.to_dict() for r in trainer.train()}
    finally:
        trainer.close()
    return start, by_step, [list(c) for c in sys.modules["resume_reward"].calls]


def test_a_resumed_grpo_run_sees_the_same_prompts_and_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "resume_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, straight, straight_prompts = _run(tmp_path, tmp_path / "a", steps=4)
    assert len(straight_prompts) == 4  # one rollout batch per optimizer step here
    # "Stopped after step 2": a fresh dump folder holding only what that run had saved by then.
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-2", tmp_path / "b" / "checkpoint" / "step-2")
    start, resumed, resumed_prompts = _run(tmp_path, tmp_path / "b", steps=4)
    assert start == 2 and sorted(resumed) == [3, 4]
    assert resumed_prompts == straight_prompts[2:]
    assert straight_prompts[2] != straight_prompts[0]  # the stream moved on: a restart at 0 would show
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == straight[step][key], (
                f"step {step} {key}: {resumed[step][key]!r} != {straight[step][key]!r}"
            )
    assert any(straight[s]["reward_std"] > 0 for s in (3, 4)), "the test reward must vary, or nothing is compared"
