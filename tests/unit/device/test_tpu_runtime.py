"""torch_tpu's autoload and libtpu's metadata lookup are switched off only where no TPU can be (bugs
caught: about 5 s and several log lines at every `import torch`, and minutes-long stalls at the first
backward pass, on CPU machines with torch_tpu installed; or, the other way, a TPU VM whose runtime is
never loaded or is told not to read its own environment; or the user's own setting overridden)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

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
