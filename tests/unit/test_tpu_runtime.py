"""The libtpu metadata lookup is switched off only where no TPU can be (bug caught: minutes-long
stalls at the first backward pass on CPU machines with torch_tpu installed; or, the other way, a
TPU VM whose runtime is told not to read its own environment)."""

from __future__ import annotations

import pytest

from titan_tpu.device import tpu_runtime


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(tpu_runtime.SKIP_METADATA_VARIABLE, raising=False)
    return monkeypatch


def test_a_host_without_tpu_device_files_skips_the_lookup(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setattr(tpu_runtime.glob, "glob", lambda pattern: [])
    assert tpu_runtime.skip_tpu_metadata_lookup_without_chips()
    assert tpu_runtime.os.environ[tpu_runtime.SKIP_METADATA_VARIABLE] == "1"


@pytest.mark.parametrize("device_file", ["/dev/accel0", "/dev/vfio/12"])
def test_a_tpu_host_is_left_alone(clean_environment: pytest.MonkeyPatch, device_file: str) -> None:
    pattern_of = {p: p.split("[")[0] for p in tpu_runtime.TPU_DEVICE_FILES}
    clean_environment.setattr(
        tpu_runtime.glob, "glob", lambda pattern: [device_file] if device_file.startswith(pattern_of[pattern]) else []
    )
    assert not tpu_runtime.skip_tpu_metadata_lookup_without_chips()
    assert tpu_runtime.SKIP_METADATA_VARIABLE not in tpu_runtime.os.environ


def test_the_users_own_setting_is_kept(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setattr(tpu_runtime.glob, "glob", lambda pattern: [])
    clean_environment.setenv(tpu_runtime.SKIP_METADATA_VARIABLE, "false")
    assert not tpu_runtime.skip_tpu_metadata_lookup_without_chips()
    assert tpu_runtime.os.environ[tpu_runtime.SKIP_METADATA_VARIABLE] == "false"
