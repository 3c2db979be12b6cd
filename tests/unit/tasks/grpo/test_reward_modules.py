"""Your own reward module (`module:function` in rl.rewards) is found where you keep it, and a failure in
it keeps its traceback.

Bugs caught: a reward file beside the config, or in the folder the run was started from, that is not
found because neither folder is on the Python path (train.py run by its path puts the repository
there instead); the config's folder not handed on to where rewards are imported; a module that is not
found reported without the folders searched; an exception raised in your reward, or while your
module is imported, that reaches the user as one line without the file and line it came from."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import REPO
from tests.support.reward_batches import batch_of
from titan_tpu.config import ConfigError, load_config
from titan_tpu.config.loader import CONFIG_DIR
from titan_tpu.tasks.grpo.rewards import RewardError, build_rewards, score
from titan_tpu.tasks.grpo.user_code import search_folders

RAISES_ON_LINE_3 = """def score(prompts, completions, records):
    values = [1.0 for c in completions]
    raise KeyError('answer')
"""


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The folders a test's import puts on sys.path, and the modules it imports from its own folder,
    do not outlive it (the package's modules it imports on the way stay: they are shared)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _config_in(folder: Path) -> Path:
    """A copy of the GRPO debug config in `folder`, as a user keeps one beside their files."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "my_run.toml"
    path.write_text((CONFIG_DIR / "grpo_qwen3_debug.toml").read_text())
    return path


def _scores(fn: str, folders: list[Path]) -> list[float]:
    rewards = build_rewards([{"fn": fn}], "answer", "\n", folders)
    return score(rewards, batch_of(["1\n", "22\n"], ["1", "2"]))[fn]


@pytest.mark.usefixtures("isolated_imports")
def test_a_module_beside_the_config_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = _config_in(tmp_path / "project")
    (tmp_path / "project" / "beside_config.py").write_text("def score(p, c, r):\n    return [len(x) for x in c]\n")
    monkeypatch.chdir(tmp_path)  # elsewhere: only the config's folder holds it
    config = load_config(str(config_path), [])
    assert config.source_file == config_path.resolve()
    assert search_folders(config) == [config_path.parent.resolve(), tmp_path.resolve()]
    assert _scores("beside_config:score", search_folders(config)) == [2.0, 3.0]


@pytest.mark.usefixtures("isolated_imports")
def test_a_module_in_the_current_folder_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in_current.py").write_text(
        "import in_current_helper\n\ndef score(p, c, r):\n    return in_current_helper.f(c)\n"
    )
    (tmp_path / "in_current_helper.py").write_text("def f(c):\n    return [0.5 for _ in c]\n")
    monkeypatch.chdir(tmp_path)
    config = load_config("grpo_qwen3_debug", [])  # a shipped config: its folder holds no module of yours
    assert search_folders(config) == [CONFIG_DIR.resolve(), tmp_path.resolve()]
    # ... and the module's own import of the file beside it works too, as in a script.
    assert _scores("in_current:score", search_folders(config)) == [0.5, 0.5]


@pytest.mark.usefixtures("isolated_imports")
def test_the_configs_folder_comes_before_the_current_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = _config_in(tmp_path / "project")
    (tmp_path / "project" / "in_both.py").write_text("def score(p, c, r):\n    return [1.0 for _ in c]\n")
    (tmp_path / "in_both.py").write_text("def score(p, c, r):\n    return [0.0 for _ in c]\n")
    monkeypatch.chdir(tmp_path)
    assert _scores("in_both:score", search_folders(load_config(str(config_path), []))) == [1.0, 1.0]


def test_a_config_from_no_file_searches_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(None, [])
    assert config.source_file is None and search_folders(config) == [tmp_path.resolve()]


@pytest.mark.usefixtures("isolated_imports")
def test_a_module_found_nowhere_is_one_line_with_the_folders_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        build_rewards([{"fn": "nowhere_reward:score"}], "answer", "\n", [tmp_path / "a", tmp_path / "b"])
    message = str(caught.value)
    assert message == (
        f"rl.rewards[0].fn: no module 'nowhere_reward' on the Python path or in {tmp_path / 'a'} or in "
        f"{tmp_path / 'b'}; put nowhere_reward.py next to the config or in the folder you run from, or add "
        "its folder to PYTHONPATH"
    )


@pytest.mark.usefixtures("isolated_imports")
def test_a_reward_that_raises_keeps_its_traceback(tmp_path: Path) -> None:
    module = tmp_path / "raising_reward.py"
    module.write_text(RAISES_ON_LINE_3)
    with pytest.raises(RewardError) as caught:
        _scores("raising_reward:score", [tmp_path])
    first, *rest = str(caught.value).splitlines()
    assert first == "reward raising_reward:score raised KeyError: 'answer' (on 2 completions)"
    # Python's own report from the reward's frame on: the user's file and line, none of ours.
    assert rest == [
        "Traceback (most recent call last):",
        f'  File "{module}", line 3, in score',
        "    raise KeyError('answer')",
        "KeyError: 'answer'",
    ]


@pytest.mark.usefixtures("isolated_imports")
@pytest.mark.parametrize(
    ("body", "first_line", "place"),
    [
        (
            "x = 1\nimport no_such_dependency_here\n",
            "ModuleNotFoundError: No module named 'no_such_dependency_here'",
            2,
        ),
        ("x = 1\ny = 1 / 0\n", "ZeroDivisionError: division by zero", 2),
        ("def score(p, c, r:\n    pass\n", "SyntaxError:", 1),
    ],
)
def test_a_module_that_fails_on_import_keeps_its_traceback(
    tmp_path: Path, body: str, first_line: str, place: int
) -> None:
    module = tmp_path / "failing_import.py"
    module.write_text(body)
    with pytest.raises(ConfigError) as caught:
        build_rewards([{"fn": "failing_import:score"}], "answer", "\n", [tmp_path])
    first, *rest = str(caught.value).splitlines()
    assert first.startswith(f"rl.rewards[0].fn: importing 'failing_import' raised {first_line}"), first
    assert f'File "{module}", line {place}' in "\n".join(rest)
    assert "importlib" not in "\n".join(rest) and "user_code.py" not in "\n".join(rest)


def test_train_py_run_by_its_path_finds_the_reward_in_the_current_folder_and_shows_its_line(tmp_path: Path) -> None:
    """The whole path: train.py started from another folder (as scripts/train.sh does), the reward
    module in that folder and not on PYTHONPATH, raising in its first rollout: exit 2, the one error
    line, and the module's file and line in what the user sees."""
    (tmp_path / "cwd_reward.py").write_text(RAISES_ON_LINE_3)
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--config",
            "grpo_qwen3_debug",
            f"--job.dump_folder={tmp_path / 'run'}",
            '--rl.rewards=[{ fn = "cwd_reward:score" }]',
            "--training.steps=1",
            "--rl.prompts_per_step=2",
            "--rl.group_size=4",
            "--training.global_batch_size=8",
            "--model.overrides={ n_layers = 1 }",
            "--training.dtype=float32",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    expected = "error: reward cwd_reward:score raised KeyError: 'answer' (on 8 completions)"
    assert errors == [expected], done.stderr[-3000:]
    assert f'File "{tmp_path / "cwd_reward.py"}", line 3, in score' in done.stderr
