"""Peak FLOP/s of a device, the denominator of MFU.

Accelerators come from a table of published dense (no sparsity) figures per chip; a CPU is measured
with a short matmul probe at start-up, because its peak depends on cores, threads and the BLAS build.
An accelerator the table does not know gets no peak, so MFU is reported as missing, never guessed.
"""

from __future__ import annotations

import time

import torch

# Dense bf16 FLOP/s per chip (per device the framework addresses), from the vendors' data sheets.
# Ordered so that the more specific name matches first ("v5p" before "v5", "H100 PCIe" before "H100").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("tpu v7x", 2307e12),
    ("tpu7x", 2307e12),
    ("tpu v6e", 918e12),
    ("tpu v6 lite", 918e12),
    ("tpu v5p", 459e12),
    ("tpu v5e", 197e12),
    ("tpu v5 lite", 197e12),
    ("tpu v4", 275e12),
    ("b200", 2250e12),
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
)


def table_peak_flops(device_name: str) -> float | None:
    lowered = device_name.lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key in lowered:
            return flops
    return None


def measure_matmul_flops(dtype: torch.dtype, size: int = 1024, windows: int = 5, seconds: float = 0.1) -> float:
    """FLOP/s of repeated square matmuls on the CPU with the current thread count.

    The best of several short windows: a peak is what the hardware can do, and the best window is
    the one least disturbed by other work on the machine.
    """
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up: first call picks kernels and touches memory
    best = 0.0
    for _ in range(windows):
        iterations = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            torch.mm(a, b)
            iterations += 1
        best = max(best, 2 * size**3 * iterations / elapsed)
    return best


def peak_flops(device_type: str, device_name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s for MFU in the compute dtype; None when it is not known."""
    if device_type == "cpu":
        return measure_matmul_flops(dtype)
    if dtype == torch.float32:
        return None  # tables list bf16 tensor-core peaks; an fp32 MFU against them would mislead
    return table_peak_flops(device_name)
