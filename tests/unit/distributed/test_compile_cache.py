"""Inductor's on-disk caches are kept apart per CPU capability (titan_tpu/distributed/compile.py):
torch 2.13 reuses code generated for one vector width in a process that compiles for another."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_tpu.distributed.compile import compile_parts, separate_inductor_cache_per_cpu_capability


def _folder_for(capability: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    separate_inductor_cache_per_cpu_capability()
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_each_cpu_capability_gets_its_own_inductor_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug caught: one cache folder for AVX2 and AVX-512 processes (the shared folder is what let an
    AVX-512 process run AVX2-tiled kernels past their buffers)."""
    avx2, avx512 = _folder_for("AVX2", monkeypatch), _folder_for("AVX512", monkeypatch)
    assert avx2 != avx512
    assert avx2.endswith("_avx2") and avx512.endswith("_avx512")
    # The same capability finds the same folder again (a cache that is never reused is no cache).
    assert _folder_for("AVX2", monkeypatch) == avx2


def test_a_cache_folder_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    separate_inductor_cache_per_cpu_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def test_compiling_with_inductor_separates_even_after_torch_chose_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch writes its default folder into the variable the first time it looks (any earlier
    compile); a block compiled with inductor after that still gets its capability's folder.
    torch.compile is lazy: wrapping compiles nothing, so this only checks who chooses the folder."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch.compile(nn.Linear(2, 2), backend="eager")
    compile_parts(nn.Linear(2, 2), "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("_avx2")
