"""A few GRPO steps of the debug Qwen 3 on prompt records, scored by a reward module the test writes into
its folder, whose function appends the prompts of each call to the module's `calls`: the form in which
the GRPO resume tests compare an uninterrupted run with one stopped at a checkpoint and restarted."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

# Rollouts of 2 prompts x 4 completions, one optimizer step each; a one-layer model in float32,
# deterministic; a record every step and a checkpoint every 2.
SETTINGS = (
    "--rl.task=data",
    "--data.source=files",
    "--data.tokenizer=chatml_bytes",
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
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
)


def run_on_records(
    tmp_path: Path, dump: Path, steps: int, reward: str, *overrides: str
) -> tuple[int, dict[int, dict[str, Any]], list[list[str]]]:
    """Train to step `steps` in `dump` (resuming from its checkpoint if it has one) on 40 records in
    tmp_path, rewarded by `reward` ('module:function', the module on the Python path). Returns the step
    it started at, each step's record, and the prompts of every reward call this run made."""
    records = tmp_path / "prompts.jsonl"
    if not records.exists():
        records.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(40)))
    module_name = reward.split(":")[0]
    module = sys.modules.get(module_name)
    if module is not None:  # imported by an earlier run of this test
        module.calls.clear()
    config = load_config(
        "grpo_qwen3_debug",
        [
            f"--job.dump_folder={dump}",
            f"--data.path={records}",
            f'--rl.rewards=[{{ fn = "{reward}" }}]',
            f"--training.steps={steps}",
            *SETTINGS,
            *overrides,
        ],
    )
    trainer = Trainer(config)
    start = trainer.step
    try:
        by_step = {r.step: r.to_dict() for r in trainer.train()}
    finally:
        trainer.close()
    return start, by_step, [list(c) for c in sys.modules[module_name].calls]


def stopped_after(straight_dump: Path, dump: Path, step: int) -> None:
    """Make `dump` a fresh dump folder holding only what the run in `straight_dump` had saved by `step`,
    as if that run had stopped after it."""
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight_dump / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
