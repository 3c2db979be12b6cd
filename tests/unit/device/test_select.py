"""Device selection and the device operations, through torch.accelerator; the real torch_tpu
package is exercised in test_tpu_package.py."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.support.paths import REPO
from titan_tpu import device as device_layer
from titan_tpu.config import ConfigError
from titan_tpu.device import memory, select

ROOT = REPO


def pretend_accelerator(monkeypatch: pytest.MonkeyPatch, device_type: str | None, count: int = 0) -> list:
    """torch.accelerator as a host with `count` devices of `device_type` shows it; returns the calls."""
    calls: list = []
    found = None if device_type is None else SimpleNamespace(type=device_type)
    accelerator = torch.accelerator
    monkeypatch.setattr(accelerator, "current_accelerator", lambda check_available=False: found)
    monkeypatch.setattr(accelerator, "device_count", lambda: count)
    monkeypatch.setattr(accelerator, "set_device_index", lambda i: calls.append(("set_device_index", i)))
    monkeypatch.setattr(accelerator, "synchronize", lambda i=None: calls.append(("synchronize", i)))
    monkeypatch.setattr(accelerator, "reset_peak_memory_stats", lambda i=None: calls.append(("reset", i)))
    monkeypatch.setattr(accelerator, "max_memory_allocated", lambda i=None: 3 * 2**30)
    return calls


def test_auto_picks_cpu_without_accelerators(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pretend_accelerator(monkeypatch, None)
    monkeypatch.setattr(select, "torch_tpu_version", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert device_layer.resolve_device_type("auto") == "cpu"
    assert caplog.records == []  # nothing to say when no accelerator package is installed
    assert device_layer.process_group_backend("cpu") == "gloo"


@pytest.mark.parametrize("device_type, backend", [("tpu", "cpu:gloo,tpu:tpu_dist"), ("cuda", "cpu:gloo,cuda:nccl")])
def test_auto_takes_the_accelerator_torch_reports(
    monkeypatch: pytest.MonkeyPatch, device_type: str, backend: str
) -> None:
    pretend_accelerator(monkeypatch, device_type, count=4)
    assert device_layer.resolve_device_type("auto") == device_type
    assert device_layer.resolve_device_type(device_type) == device_type
    assert device_layer.process_group_backend(device_type) == backend  # type: ignore[arg-type]


def test_auto_does_not_drive_an_accelerator_it_does_not_support(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pretend_accelerator(monkeypatch, "mps", count=1)
    with caplog.at_level(logging.WARNING):
        assert device_layer.resolve_device_type("auto") == "cpu"
    assert "'mps', which titan_tpu does not drive" in caplog.text
    # Said once per host: the other local ranks of a multi-process run stay quiet.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert device_layer.resolve_device_type("auto", warn=False) == "cpu"
    assert caplog.records == []


def test_accelerator_operations_go_through_torch_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a return to torch.tpu.set_device / synchronize, which TorchTPU refuses from user code."""
    calls = pretend_accelerator(monkeypatch, "tpu", count=4)
    device = device_layer.select_device("tpu", local_rank=2)
    device.synchronize()
    device.reset_peak_memory()
    assert device.peak_memory_gib() == pytest.approx(3.0)
    assert calls == [("set_device_index", 2), ("synchronize", 2), ("reset", 2)]


def test_more_local_ranks_than_devices_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_accelerator(monkeypatch, "cuda", count=4)
    with pytest.raises(ConfigError, match="local rank 4 needs cuda device 4, but this host has 4"):
        device_layer.select_device("cuda", local_rank=4)


@pytest.mark.parametrize(
    "version, device_files, autoload, message",
    [
        (None, True, None, r"the torch_tpu package is not installed \(pip install -e '.\[tpu\]'\)"),
        ("0.2.0", False, None, r"torch_tpu 0.2.0 is installed but this host has no TPU device files \(/dev/accel"),
        ("0.2.0", True, "0", "TORCH_DEVICE_BACKEND_AUTOLOAD=0 kept torch_tpu 0.2.0 from loading"),
        ("0.2.0", True, "false", "TORCH_DEVICE_BACKEND_AUTOLOAD=false kept torch_tpu 0.2.0 from loading"),
        ("0.2.0", True, None, "torch_tpu 0.2.0 sees no TPU chip on this host"),
    ],
)
def test_no_tpu_names_the_reason(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    version: str | None,
    device_files: bool,
    autoload: str | None,
    message: str,
) -> None:
    """Catches a reason that blames the wrong thing: the autoload switch on a host that has no TPU
    at all (where the entry points switch it off themselves), or "no chip" where the user's own
    switch (torch loads backends only for "1") kept torch_tpu out."""
    pretend_accelerator(monkeypatch, None)
    monkeypatch.setattr(select, "torch_tpu_version", lambda: version)
    monkeypatch.setattr(select, "host_has_tpu_device_files", lambda: device_files)
    if autoload is None:
        monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", autoload)
    with pytest.raises(ConfigError, match=f"device.type = 'tpu' was requested but {message}"):
        device_layer.resolve_device_type("tpu")
    with caplog.at_level(logging.WARNING, logger="titan_tpu.device"):
        assert device_layer.resolve_device_type("auto") == "cpu"
    warnings = [record.getMessage() for record in caplog.records]
    if version is None:
        assert warnings == []  # without torch_tpu there is nothing to explain
    else:
        assert len(warnings) == 1 and re.match(f"device: {message}.*; using the CPU$", warnings[0]), warnings


def test_missing_cuda_and_unknown_type_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_accelerator(monkeypatch, None)
    with pytest.raises(ConfigError, match="torch.accelerator sees no GPU"):
        device_layer.resolve_device_type("cuda")
    with pytest.raises(ConfigError, match="expected one of auto, tpu, cuda, cpu"):
        device_layer.resolve_device_type("gpu")


def test_cpu_device_is_named_after_the_processor() -> None:
    device = device_layer.select_device("cpu", local_rank=0)
    assert device.torch_device == torch.device("cpu")
    assert device.name() == torch.cpu.get_capabilities()["cpu_name"]
    assert device.memory_capacity_gib() is None and device.splash_attention_op() is None
    assert device.ragged_dot_op() is None  # TorchTPU's MoE matmul is handed out on TPU only


PER_WINDOW_PROBE = """
import json
from titan_tpu.device import Device, memory

device = Device("cpu", 0)
assert memory.reset_peak_rss(), "this Linux refused the reset"
baseline = device.peak_memory_gib()
block = bytearray(256 * 2**20)
block[:: 4096] = b"\\x01" * len(block[:: 4096])  # write every page so it is resident
del block
first_window = device.peak_memory_gib()
device.reset_peak_memory()
second_window = device.peak_memory_gib()
print(json.dumps([baseline, first_window, second_window]))
"""


@pytest.mark.skipif(not memory._CLEAR_REFS.exists(), reason="needs Linux /proc/self/clear_refs")
def test_cpu_peak_memory_is_per_window() -> None:
    """A window's peak includes its own transient allocation and, after a reset, not an earlier one.

    Catches ru_maxrss (peak since start, never reset): its second window would still show the first
    window's 256 MiB. Runs in a fresh interpreter: in a long test process the allocator may serve the
    block from pages it already holds and keep them after the free, so neither window would move."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # the CPU figure needs no TPU backend
    done = subprocess.run(
        [sys.executable, "-c", PER_WINDOW_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    baseline, first_window, second_window = json.loads(done.stdout.strip().splitlines()[-1])
    assert first_window - baseline > 0.2  # the freed 256 MiB still counts in its window's peak
    assert first_window - second_window > 0.2
