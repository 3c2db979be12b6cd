"""Device selection: auto order, forced types, backends; the tpu branch with a stand-in torch_tpu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_tpu import device as device_layer
from titan_tpu.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


# The stand-in runs in a child process: like the real torch_tpu it renames PyTorch's PrivateUse1
# device to "tpu" and registers itself as `torch.tpu`, which is process-wide and cannot be undone.
FAKE_TORCH_TPU = """
import json, sys, types
import torch

calls = []
fake = types.ModuleType("torch_tpu")
fake.device_count = lambda: int(sys.argv[1])
fake.set_device = lambda i: calls.append(["set_device", i])
fake.synchronize = lambda i: calls.append(["synchronize", i])
fake.get_device_name = lambda i: "TPU v5p"
fake.max_memory_allocated = lambda i: 3 * 2**30
torch.utils.rename_privateuse1_backend("tpu")
torch._register_device_module("tpu", fake)
sys.modules["torch_tpu"] = fake
torch.cuda.is_available = lambda: False

from titan_tpu import device as layer
from titan_tpu.config import ConfigError

result = {"auto": layer.resolve_device_type("auto")}
try:
    device = layer.select_device("tpu", local_rank=2)
    device.synchronize()
    result.update(
        torch_device=str(device.torch_device), backend=device.backend, name=device.name(),
        memory_gib=device.peak_memory_gib(), calls=calls,
    )
except ConfigError as e:
    result["error"] = str(e)
print(json.dumps(result))
"""


def run_with_fake_tpu(chips: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", FAKE_TORCH_TPU, str(chips)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_auto_picks_cpu_without_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_tpu", None)  # import fails
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_layer.resolve_device_type("auto") == "cpu"
    assert device_layer.process_group_backend("cpu") == "gloo"


def test_auto_prefers_tpu_and_uses_its_device_module() -> None:
    result = run_with_fake_tpu(chips=4)
    assert result["auto"] == "tpu"
    assert result["torch_device"] == "tpu:2"
    assert result["backend"] == "cpu:gloo,tpu:tpu_dist"
    assert result["calls"] == [["set_device", 2], ["synchronize", 2]]
    assert result["name"] == "TPU v5p"
    assert result["memory_gib"] == pytest.approx(3.0)


def test_tpu_without_chips_is_not_available() -> None:
    result = run_with_fake_tpu(chips=0)
    assert result["auto"] == "cpu"
    assert "device.type = 'tpu' was requested" in result["error"]


def test_cuda_backend_string_and_missing_cuda_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_layer.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="torch.cuda sees no GPU"):
        device_layer.resolve_device_type("cuda")


def test_cpu_device_reports_memory_and_name() -> None:
    device = device_layer.select_device("cpu", local_rank=0)
    assert device.torch_device == torch.device("cpu")
    assert device.name() == "cpu"
    assert device.peak_memory_gib() > 0
