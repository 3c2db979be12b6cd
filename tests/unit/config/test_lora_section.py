"""The [lora] section: its keys, and every bad input as one line with exit status 2 through train.py's
main (in-process), the ones found when the model is built included."""

from __future__ import annotations

from pathlib import Path

import pytest

import train
from titan_tpu.config import load_config


def main_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert train.main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0].removeprefix("error: ")


def test_defaults_and_overrides() -> None:
    lora = load_config("qwen3_debug", []).lora
    assert (lora.enable, lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (
        False,
        16,
        32.0,
        0.0,
        ["all-linear"],
    )
    lora = load_config("qwen3_debug", ["--lora.enable", "--lora.rank=8", "--lora.target_modules=*.wq,wv"]).lora
    assert (lora.rank, lora.target_modules) == (8, ["*.wq", "wv"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--lora.rank=8"], "lora.rank: applies when lora.enable = true; set lora.enable = true or remove it"),
        (["--lora.target_modules=wq"], "lora.target_modules: applies when lora.enable = true"),
        (["--lora.enable", "--lora.rank=0"], "lora.rank: must be >= 1, got 0"),
        (["--lora.enable", "--lora.alpha=0"], "lora.alpha: must be > 0, got 0.0"),
        (["--lora.enable", "--lora.dropout=1"], "lora.dropout: must be in [0, 1), got 1.0"),
        (["--lora.enable", "--lora.dropout=-0.1"], "lora.dropout: must be in [0, 1), got -0.1"),
        (["--lora.enable", "--lora.target_modules=all-linear,wq"], "lora.target_modules: 'all-linear' already"),
        (["--lora.enable", "--lora.target_modules="], "lora.target_modules: must name at least one module"),
        (
            ["--lora.enable", "--parallelism.pp=2"],
            "lora.enable: LoRA is not supported with parallelism.pp = 2 yet; set parallelism.pp = 1",
        ),
        (["--lora.enable", "--checkpoint.create_seed_checkpoint"], "checkpoint.create_seed_checkpoint: a LoRA run"),
    ],
)
def test_bad_input_is_one_line(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_error(capsys, "--config", "qwen3_debug", *args).startswith(expected)


def test_a_pattern_the_model_does_not_have_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    """Found when the model is built on meta, before anything is materialised: the names it has."""
    error = main_error(
        capsys,
        "--config",
        "qwen3_debug",
        f"--job.dump_folder={tmp_path}",
        "--lora.enable",
        "--lora.target_modules=q_proj",
        "--model.overrides.n_layers=1",
    )
    assert error == (
        "lora.target_modules: 'q_proj' matches no nn.Linear of model qwen3 flavor debug; its linears: "
        "wq, wk, wv, wo, w1, w2, w3, output (e.g. layers.0.attention.wq)"
    )
