"""The CPU kinds our users and CI run on, as torch.cpu.get_capabilities() reports them (only the keys
that matter), and a way to make this process see one of them.

The compute dtype (`training.dtype = "auto"`) and the automatic attention kernel follow whether the
CPU multiplies bf16 natively. A test of a dtype-dependent path pretends to be each kind, so the suite
checks the same things on every machine instead of the one decision its own CPU makes.
"""

from __future__ import annotations

import torch

AVX2_ONLY = {"architecture": "x86_64", "avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}
AVX512_NO_BF16 = {**AVX2_ONLY, "avx512_f": True}  # Ice Lake, Cascade Lake
SAPPHIRE_RAPIDS = {**AVX512_NO_BF16, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}
COOPER_LAKE = {**AVX512_NO_BF16, "avx512_bf16": True}  # also AMD Zen 4 and 5
ARM64_BF16 = {"architecture": "arm64", "neon": True, "bf16": True, "i8mm": True}  # Graviton 3, Apple M2+
ARM64_NO_BF16 = {"architecture": "arm64", "neon": True, "bf16": False}  # Graviton 2, Apple M1

# The two decisions "auto" makes on a CPU: float32 with SDPA, or bf16 with the blocked kernel.
DECISIONS = {"fp32": AVX512_NO_BF16, "bf16": SAPPHIRE_RAPIDS}


def pretend_cpu(decision: str) -> None:
    """Make this process's capability query answer as a CPU of `decision`'s kind does; for worker
    processes (in-process tests use pytest's monkeypatch on the same attribute)."""
    capabilities = DECISIONS[decision]
    torch.cpu.get_capabilities = lambda: capabilities  # type: ignore[assignment]
