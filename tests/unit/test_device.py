"""Device selection: auto order, forced types, backends; the tpu branch with a stand-in torch_tpu."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from titan_tpu import device as device_layer
from titan_tpu.config import ConfigError


def make_fake_torch_tpu(count: int) -> types.ModuleType:
    """A stand-in for the torch_tpu package: the calls the device layer makes, recorded.

    Like the real package it names PyTorch's PrivateUse1 device "tpu" (a process-wide, one-time
    rename that nothing else in the tests uses).
    """
    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")
    module = types.ModuleType("torch_tpu")
    module.calls = []  # type: ignore[attr-defined]
    module.device_count = lambda: count  # type: ignore[attr-defined]
    module.set_device = lambda i: module.calls.append(("set_device", i))  # type: ignore[attr-defined]
    module.synchronize = lambda i: module.calls.append(("synchronize", i))  # type: ignore[attr-defined]
    module.get_device_name = lambda i: "TPU v5p"  # type: ignore[attr-defined]
    module.max_memory_allocated = lambda i: 3 * 2**30  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake_tpu(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = make_fake_torch_tpu(count=4)
    monkeypatch.setitem(sys.modules, "torch_tpu", module)
    return module


def test_auto_picks_cpu_without_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_tpu", None)  # import fails
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_layer.resolve_device_type("auto") == "cpu"
    assert device_layer.process_group_backend("cpu") == "gloo"


def test_auto_prefers_tpu_and_uses_its_device_module(fake_tpu: types.ModuleType) -> None:
    assert device_layer.resolve_device_type("auto") == "tpu"
    device = device_layer.select_device("auto", local_rank=2)
    assert device.torch_device.type == "tpu" and device.torch_device.index == 2
    assert device.backend == "cpu:gloo,tpu:tpu_dist"
    device.synchronize()
    assert fake_tpu.calls == [("set_device", 2), ("synchronize", 2)]
    assert device.name() == "TPU v5p"
    assert device.peak_memory_gib() == pytest.approx(3.0)


def test_tpu_without_chips_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_tpu", make_fake_torch_tpu(count=0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_layer.resolve_device_type("auto") == "cpu"
    with pytest.raises(ConfigError, match="device.type = 'tpu' was requested"):
        device_layer.resolve_device_type("tpu")


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
