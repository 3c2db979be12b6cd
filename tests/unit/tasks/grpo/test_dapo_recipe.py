"""The shipped DAPO recipe (titan_tpu/train_configs/grpo_qwen3_8b_dapo.toml): it holds DAPO's published
setting, and its [rl] section as shipped runs: on a debug-sized Qwen 3 with the chatml_bytes
tokenizer, GSM8K-style records and a reward that depends on the sampled tokens (from random weights
the math reward is 0 everywhere, and dynamic sampling would draw in vain), one rollout batch is drawn
with dynamic sampling and the overlong punishment, and the record says what they did.

Bugs caught: a recipe that drifts from the paper's values, keys of the recipe that no longer load or
run together, an overlong punishment missing from the reward or its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.config import load_config
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.training.trainer import Trainer

RECIPE = "grpo_qwen3_8b_dapo"


def test_the_recipe_is_dapos_published_setting() -> None:
    config = load_config(RECIPE, [])
    rl = config.section(RLConfig)
    assert (rl.eps_low, rl.eps_high, rl.beta) == (0.2, 0.28, 0.0)
    assert rl.dynamic_sampling and rl.loss_aggregation == "token_mean" and rl.objective == "clipped"
    assert rl.importance_sampling_level == "token" and rl.reward_scaling == "group"
    assert rl.overlong_buffer > 0 and rl.overlong_penalty == 1.0
    assert rl.rewards == [{"fn": "math", "weight": 2.0}]  # DAPO's +1 / -1, the offset removed by the baseline
    assert (config.optimizer.lr, config.optimizer.weight_decay, config.lr_scheduler.warmup_steps) == (1e-6, 0.1, 10)
    # The rest is grpo_qwen3_8b.toml's: its records, prompts and sizes.
    base = load_config("grpo_qwen3_8b", []).section(RLConfig)
    for key in ("task", "prompt_field", "reference_field", "system_prompt", "template_switches", "group_size"):
        assert getattr(rl, key) == getattr(base, key), key
    assert (rl.prompts_per_step, rl.max_new_tokens) == (base.prompts_per_step, base.max_new_tokens)


@pytest.mark.usefixtures("one_thread")
def test_the_recipe_runs_as_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dapo_reward.py").write_text(
        "def bytes_mod_3(prompts, completions, records):\n"
        "    return [float(sum(c.encode('utf-8', 'replace')) % 3 == 0) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    records = tmp_path / "train.jsonl"
    records.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(30))
    )
    config = load_config(
        RECIPE,
        [
            "--model.flavor=debug",
            "--model.overrides={ n_layers = 1 }",
            f"--job.dump_folder={tmp_path / 'run'}",
            "--checkpoint.initial_load_path=",
            "--checkpoint.enable=false",
            "--data.tokenizer=chatml_bytes",
            f"--data.path={records}",
            f"--rl.eval_path={records}",
            '--rl.rewards=[{ fn = "dapo_reward:bytes_mod_3", weight = 2.0 }]',
            "--training.steps=1",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--training.local_batch_size=4",
            "--training.seq_len=256",
            "--rl.max_new_tokens=6",
            "--rl.overlong_buffer=3",
            "--training.dtype=float32",
            "--lr_scheduler.warmup_steps=0",
            "--metrics.eval_freq=0",
            "--activation_checkpoint.mode=none",
            "--parallelism.dp_shard=1",
            "--model.attention_block=0",
        ],
    )
    trainer = Trainer(config)
    try:
        record = trainer.train()[-1].to_dict()
    finally:
        trainer.close()
    assert record["prompts_drawn"] >= 2
    assert -1.0 <= record["reward/overlong"] < 0  # completions of 4 to 6 tokens are punished
    parts = 2.0 * record["reward/dapo_reward:bytes_mod_3"] + record["reward/overlong"]
    assert record["reward_mean"] == pytest.approx(parts)
