"""GRPO on your own prompt records (`rl.task = "data"`): prompts rendered with the checkpoint's chat
template and generation prompt as transformers renders them, a fixed held-out split or a separate
eval file, bad records refused with their line, and a short run on a records file with the math
reward and a reward of your own.

Bugs caught: prompts without the generation prompt (the policy continues the user's turn), a system
prompt added twice or never, the thinking switch ignored, completions that never stop (a stop text
of "\\n" in a chat task), held-out prompts trained on, a record without its prompt or reference
found mid-run (or not at all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.chat_fixtures import checkpoint_folder
from titan_tpu.config import ConfigError, load_config
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.tasks.grpo.prompts import prompt_set
from titan_tpu.training.trainer import Trainer

transformers = pytest.importorskip("transformers")

QUESTIONS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {
        "question": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 4 + 4?"}],
        "answer": "8",
    },
] + [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(10, 30)]


def _records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(tmp_path: Path, tokenizer: str, *extra: str):
    return load_config(
        "grpo_qwen3_debug",
        [
            f"--job.dump_folder={tmp_path / 'run'}",
            "--rl.task=data",
            "--data.source=files",
            f"--data.path={_records(tmp_path / 'train.jsonl', QUESTIONS)}",
            f"--data.tokenizer={tokenizer}",
            "--rl.prompt_field=question",
            '--rl.rewards=[{ fn = "math" }]',
            *extra,
        ],
    )


def test_prompts_are_rendered_as_transformers_renders_them(tmp_path: Path) -> None:
    folder = checkpoint_folder(tmp_path, "qwen3")
    system = "You are a careful calculator."
    config = _config(
        tmp_path,
        str(folder),
        f"--rl.system_prompt={system}",
        "--rl.template_switches={ enable_thinking = false }",
        "--rl.held_out_fraction=0.1",
    )
    prompts = prompt_set(config, build_tokenizer(str(folder)))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    by_answer = {p.record["answer"]: p for p in [*prompts.train, *prompts.held_out]}
    expected = {
        "5": [{"role": "system", "content": system}, {"role": "user", "content": "What is 2 + 3?"}],
        "8": QUESTIONS[1]["question"],  # brings its own system turn: the configured one is not added
    }
    for answer, messages in expected.items():
        ids = reference.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=False, tokenize=True, return_dict=False
        )
        assert by_answer[answer].ids == list(ids)
        assert by_answer[answer].text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Negative control: without the switch the template leaves the thinking block to the model.
    plain = reference.apply_chat_template(expected["5"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert by_answer["5"].ids != list(plain)
    assert prompts.stop_text == "<|im_end|>"  # auto: the template's end of turn, not a newline
    assert len(prompts.held_out) == 2 and len(prompts.train) == len(QUESTIONS) - 2
    assert not {p.place for p in prompts.train} & {p.place for p in prompts.held_out}
    again = prompt_set(config, build_tokenizer(str(folder)))
    assert [p.place for p in again.held_out] == [p.place for p in prompts.held_out]


def test_an_eval_file_is_the_held_out_set(tmp_path: Path) -> None:
    eval_path = _records(tmp_path / "eval.jsonl", [{"question": "What is 1 + 1?", "answer": "2"}])
    config = _config(tmp_path, "chatml_bytes", f"--rl.eval_path={eval_path}")
    prompts = prompt_set(config, build_tokenizer("chatml_bytes"))
    assert len(prompts.train) == len(QUESTIONS)
    assert [p.place for p in prompts.held_out] == [f"{eval_path}:1"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"prompt": "What is 2 + 3?", "answer": "5"},
            r"train.jsonl:3: rl.prompt_field 'question' must be a non-empty string or list of turns \(the record has answer, prompt\)",
        ),
        ({"question": "What is 2 + 3?"}, r"train.jsonl:3: no 'answer' field \(rl.reference_field\)"),
        (
            {"question": [{"role": "bot", "content": "hi"}], "answer": "1"},
            r"train.jsonl:3: turn 0 has unknown role 'bot'",
        ),
    ],
)
def test_a_bad_prompt_record_is_one_line_with_its_place(tmp_path: Path, record: dict, message: str) -> None:
    config = _config(tmp_path, "chatml_bytes")
    _records(tmp_path / "train.jsonl", [*QUESTIONS[:2], record])
    with pytest.raises(ConfigError, match=message):
        prompt_set(config, build_tokenizer("chatml_bytes"))


REWARD_MODULE = """
seen = []

def short(prompts, completions, records):
    seen.append(len(completions))
    return [1.0 / (1 + len(c)) for c in completions]
"""


def test_a_grpo_run_on_records_logs_each_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "grpo_user_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _config(
        tmp_path,
        "chatml_bytes",
        '--rl.rewards=[{ fn = "math" }, { fn = "grpo_user_reward:short", weight = 0.5 }]',
        "--training.steps=2",
        "--rl.prompts_per_step=2",
        "--rl.group_size=4",
        "--training.global_batch_size=8",
        "--rl.max_new_tokens=8",
        "--training.seq_len=128",
        "--model.overrides={ n_layers = 1 }",
        "--training.dtype=float32",
        "--metrics.log_freq=1",
        "--metrics.eval_freq=2",
        "--rl.eval_prompts=2",
    )
    trainer = Trainer(config)
    try:
        records = [r.to_dict() for r in trainer.train()]
    finally:
        trainer.close()
    import grpo_user_reward

    first = records[0]
    assert first["reward_mean"] == pytest.approx(first["reward/math"] + 0.5 * first["reward/grpo_user_reward:short"])
    assert 0 < first["reward/grpo_user_reward:short"] <= 1
    assert grpo_user_reward.seen[0] == 8  # one call for the whole rollout batch of 2 x 4 completions
    assert "heldout_accuracy" in records[-1]


@pytest.mark.parametrize(
    ("config_name", "model_name", "debug_flavor"),
    [("grpo_qwen3_8b", "qwen3", "debug"), ("grpo_qwen3_moe_30b_a3b", "qwen3_moe", "debug_moe")],
)
def test_a_shipped_grpo_config_runs_on_a_checkpoint_folder(
    tmp_path: Path, config_name: str, model_name: str, debug_flavor: str
) -> None:
    """A shipped GRPO config as it is, with its paths pointed at a debug-sized folder of its family
    (weights, tokenizer, published template; the MoE's debug flavor for the 30B-A3B) and GSM8K-style
    records: one rollout, math and format rewards. Catches a shipped config that no longer loads, or
    rewards and records that do not fit each other."""
    import torch

    from titan_tpu.checkpoint.hf_export import export_model_to_hf
    from titan_tpu.data.chat_tokenizer import tokenizer_export_files
    from titan_tpu.models.registry import get_model_spec

    folder = tmp_path / "checkpoint"
    # One process: no room for the 30B-A3B's ep 8 (expert-parallel GRPO: test_grpo_fsdp.py).
    small = [f"--model.flavor={debug_flavor}", "--model.overrides={ vocab_size = 640 }", "--parallelism.ep=1"]
    spec = get_model_spec(model_name)
    args = spec.build_args(debug_flavor, {"vocab_size": 640})
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    tokenizer_files = tokenizer_export_files(str(checkpoint_folder(tmp_path / "tokenizer", "qwen3")))
    export_model_to_hf(model, folder, spec.state_dict_adapter, args, extra_files=tokenizer_files)
    problems = [{"question": q["question"], "answer": f"Add them.\n#### {q['answer']}"} for q in QUESTIONS]
    config = load_config(
        config_name,
        [
            *small,
            f"--job.dump_folder={tmp_path / 'run'}",
            f"--checkpoint.initial_load_path={folder}",
            f"--data.tokenizer={folder}",
            f"--data.path={_records(tmp_path / 'train.jsonl', problems)}",
            f"--rl.eval_path={_records(tmp_path / 'test.jsonl', problems[:2])}",
            "--checkpoint.enable=false",
            "--training.steps=1",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--training.local_batch_size=4",
            "--rl.max_new_tokens=8",
            "--training.dtype=float32",
            "--metrics.eval_freq=1",
            "--activation_checkpoint.mode=none",
        ],
    )
    assert config.model.name == model_name
    trainer = Trainer(config)
    try:
        record = trainer.train()[-1].to_dict()
    finally:
        trainer.close()
    assert {"reward/math", "reward/format", "heldout_accuracy", "kl"} <= set(record)
