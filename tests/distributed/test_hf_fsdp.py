"""The hf family under FSDP on 4 CPU processes (gloo) against 1 process: Mistral under FSDP 4 with
activation checkpointing, Gemma 2 (tied embeddings) under HSDP 2 x 2. Each starts from the
single process's weights bit for bit and trains 10 fp32 steps whose losses, gradient norms and
final state (parameters and AdamW moments, gathered) match the single process's (parity.py's
tolerances). Catches a layout-dependent init (transformers' draws on shards), a tied head split
from its embedding by sharding, decoder layers not found as FSDP units, and a loss or gradient
scaled differently on several ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_fsdp_worker  # noqa: E402
from launch import launch_layout_worker  # noqa: E402
from parallel_worker import STEPS  # noqa: E402
from parity import assert_matches_single_process  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("hf_fsdp")
    data = launch_layout_worker(HERE / "hf_fsdp_worker.py", folder, {case: case for case in hf_fsdp_worker.CASES},
                                lambda dump: {case: hf_fsdp_worker.reference(dump, case) for case in hf_fsdp_worker.CASES},
                                timeout=900)  # fmt: skip
    return data


@pytest.mark.parametrize("case", list(hf_fsdp_worker.CASES))
def test_hf_layout_matches_one_process(results: dict[str, Any], case: str) -> None:
    assert results[case]["init_max_abs_diff"] == 0.0
    assert_matches_single_process(results[case]["run"], results["single"][case], STEPS, case)
