"""torch_tpu's autoload and libtpu's metadata lookup are switched off only where no TPU can be (bugs
caught: about 5 s and several log lines at every `import torch`, and minutes-long stalls at the first
backward pass, on CPU machines with torch_tpu installed; or, the other way, a TPU VM whose runtime is
never loaded or is told not to read its own environment; or the user's own setting overridden)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import DETERMINISTIC_DEBUG_RUN, fixed_kernels
from tests.support.paths import REPO
from titan_tpu.device import tpu_runtime

ROOT = REPO
VARIABLES = (tpu_runtime.SKIP_METADATA_VARIABLE, tpu_runtime.AUTOLOAD_VARIABLE)


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for variable in VARIABLES:  # the test set-up has already set them on a host without TPUs
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def pretend_device_files(monkeypatch: pytest.MonkeyPatch, device_file: str | None) -> None:
    pattern_of = {p: p.split("[")[0] for p in tpu_runtime.TPU_DEVICE_FILES}
    monkeypatch.setattr(
        tpu_runtime.glob,
        "glob",
        lambda pattern: [device_file] if device_file and device_file.startswith(pattern_of[pattern]) else [],
    )


def test_a_host_without_tpu_device_files_skips_the_lookup(clean_environment: pytest.MonkeyPatch) -> None:
    pretend_device_files(clean_environment, None)
    assert tpu_runtime.skip_tpu_metadata_lookup_without_chips()
    assert os.environ[tpu_runtime.SKIP_METADATA_VARIABLE] == "1"


def test_a_host_without_tpu_device_files_skips_the_backend(clean_environment: pytest.MonkeyPatch) -> None:
    pretend_device_files(clean_environment, None)
    assert tpu_runtime.skip_tpu_backend_without_chips()
    assert [os.environ[variable] for variable in VARIABLES] == ["1", "0"]


@pytest.mark.parametrize("device_file", ["/dev/accel0", "/dev/vfio/12"])
def test_a_tpu_host_is_left_alone(clean_environment: pytest.MonkeyPatch, device_file: str) -> None:
    pretend_device_files(clean_environment, device_file)
    assert not tpu_runtime.skip_tpu_metadata_lookup_without_chips()
    assert not tpu_runtime.skip_tpu_backend_without_chips()
    assert not [variable for variable in VARIABLES if variable in os.environ]


def test_the_users_own_settings_are_kept(clean_environment: pytest.MonkeyPatch) -> None:
    pretend_device_files(clean_environment, None)
    clean_environment.setenv(tpu_runtime.SKIP_METADATA_VARIABLE, "false")
    clean_environment.setenv(tpu_runtime.AUTOLOAD_VARIABLE, "1")
    assert not tpu_runtime.skip_tpu_metadata_lookup_without_chips()
    assert not tpu_runtime.skip_tpu_backend_without_chips()
    assert [os.environ[variable] for variable in VARIABLES] == ["false", "1"]


# What an entry point does: decide, then import torch; reports whether torch loaded torch_tpu.
ENTRY_POINT = """
import json, sys
from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips
skip_tpu_backend_without_chips()
import torch
print(json.dumps("torch_tpu" in sys.modules))
"""


@pytest.mark.tpu
@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="torch_tpu is not installed")
@pytest.mark.skipif(tpu_runtime.host_has_tpu_device_files(), reason="this host has TPU device files")
@pytest.mark.parametrize("users_autoload, loaded", [(None, False), ("1", True)])
def test_entry_points_import_torch_without_torch_tpu_here(users_autoload: str | None, loaded: bool) -> None:
    """Against the real torch and torch_tpu, in a fresh interpreter: the decision lands before torch
    is imported (catches `titan_tpu.device` importing torch on its way to `tpu_runtime`), and a
    user's TORCH_DEVICE_BACKEND_AUTOLOAD=1 still loads torch_tpu."""
    env = {key: value for key, value in os.environ.items() if key not in VARIABLES}
    if users_autoload is not None:
        env[tpu_runtime.AUTOLOAD_VARIABLE] = users_autoload
    done = subprocess.run(
        [sys.executable, "-c", ENTRY_POINT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is loaded


# What torch_tpu and libtpu print when `import torch` loads them on a host without chips: TorchTPU's
# tcmalloc warning, absl's preamble, libtpu's PJRT plugin line, its device-count warning.
TPU_NOISE = re.compile(r"TorchTpu|tcmalloc|absl::|pjrt_api|libtpu|tpu_hooks")


def _fresh_shell_environment() -> dict[str, str]:
    """This environment without the variables the test set-up (tests/conftest.py) has set, as a new
    shell on this host has it."""
    return {key: value for key, value in os.environ.items() if key not in VARIABLES}


def test_the_startup_hook_line_decides_and_is_harmless_without_titan_tpu(tmp_path: Path) -> None:
    """The .pth line as `site` runs it, in an interpreter without this environment's site-packages
    (-S): it decides as the entry points do where titan_tpu imports (catches a line `site` does not
    run, or one that names a moved function, or that loads torch in every interpreter), and does
    nothing, silently, where titan_tpu is gone (catches a leftover hook printing an error at every
    start-up after `pip uninstall titan_tpu`)."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    assert tpu_runtime.install_startup_hook(str(site_dir)) == str(site_dir / tpu_runtime.STARTUP_HOOK_FILE)
    probe = (
        f"import json, os, site, sys; site.addsitedir({str(site_dir)!r}); "
        f"print(json.dumps([os.environ.get(v) for v in {list(VARIABLES)!r}] + ['torch' in sys.modules]))"
    )
    decided = [None, None] if tpu_runtime.host_has_tpu_device_files() else ["1", "0"]
    # titan_tpu importable from the folder, or not; torch never loaded (every interpreter runs the line)
    for cwd, expected in ((ROOT, [*decided, False]), (tmp_path, [None, None, False])):
        done = subprocess.run(
            [sys.executable, "-S", "-c", probe],
            cwd=cwd,
            env=_fresh_shell_environment(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (done.returncode, done.stderr) == (0, "")
        assert json.loads(done.stdout) == expected


# The hook as installed in this environment (scripts/_venv.sh), against the real torch and torch_tpu.
requires_torch_tpu_here = pytest.mark.skipif(
    importlib.util.find_spec("torch_tpu") is None or tpu_runtime.host_has_tpu_device_files(),
    reason="torch_tpu is not installed, or this host has TPU device files (where it must load)",
)
HOOK_MISSING = (
    "is the startup hook installed in this environment? scripts/_venv.sh installs it: "
    "python -c 'from titan_tpu.device.tpu_runtime import install_startup_hook; install_startup_hook()'"
)


@pytest.mark.tpu
@requires_torch_tpu_here
def test_a_plain_import_torch_here_is_quiet_and_skips_torch_tpu() -> None:
    """`python -c "import torch"` in a new shell of this environment, before any project code runs
    (catches the about 2.5 s and 4 log lines of torch_tpu's autoload coming back for a user's own
    script, and for torchrun's agent, which would pass TORCH_DEVICE_BACKEND_AUTOLOAD=1 to every
    worker)."""
    done = subprocess.run(
        [sys.executable, "-c", "import json, sys, torch; print(json.dumps('torch_tpu' in sys.modules))"],
        cwd=ROOT,
        env=_fresh_shell_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not TPU_NOISE.findall(done.stderr), f"{HOOK_MISSING}\n{done.stderr[-2000:]}"
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False, HOOK_MISSING


@pytest.mark.slow
@pytest.mark.tpu
@requires_torch_tpu_here
def test_torchrun_of_train_py_prints_no_tpu_lines(tmp_path: Path) -> None:
    """The README's `torchrun --nproc_per_node=2 train.py` from a new shell, one step: no line of
    torch_tpu or libtpu from the agent or the workers (catches the about 20 lines and seconds of CPU
    on a host without chips when the agent's torch loads torch_tpu and hands the workers
    TORCH_DEVICE_BACKEND_AUTOLOAD=1)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"]
    command += [*DETERMINISTIC_DEBUG_RUN, *fixed_kernels("llama3_debug"), "--training.steps=1"]
    command.append(f"--job.dump_folder={tmp_path}")
    env = {**_fresh_shell_environment(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert (tmp_path / "metrics.jsonl").exists(), output[-2000:]  # it trained
    assert not TPU_NOISE.findall(output), f"{HOOK_MISSING}\n{output[-4000:]}"
