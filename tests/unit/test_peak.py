"""Peak FLOP/s: the table for accelerators, a measured probe on the CPU, nothing for the unknown."""

from __future__ import annotations

import pytest
import torch

from titan_tpu.metrics.peak import measure_matmul_flops, peak_flops, table_peak_flops


@pytest.mark.parametrize(
    "name, expected",
    [
        ("TPU v5p", 459e12),
        ("TPU v5 lite", 197e12),
        ("TPU v6e", 918e12),
        ("TPU7x", 2307e12),
        ("TPU v4", 275e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2250e12),
    ],
)
def test_table_knows_the_listed_chips(name: str, expected: float) -> None:
    assert table_peak_flops(name) == expected


def test_unknown_accelerator_reports_no_peak() -> None:
    assert peak_flops("cuda", "Some Future GPU", torch.bfloat16) is None
    assert peak_flops("cuda", "NVIDIA H200", torch.float32) is None


def test_cpu_peak_is_measured() -> None:
    flops = measure_matmul_flops(torch.float32, size=256, windows=2, seconds=0.02)
    assert 1e8 < flops < 1e14
