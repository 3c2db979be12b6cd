"""scripts/_venv.sh, run against a stand-in `python3` whose venv's pip and python only log their
arguments: what it installs, with which arguments, and when it installs again. Nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

# `python3 -m venv DIR` makes DIR/bin/pip, a script that appends its arguments to pip.log, and
# DIR/bin/python, which appends "python" and its arguments.
FAKE_PYTHON3 = """#!/usr/bin/env bash
set -e
[ "$1 $2" = "-m venv" ] || { echo "unexpected: $*" >&2; exit 1; }
mkdir -p "$3/bin"
printf '#!/usr/bin/env bash\\necho "$*" >> %q\\n' "$3/../pip.log" > "$3/bin/pip"
printf '#!/usr/bin/env bash\\necho "python $*" >> %q\\n' "$3/../pip.log" > "$3/bin/python"
chmod +x "$3/bin/pip" "$3/bin/python"
"""
INSTALL_STARTUP_HOOK = "python -c from titan_tpu.device.tpu_runtime import install_startup_hook; install_startup_hook()"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "scripts" / "_venv.sh", root / "scripts" / "_venv.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(0o755)
    return root


def set_up(root: Path, **env: str) -> list[str]:
    """Source _venv.sh as train.sh does; the pip command lines it ran, one string each."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_")}
    environment["PATH"] = f"{root.parent / 'bin'}:{environment['PATH']}"
    environment.update(env)
    log = root / "pip.log"
    log.unlink(missing_ok=True)
    subprocess.run(
        ["bash", "-c", f"source {root / 'scripts' / '_venv.sh'}"],
        env=environment,
        check=True,
        capture_output=True,
        text=True,
    )
    return log.read_text().splitlines() if log.exists() else []


def test_default_installs_pinned_torch_then_test_and_tpu_extras_then_the_startup_hook(checkout: Path) -> None:
    """The hook last, by the venv's own python, once titan_tpu is installed (catches a set-up whose
    venv loads torch_tpu in a bare torchrun's agent on a host without chips)."""
    assert set_up(checkout) == [
        "install --quiet --upgrade pip",
        "install --quiet torch==2.13.0",
        f"install --quiet -e {checkout}[test,tpu]",
        INSTALL_STARTUP_HOOK,
    ]
    assert set_up(checkout) == []  # set up once: a second run installs nothing


def test_torch_build_is_the_users_choice(checkout: Path) -> None:
    calls = set_up(
        checkout,
        TITAN_TORCH="torch==2.12.1",
        TITAN_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu --no-cache-dir",
    )
    # Each extra argument reaches pip as its own word, on the torch install only.
    assert calls[1] == ("install --quiet --index-url https://download.pytorch.org/whl/cpu --no-cache-dir torch==2.12.1")
    assert calls[2] == f"install --quiet -e {checkout}[test,tpu]"


def test_changes_to_the_set_up_install_again(checkout: Path) -> None:
    set_up(checkout)
    with open(checkout / "scripts" / "_venv.sh", "a") as script:
        script.write("# a changed set-up script\n")
    assert len(set_up(checkout)) == 4
    with open(checkout / "pyproject.toml", "a") as project:
        project.write("\n# a changed dependency list\n")
    assert len(set_up(checkout)) == 4
    assert len(set_up(checkout, TITAN_TORCH="torch==2.12.1")) == 4
    stamps = list((checkout / ".venv").glob(".installed-*"))
    assert len(stamps) == 1  # old stamps are removed, so going back installs again too
