"""Config loading: typed overrides, and one clear line with exit status 2 for every bad input."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError, help_text, load_config, to_toml
from titan_tpu.config.loader import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]


def run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_overrides_are_typed_in_both_spellings() -> None:
    config = load_config(
        "llama3_debug",
        ["--training.steps=3", "--optimizer.lr", "1e-3", "--checkpoint.enable", "--data.shuffle=false"],
    )
    assert config.training.steps == 3
    assert config.optimizer.lr == pytest.approx(1e-3)
    assert config.checkpoint.enable is True
    assert config.data.shuffle is False
    assert config.model.flavor == "debug"


def test_config_found_with_or_without_suffix_or_as_path() -> None:
    by_name = load_config("llama3_debug", [])
    by_file = load_config("llama3_debug.toml", [])
    by_path = load_config(str(CONFIG_DIR / "llama3_debug.toml"), [])
    assert by_name == by_file == by_path


def test_every_shipped_config_loads() -> None:
    for path in sorted(CONFIG_DIR.glob("*.toml")):
        load_config(str(path), [])


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    config = load_config("llama3_debug", ["--job.description=with \"quotes\" and \\ slash"])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(config))
    assert tomllib.loads(path.read_text())["job"]["description"] == 'with "quotes" and \\ slash'
    assert load_config(str(path), []) == config


def test_help_lists_every_key_with_type_default_and_doc() -> None:
    text = help_text()
    for needle in ("[training]", "steps (int, default 200)", "Number of optimizer steps",
                   'dtype ("bfloat16" | "float32"', "[parallelism]", "dp_shard"):
        assert needle in text


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.steps=0"], "training.steps: must be >= 1"),
        (["--training.dtype=fp16"], "expected one of 'bfloat16', 'float32'"),
        (["--data.source=files"], "data.path: is required"),
        (["--training.local_batch_size=4", "--training.global_batch_size=6"], "multiple of training.local_batch_size"),
        (["--activation_checkpoint.selective_option=x"], "'op' or a positive integer"),
    ],
)
def test_bad_values_name_key_and_allowed_values(args: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config("llama3_debug", args)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "llama3_debug", "--training.stepz=3"], "did you mean 'steps'"),
        (["--config", "llama3_debug", "--training.steps=abc"], "got 'abc', expected an integer"),
        (["--config", "nonexistent"], "--config nonexistent: no such file"),
        (["--config", "llama3_debug", "--trainin.steps=3"], "did you mean 'training'"),
        (["--config", "llama3_debug", "stray"], "stray: unrecognised argument"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(args: list[str], expected: str) -> None:
    result = run_train(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_unknown_key_in_toml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nlearning_rate = 1.0\n")
    result = run_train("--config", str(bad))
    assert result.returncode == 2
    line = result.stderr.strip()
    assert str(bad) in line and "training.learning_rate: unknown key" in line
    assert "\n" not in line


def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text("[training\nsteps = 3\n")
    result = run_train("--config", str(bad))
    assert result.returncode == 2
    assert "not valid TOML" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_help_and_print_config_exit_0() -> None:
    assert "usage: train.py" in run_train("--help").stdout
    printed = run_train("--config", "llama3_debug", "--training.steps=7", "--print-config")
    assert printed.returncode == 0
    assert tomllib.loads(printed.stdout)["training"]["steps"] == 7
