"""Which attention kernel a run uses: a device-type decision, so it lives in the device layer.

The kernels themselves are model code (models/common/attention_kernels.py); this only names one.
"""

from __future__ import annotations

import torch

# Query-block size of the blocked kernel when "auto" picks it: a multiple of the CPUs' matmul tiles,
# small enough that a block's scores stay in cache.
CPU_BLOCK = 128


def choose_attention(
    device_type: str, dtype: torch.dtype, requested: int, splash_tiles: bool, native_bf16_matmul: bool = False
) -> str:
    """The attention kernel name for a run. `requested` is `[model] attention_block`: -1 automatic,
    0 SDPA, N > 0 blocked with N-token query blocks; an explicit request is honoured as given.
    `splash_tiles`: the sequence length tiles into the splash kernel's blocks (`splash_block`).
    `native_bf16_matmul`: the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), which the device
    layer knows.

    Automatic, from measurements (scripts/bench_attention.py, forward + backward):
    - TPU: the splash kernel when the sequence tiles into its 128-multiple blocks, else SDPA.
    - GPU and others: SDPA (fused flash / memory-efficient kernels).
    - CPU, float32: SDPA. Its flash kernel beat plain-matmul blocks at every length measured (CPU time
      1.4x to 4x less at sequence 256 to 2048, AVX512F Xeon); blocked attention used to be picked here
      and ran a small model 2.5x slower at sequence 2048.
    - CPU, bf16 with native bf16 matmuls: blocked, because SDPA's bf16 kernel does not use those units
      (blocked measured 1.15x faster per training step of a 100M model at sequence 256).
    - CPU, bf16 emulated: SDPA (2x to 10x less CPU time than blocked there).
    """
    if requested < -1:
        raise ValueError(f"attention_block must be -1 (auto), 0 (SDPA) or a block size, got {requested}")
    if requested == 0:
        return "sdpa"
    if requested > 0:
        return f"blocked:{requested}"
    if device_type == "tpu":
        return "splash" if splash_tiles else "sdpa"
    if device_type == "cpu" and dtype == torch.bfloat16 and native_bf16_matmul:
        return f"blocked:{CPU_BLOCK}"
    return "sdpa"
