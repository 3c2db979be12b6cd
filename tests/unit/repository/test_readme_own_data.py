"""README.md's "Your own model and data" commands, run as shipped, on tiny inputs; and the README's length.

Each command of that section's code block runs through `bash scripts/train.sh` in a fresh folder that
holds what the commands name (chat.jsonl, prompts.jsonl, my_rewards.py, pairs.jsonl, a Hugging Face
folder my_model/), with one flag added, `--training.steps=2` (the templates train for hundreds of steps).
The script is named by its full path, since the folder the commands run in is not the repository's:
that is what the README tells a user to do, and what makes the paths in the commands the user's own.

Bugs caught: a README command that no longer runs (a template renamed, a flag that moved or is
refused, a template that does not load); scripts/train.sh reading relative paths from the repository
instead of the folder it was started in; a reward module beside the data that is not found without
PYTHONPATH; a template that is not in the README; a README grown past its budget.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.chat_fixtures import CONVERSATION, checkpoint_folder
from tests.support.paths import REPO
from titan_tpu.config.loader import CONFIG_DIR

README = REPO / "README.md"
SECTION = "## Your own model and data"
EXTRA = ["--training.steps=2"]
REWARDS = "def reward(prompts, completions, records):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
# Fails the test, rather than installing into the shared .venv, if scripts/_venv.sh finds the set-up
# out of date (only then does it call python3).
NO_SET_UP = '#!/usr/bin/env bash\necho "scripts/_venv.sh would set up .venv here: run bash scripts/test.sh first" >&2\nexit 97\n'


def section_commands(readme: str) -> list[str]:
    """The commands of the section's first code block, each on one line, comments left out."""
    section = readme.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found, f"README.md: no bash code block under {SECTION!r}"
    lines = found.group(1).replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_the_section_has_a_command_for_each_template() -> None:
    commands = section_commands(README.read_text(encoding="utf-8"))
    assert commands and all(c.startswith("bash scripts/train.sh --config ") for c in commands), commands
    used = {shlex.split(c)[3] for c in commands}
    assert (
        used
        == {p.stem for p in CONFIG_DIR.glob("*_own_*.toml")}
        == {"sft_own_data", "grpo_own_data", "dpo_own_data", "hf_own_folder"}
    )


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= 250, f"README.md has {lines} lines; the budget is 250: move detail to docs/"


def _hf_folder(folder: Path, tmp: Path) -> None:
    """A tiny Llama written by transformers, with a byte-level BPE tokenizer and Qwen 3's published
    chat template beside its weights, as a downloaded checkpoint folder holds them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = LlamaConfig(
        vocab_size=640,  # the tokenizer's 600 + its special and added tokens, rounded up
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(sizes).save_pretrained(folder)
    for file in checkpoint_folder(tmp / "tokenizer", "qwen3").iterdir():
        shutil.copy(file, folder / file.name)


def _inputs(here: Path) -> None:
    with open(here / "chat.jsonl", "w", encoding="utf-8") as chats:
        chats.writelines(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(8))
    with open(here / "prompts.jsonl", "w", encoding="utf-8") as prompts:
        prompts.writelines(json.dumps({"prompt": f"What is {n} plus {n}?"}) + "\n" for n in range(8))
    (here / "my_rewards.py").write_text(REWARDS, encoding="utf-8")
    with open(here / "pairs.jsonl", "w", encoding="utf-8") as pairs:
        pairs.writelines(
            json.dumps({"prompt": f"What is {n} plus {n}?", "chosen": str(2 * n), "rejected": str(2 * n + 1)}) + "\n"
            for n in range(8)
        )
    _hf_folder(here / "my_model", here.parent)


@pytest.mark.slow
def test_every_command_of_the_section_runs_as_shipped(tmp_path: Path) -> None:
    here = tmp_path / "work"
    here.mkdir()
    _inputs(here)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(NO_SET_UP)
    (stub / "python3").chmod(0o755)
    # Not on PYTHONPATH: my_rewards.py is found because it is in the folder the run starts in.
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment["PATH"] = f"{stub}:{environment['PATH']}"
    for command in section_commands(README.read_text(encoding="utf-8")):
        words = shlex.split(command)
        words[1] = str(REPO / words[1])
        done = subprocess.run([*words, *EXTRA], cwd=here, env=environment, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        runs = list((here / "outputs").glob("*/metrics.jsonl"))
        template = words[3]
        metrics = here / "outputs" / template / "metrics.jsonl"
        assert metrics.is_file(), (command, runs)
        rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [1, 2], (command, rows)
