"""Config loading: typed overrides, model overrides, and one clear line with exit status 2 for every
bad input. Error paths run through `train.main` in-process (torch is imported once per session); two
subprocess tests check the real entry point, with and without torch loaded. Registry names are
checked by every entry point after loading, never by `load_config`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import train
from tests.support.paths import REPO
from titan_tpu.config import ConfigError, help_text, load_config, to_toml
from titan_tpu.config.loader import CONFIG_DIR
from titan_tpu.models.registry import get_model_spec
from titan_tpu.plan.__main__ import main as plan_main
from titan_tpu.training.registered_names import check_registered_names

ROOT = REPO


def run_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def main_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run train.main in-process; assert exit 2 with exactly one line on stderr and return it."""
    assert train.main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0]


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


def test_new_keys_have_their_defaults() -> None:
    config = load_config(None, [])
    assert (config.training.dtype, config.training.task, config.metrics.eval_freq) == ("auto", "auto", 0)
    assert config.model.overrides == {}
    explicit = load_config(None, ["--training.task=language_model", "--metrics.eval_freq=50"])
    assert (explicit.training.task, explicit.metrics.eval_freq) == ("language_model", 50)


def test_model_overrides_from_toml_table_inline_table_and_command_line(tmp_path: Path) -> None:
    table = tmp_path / "table.toml"
    table.write_text('[model]\nname = "llama3"\nflavor = "debug"\n[model.overrides]\nn_layers = 2\ndim = 128\n')
    inline = tmp_path / "inline.toml"
    inline.write_text('[model]\nflavor = "debug"\noverrides = { n_layers = 2, dim = 128 }\n')
    expected = {"n_layers": 2, "dim": 128}
    assert load_config(str(table), []).model.overrides == expected
    assert load_config(str(inline), []).model.overrides == expected
    # One command-line entry merges into the file's table; a whole table replaces it.
    merged = load_config(str(table), ["--model.overrides.n_heads=4", "--model.overrides.dim=64"])
    assert merged.model.overrides == {"n_layers": 2, "dim": 64, "n_heads": 4}
    replaced = load_config(str(table), ["--model.overrides={ vocab_size = 300 }"])
    assert replaced.model.overrides == {"vocab_size": 300}
    # Checked by the model registry: an integer given for a float argument is the float the model gets
    # (the resolved config shows it); the loaded config keeps what was written.
    config = load_config(None, ["--model.overrides.norm_eps=1"])
    assert type(config.model.overrides["norm_eps"]) is int
    checked = check_registered_names(config).model_overrides
    assert checked == {"norm_eps": 1.0} and type(checked["norm_eps"]) is float


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    config = load_config(
        "llama3_debug",
        [
            '--job.description=with "quotes" and \\ slash',
            "--model.overrides.n_layers=2",
            "--model.overrides.head_dim=none",
            "--model.overrides.rope_theta=1e4",
        ],
    )
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(config))
    resolved = tomllib.loads(path.read_text())
    assert resolved["job"]["description"] == 'with "quotes" and \\ slash'
    assert resolved["model"]["overrides"] == {"n_layers": 2, "head_dim": "none", "rope_theta": 1e4}
    assert load_config(str(path), []) == config


def test_help_lists_every_key_with_type_default_and_doc() -> None:
    text = help_text()
    for needle in (
        "[training]",
        "steps (int, default 200)",
        "Number of optimizer steps",
        'dtype ("auto" | "bfloat16" | "float32", default "auto")',
        'task (str, default "auto")',
        "overrides (table, default {})",
        "eval_freq (int, default 0)",
        "[parallelism]",
        "dp_shard",
    ):
        assert needle in text


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.steps=0"], "training.steps: must be >= 1"),
        (["--training.dtype=fp16"], "expected one of 'auto', 'bfloat16', 'float32'"),
        (["--data.source=files"], "data.path: is required"),
        (["--training.local_batch_size=4", "--training.global_batch_size=6"], "multiple of training.local_batch_size"),
        (["--training.global_batch_size=0"], "training.global_batch_size: must be >= 1, got 0"),
        (["--training.global_batch_size=-8"], "training.global_batch_size: must be >= 1, got -8"),
        (
            ["--data.path=corpus.txt"],
            "data.path: 'corpus.txt' is not read when data.source = 'embedded'; set data.source = 'files'",
        ),
        (["--metrics.eval_freq=-1"], "metrics.eval_freq: must be >= 0"),
        (["--activation_checkpoint.selective_option=x"], "'op' or a positive integer"),
        (["--training.steps.x=1"], "training.steps.x: training.steps is not a table"),
        (["--model.overrides=3"], "model.overrides: got 3, expected a table"),
    ],
)
def test_bad_values_name_key_and_allowed_values(args: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config("llama3_debug", args)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "llama3_debug", "--training.stepz=3"], "did you mean 'steps'"),
        (["--config", "llama3_debug", "--training.steps=abc"], "got 'abc', expected an integer"),
        (["--config", "nonexistent"], "--config nonexistent: no such file"),
        (["--config", "llama3_debug", "--trainin.steps=3"], "did you mean 'training'"),
        (["--config", "llama3_debug", "stray"], "stray: unrecognised argument"),
        # Registry names: a lookup failure used to be a ValueError traceback with exit status 1.
        (
            ["--model.name=lama3"],
            "model.name: unknown model 'lama3'; did you mean 'llama3'? valid: flux, hf, llama3, qwen3, qwen3_moe",
        ),
        (["--model.flavor=nope"], "model.flavor: unknown flavor 'nope' for model 'llama3'; valid: debug, 100M"),
        (
            ["--training.task=languag_model"],
            "training.task: unknown task 'languag_model'; did you mean "
            "'language_model'? valid: auto, dpo, grpo, language_model, rectified_flow",
        ),
        # Model overrides, checked against the flavor's dataclass.
        (
            ["--model.overrides.n_layer=2"],
            "model.overrides.n_layer is not a field of Llama3Args; did you mean "
            "'n_layers'? valid fields: dim, n_layers, n_heads",
        ),
        (["--model.overrides.n_layers=two"], "model.overrides.n_layers: got 'two', expected an integer"),
        (["--model.overrides.n_layers=0"], "model.overrides.n_layers: must be >= 1, got 0"),
        (
            ["--model.overrides.n_heads=6"],
            "model.overrides { n_heads = 6 } on llama3 debug: n_heads (6) must be a multiple of n_kv_heads (4)",
        ),
        (["--model.overrides.dim=100"], "dim (100) must be divisible by n_heads (8)"),
        (["--model.overrides.max_seq_len=64"], "model.overrides.max_seq_len: set from training.seq_len"),
        (["--model.overrides.rope_scaling=none"], "model.overrides.rope_scaling is a nested structure"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert expected in main_error(capsys, *args)


def test_moe_overrides_are_checked_against_the_moe_dataclass(capsys: pytest.CaptureFixture[str]) -> None:
    """Bugs caught: model.moe_impl not reaching the experts' arguments, an unknown kernel accepted,
    the same choice settable twice (model.overrides.expert_impl), a kernel choice on a model
    without experts silently ignored."""
    base = ["--model.name=qwen3_moe", "--model.flavor=debug_moe"]
    config = load_config(None, [*base, "--model.overrides.num_experts=4", "--model.moe_impl=loop"])
    assert config.model.overrides == {"num_experts": 4}
    args = get_model_spec("qwen3_moe").args_for(config)
    assert (args.num_experts, args.expert_impl) == (4, "loop")
    impl_error = main_error(capsys, *base, "--model.moe_impl=x")
    assert "model.moe_impl: got 'x', expected one of 'auto', 'grouped_mm'" in impl_error
    twice = main_error(capsys, *base, "--model.overrides.expert_impl=loop")
    assert "model.overrides.expert_impl: set from model.moe_impl on every run; set that instead" in twice
    dense = main_error(capsys, "--model.moe_impl=loop")
    assert "model.moe_impl = 'loop': model llama3 has no expert kernels to choose; leave it 'auto'" in dense
    assert "top_k must be in [1, num_experts=1], got 2" in main_error(capsys, *base, "--model.overrides.num_experts=1")


def test_toml_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nlearning_rate = 1.0\n")
    line = main_error(capsys, "--config", str(bad))
    assert str(bad) in line and "training.learning_rate: unknown key" in line
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\nsteps = 3\n")
    assert "not valid TOML" in main_error(capsys, "--config", str(broken))
    # A TOML string is not a number, even though the same text on the command line would be.
    quoted = tmp_path / "quoted.toml"
    quoted.write_text('[training]\nsteps = "3"\n')
    assert "training.steps: got '3', expected an integer" in main_error(capsys, "--config", str(quoted))


def test_help_and_print_config_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main(["--help"]) == 0
    assert "usage: train.py" in capsys.readouterr().out
    assert train.main(["--config", "llama3_debug", "--training.steps=7", "--print-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["training"]["steps"] == 7


def test_entry_point_exits_2_before_torch_loads() -> None:
    result = run_train("--config", "llama3_debug", "--training.stepz=3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: command line: training.stepz: unknown key in [training]; did you mean 'steps'? valid keys: "
        "steps, seq_len, global_batch_size, local_batch_size, dtype, task, max_norm, seed, deterministic"
    ]


def test_entry_point_reports_a_registry_error_without_a_traceback() -> None:
    # Loading torch may print the accelerator plugin's own notices first; the error is the last line.
    result = run_train("--config", "llama3_debug", "--model.name=nope")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: model.name: unknown model 'nope'; valid:")


def test_loading_leaves_registry_names_to_the_entry_points() -> None:
    """`load_config` checks only what the config alone tells; the registry check resolves the names:
    the family, and `training.task = "auto"` as the family's task. The bug this catches: the loader
    looking names up itself, which makes the configuration import the models (and torch)."""
    config = load_config(None, ["--model.name=nope", "--training.task=nope"])
    assert (config.model.name, config.training.task) == ("nope", "nope")
    registered = check_registered_names(load_config("flux_debug", []))
    assert (registered.spec.name, registered.task) == ("flux", "rectified_flow")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model.name=lama3"], "error: model.name: unknown model 'lama3'; did you mean 'llama3'? valid: "),
        (
            ["--model.flavor=Debug"],
            "error: model.flavor: unknown flavor 'Debug' for model 'llama3'; did you mean 'debug'? valid: ",
        ),
        (["--training.task=grp"], "error: training.task: unknown task 'grp'; did you mean 'grpo'? valid: auto, "),
    ],
)
def test_the_planner_rejects_a_bad_registry_name_in_one_line(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The planner reads the same config as train.py and checks its names the same way (the bug: with
    the check moved out of load_config, a planner that skipped it planned an unknown task)."""
    assert plan_main(["--config", "llama3_debug", "--chips", "v6e-8", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
