"""A task with its own config section, added from a test file without editing the package: registered
by name, its section read, checked and listed by `--help` like the core ones, and trained for two
steps by the one trainer (tests/support/toy_task.py is the task).

Bugs caught: a section that only the core's own tasks may have (the loader refusing [toy] or ignoring
its values), a registry that needs a core line per task, `--help` that lists only the shipped
sections, `--import` that does not reach the registries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.toy_task import ToyConfig, ToyTask
from titan_tpu.config import ConfigError, catalogue, help_text, load_config
from titan_tpu.tasks.registry import register_task
from titan_tpu.training.trainer import Trainer


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy task in this test's own copy of the catalogue's task table."""
    monkeypatch.setattr(catalogue, "TASKS", dict(catalogue.TASKS))
    register_task("toy", ToyTask, sections={"toy": ToyConfig})


def test_its_section_is_read_checked_and_listed(toy_registered: None) -> None:
    config = load_config("llama3_debug", ["--training.task=toy", "--toy.period=3"])
    assert config.section(ToyConfig).period == 3
    with pytest.raises(ConfigError, match=r"^command line: toy.perod: unknown key in \[toy\]; did you mean 'period'"):
        load_config("llama3_debug", ["--toy.perod=3"])
    with pytest.raises(ConfigError, match=r"^toy.period: must be >= 2, got 1$"):
        load_config("llama3_debug", ["--toy.period=1"])
    assert "[toy]  (the section of task toy)" in help_text() and "period (int, default 4)" in help_text()


def test_a_section_name_is_owned_once(toy_registered: None) -> None:
    with pytest.raises(ValueError, match=r"section \[toy\] is taken by task toy"):
        register_task("other", ToyTask, sections={"toy": ToyConfig})
    with pytest.raises(ValueError, match=r"\[model\] is a core section"):
        register_task("other", ToyTask, sections={"model": ToyConfig})


def test_it_trains_two_steps_in_the_one_trainer(toy_registered: None, tmp_path: Path, one_thread: None) -> None:
    config = load_config(
        "llama3_debug",
        [
            "--training.task=toy",
            "--toy.period=3",
            "--training.steps=2",
            "--metrics.log_freq=1",
            "--training.dtype=float32",
            "--model.overrides.n_layers=1",
            "--training.seq_len=32",
            f"--job.dump_folder={tmp_path}",
        ],
    )
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["toy/period"] == 3 for r in steps) and steps[-1]["toy/batches"] == 2
    assert all(r["loss"] > 0 for r in steps)


def test_train_py_imports_a_users_module_and_lists_its_section(tmp_path: Path) -> None:
    """`python train.py --import MODULE --help` as a user runs it; without --import there is no [toy]
    (the negative control), and a module that is not there is one line, exit 2."""
    (tmp_path / "my_tasks.py").write_text(
        "from titan_tpu.tasks.registry import register_task\n"
        "from tests.support.toy_task import ToyConfig, ToyTask\n"
        "register_task('toy', ToyTask, sections={'toy': ToyConfig})\n"
    )

    def train_py(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(REPO / "train.py"), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
        )

    listed = train_py("--import", "my_tasks", "--help")
    assert listed.returncode == 0, listed.stderr
    assert "[toy]  (the section of task toy)" in listed.stdout and "period (int, default 4)" in listed.stdout
    assert "[toy]" not in train_py("--help").stdout
    missing = train_py("--import", "not_there", "--help")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: --import not_there: no module 'not_there' in {tmp_path} or on the Python path"
    ]
