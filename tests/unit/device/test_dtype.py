"""The compute-dtype decision: bf16 where the hardware computes it, fp32 elsewhere; the one table.

CPU features are patched (torch.cpu.get_capabilities), never assumed from this machine."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support.cpu_kinds import ARM64_BF16, ARM64_NO_BF16, AVX2_ONLY, AVX512_NO_BF16, COOPER_LAKE, SAPPHIRE_RAPIDS
from titan_tpu.config import ConfigError
from titan_tpu.device import DTYPES, Device, dtype_from_name, dtype_name, native_bf16, resolve_compute_dtype
from titan_tpu.device import dtype as dtype_module

CPU = Device("cpu", 0)


def with_cpu(monkeypatch: pytest.MonkeyPatch, capabilities: dict) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)


@pytest.mark.parametrize(
    "capabilities, expected",
    [
        (AVX2_ONLY, torch.float32),
        (AVX512_NO_BF16, torch.float32),
        (ARM64_NO_BF16, torch.float32),
        (COOPER_LAKE, torch.bfloat16),
        (SAPPHIRE_RAPIDS, torch.bfloat16),
        (ARM64_BF16, torch.bfloat16),
    ],
)
def test_auto_on_cpu_follows_the_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, capabilities: dict, expected: torch.dtype
) -> None:
    with_cpu(monkeypatch, capabilities)
    assert resolve_compute_dtype("auto", CPU) == expected


def test_auto_on_tpu_is_bf16_and_explicit_float32_there_is_full_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a float32 TPU run left in torch_tpu's default one-pass-bf16 matmul precision."""
    precisions: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precisions.append)
    tpu = Device("tpu", 0)
    assert resolve_compute_dtype("auto", tpu) == torch.bfloat16
    assert precisions == []
    assert resolve_compute_dtype("float32", tpu) == torch.float32
    assert precisions == ["highest"]
    assert resolve_compute_dtype("float32", CPU) == torch.float32
    assert precisions == ["highest"]  # the CPU is left as it is


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cuda_asks_for_hardware_bf16_without_emulation(
    monkeypatch: pytest.MonkeyPatch, native: bool, expected: torch.dtype
) -> None:
    """A pre-Ampere GPU reports bf16 as supported when emulation counts (torch's default)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or native)
    assert native_bf16("cuda") is native
    assert resolve_compute_dtype("auto", Device("cuda", 0)) == expected


def test_explicit_bf16_on_emulating_cpu_runs_and_warns_once_with_the_measured_slowdown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_cpu(monkeypatch, AVX512_NO_BF16)
    dtype_module._warn_emulated_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger=dtype_module.__name__):
        assert resolve_compute_dtype("bfloat16", CPU) == torch.bfloat16
        assert resolve_compute_dtype("bfloat16", CPU) == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "emulates bf16" in warnings[0] and "x slower than float32 here" in warnings[0]


def test_explicit_bf16_on_native_cpu_does_not_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with_cpu(monkeypatch, SAPPHIRE_RAPIDS)
    dtype_module._warn_emulated_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger=dtype_module.__name__):
        assert resolve_compute_dtype("bfloat16", CPU) == torch.bfloat16
    assert caplog.records == []


def test_dtype_names_come_from_one_table() -> None:
    assert all(dtype_name(dtype_from_name(name, "x")) == name for name in DTYPES)  # the names round-trip
    assert dtype_from_name("bfloat16", "checkpoint.export_dtype") == torch.bfloat16
    with pytest.raises(ConfigError, match="checkpoint.export_dtype: got 'fp16', expected one of float32, bfloat16"):
        dtype_from_name("fp16", "checkpoint.export_dtype")
    with pytest.raises(ConfigError, match="training.dtype: got 'half'"):
        resolve_compute_dtype("half", CPU)
