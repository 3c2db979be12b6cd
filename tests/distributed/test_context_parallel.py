"""Context parallelism (`parallelism.cp`) on 2 and 4 CPU processes (gloo), against 1 process.

Two torchrun launches of context_parallel_worker.py (2 processes: CP 2 and the negative control; 4
processes: CP 2 x FSDP 2 compiled, CP 2 x replicate 2, CP 2 x TP 2 with activation checkpointing),
each also checking one attention layer split over all its ranks. The tests read them:
- parity: every layout trains the Llama 3 debug model 10 fp32 steps (warmup 2) through the real
  Trainer; every step's loss and gradient norm and the final parameters and AdamW moments match the
  single process's within the layout suite's tolerances (parity.py). Catches keys not gathered (a
  rank attending to its own chunks only), rotary positions of the local rather than the true
  sequence, a loss averaged over data-parallel ranks only (or divided by the wrong count), and
  gradients not summed over the cp ranks (FSDP sharding over dp_shard alone);
- the check bites: CP 2 with the causal mask built from contiguous positions while the ranks hold
  the balanced chunks i and 2 cp - 1 - i fails the same comparison;
- one attention layer (cp 2 and cp 4): outputs and input gradients joined back into sequence order
  and weight gradients summed over the ranks equal the whole-sequence layer within 1e-6.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import context_parallel_worker as worker  # noqa: E402
from launch import torchrun  # noqa: E402
from parallel_worker import STEPS  # noqa: E402
from parity import RunResult, assert_matches_single_process, compare  # noqa: E402

pytestmark = pytest.mark.slow
LAUNCHES = {
    2: ["attention", "cp2", worker.UNBALANCED_MASK],
    4: ["attention", "cp2_fsdp2", "cp2_replicate2", "cp2_tp2_ac"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("context_parallel")
    data: dict[str, Any] = {}
    for processes, cases in LAUNCHES.items():
        out = folder / f"results{processes}.json"
        torchrun(processes, HERE / "context_parallel_worker.py", str(out), *cases, timeout=900)
        launched = json.loads(out.read_text())
        print(f"\n{processes}-process launch, per part: {launched['timings_s']}")
        data[f"attention_cp{processes}"] = launched["attention"]
        for name in cases[1:]:
            data[name] = RunResult.load(folder / f"{name}.pt")
    data["single"] = worker.reference(folder)
    return data


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_parity_with_single_process(results: dict[str, Any], layout: str) -> None:
    assert_matches_single_process(results[layout], results["single"], STEPS, layout)


def test_parity_check_fails_for_an_unbalanced_mask(results: dict[str, Any]) -> None:
    """The mask of contiguous chunks on balanced data lets rank 0's late chunk miss most of its
    earlier keys and rank 1's early chunk see later ones: the loss moves from the first step."""
    report = compare(results[worker.UNBALANCED_MASK], results["single"])
    print(f"\n{worker.UNBALANCED_MASK}: {report.summary()}; e.g. {report.failures[:2]}")
    assert not report.ok
    assert any(failure.startswith("step 1 loss") for failure in report.failures)


@pytest.mark.parametrize("cp", sorted(LAUNCHES))
def test_attention_layer_matches_whole_sequence(results: dict[str, Any], cp: int) -> None:
    diffs = results[f"attention_cp{cp}"]
    print(f"\nattention over cp {cp}: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert max(diffs.values()) <= 1e-6
