"""Published MoE families from folders transformers saved (tests/support/hf_saved.py), on 2 CPU
processes (gloo) against 1: Mixtral, OLMoE, Qwen 3 MoE and Qwen 2 MoE start from their
`save_pretrained` folder under FSDP 2 and under EP 2 (hf_saved_worker.CASES), each rank reading only
its shards' blocks through transformers' conversion; the weights they load equal transformers' own
load exactly, and 8 fp32 steps match the single process's losses, gradient norms and final state.
The negative control reads every rank's experts from the first one and must be told apart."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import hf_saved_worker
from tests.support.hf_saved import PUBLISHED_MOE, saved_folder
from tests.support.launch import torchrun
from tests.support.parity import RunResult, assert_matches_single_process, compare

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dump = tmp_path_factory.mktemp("hf_saved")
    for model_type in hf_saved_worker.MODEL_TYPES:
        saved_folder(PUBLISHED_MOE[model_type], hf_saved_worker.folder(dump, model_type))
    start = time.perf_counter()
    torchrun(2, HERE / "hf_saved_worker.py", str(dump / "results.json"), timeout=600)
    elapsed = time.perf_counter() - start
    data = json.loads((dump / "results.json").read_text())
    for case in [*hf_saved_worker.CASES, *hf_saved_worker.BROKEN]:
        data[case]["run"] = RunResult.load(dump / f"{case}.pt")
    start = time.perf_counter()
    data["single"] = {case: hf_saved_worker.reference(dump, case) for case in hf_saved_worker.CASES if "_fsdp2" in case}
    print(f"\n2-process launch {elapsed:.1f}s, references {time.perf_counter() - start:.1f}s: {data['timings_s']}")
    return data


def single(results: dict[str, Any], case: str) -> RunResult:
    return results["single"][f"{hf_saved_worker.CASES[case][0]}_fsdp2"]


@pytest.mark.parametrize("case", list(hf_saved_worker.CASES))
def test_a_saved_folder_trains_alike_on_every_layout(results: dict[str, Any], case: str) -> None:
    assert results[case]["loaded_max_abs_diff"] == 0.0
    assert_matches_single_process(results[case]["run"], single(results, case), hf_saved_worker.STEPS, case)


def test_reading_every_rank_s_experts_from_the_first_is_told_apart(results: dict[str, Any]) -> None:
    broken = "mixtral_ep2_blocks_from_zero"
    assert results[broken]["loaded_max_abs_diff"] > 1e-3
    assert not compare(results[broken]["run"], single(results, hf_saved_worker.BROKEN[broken])).ok
