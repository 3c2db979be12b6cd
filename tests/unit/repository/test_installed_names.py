"""The distribution owns one import name, `titan_tpu`, and every module is where that name says.

The bugs these catch: a folder installed under another name (the repository's `models/` once became
`titan_tpu.models` through setup.py's `package_dir`, so nothing that followed an import found the
file without an editable install); a top-level `models` package, which collides with any other
project's `models`; a wheel that leaves out a subpackage or the shipped configs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support.paths import REPO


def _python(code: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # the probe needs no TPU backend
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_models_is_not_a_top_level_name(tmp_path: Path) -> None:
    result = _python("import models", tmp_path)
    assert result.returncode != 0 and "No module named 'models'" in result.stderr


def test_a_package_of_ones_own_named_models_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("OWNER = 'mine'\n")
    probe = (
        "import models, titan_tpu.models.registry as ours, titan_tpu.config.loader as loader\n"
        "import models as again\n"
        "print(again.OWNER, 'llama3' in ours.model_names(), (loader.CONFIG_DIR / 'llama3_debug.toml').is_file())"
    )
    result = _python(probe, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["mine", "True", "True"]


def test_a_wheel_holds_the_tree_and_imports_from_its_own_files(tmp_path: Path) -> None:
    """A non-editable install: the wheel pip builds from a copy of the checkout holds every file of
    titan_tpu/ at the same path, and a process that imports from the unpacked wheel gets the model
    families and the shipped configs from there, not from the checkout."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "titan_tpu", source / "titan_tpu", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("titan_tpu-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    tree = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "titan_tpu").rglob("*")
        if path.suffix in (".py", ".toml") and "__pycache__" not in path.parts
    }
    assert tree - packed == set()

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import titan_tpu.models.llama3.model as family, titan_tpu.config.loader as loader\n"
        "print(family.__file__); print(loader.CONFIG_DIR / 'llama3_debug.toml')"
    )
    result = _python(probe, tmp_path, pythonpath=site)
    assert result.returncode == 0, result.stderr
    family_file, config_file = (Path(line) for line in result.stdout.split())
    assert family_file.is_relative_to(site) and config_file.is_relative_to(site) and config_file.is_file()
