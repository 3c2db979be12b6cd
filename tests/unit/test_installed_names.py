"""The installed distribution owns one import name, `titan_tpu`, and nothing else (setup.py).

Run from a folder outside the repository, so that only what `pip install -e .` installed is
importable. The bug this catches: installing the repository's models/ as a top-level `models`
package (as pyproject.toml's `packages.find` did), which collides with any other project's
`models`, whichever of the two comes first on sys.path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # the probe needs no TPU backend
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_models_is_not_a_top_level_name(tmp_path: Path) -> None:
    result = _python("import models", tmp_path)
    assert result.returncode != 0 and "No module named 'models'" in result.stderr


def test_a_package_of_ones_own_named_models_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("OWNER = 'mine'\n")
    probe = (
        "import models, titan_tpu.models as ours, titan_tpu.config.loader as loader\n"
        "import models as again\n"
        "print(again.OWNER, 'llama3' in ours.model_names(), (loader.CONFIG_DIR / 'llama3_debug.toml').is_file())"
    )
    result = _python(probe, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["mine", "True", "True"]
