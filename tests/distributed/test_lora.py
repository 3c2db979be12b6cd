"""LoRA on 4 CPU processes (gloo) against 1 process (tests/distributed/lora_worker.py, one launch).

- A sharded adapted layer pair (column-wise up, row-wise down, with and without sequence parallelism)
  computes the one-device output and every gradient (input, lora_A, lora_B of both).
- LoRA runs of a debug Qwen 3 under HSDP 2 x 2 and TP 2 x FSDP 2 (sequence parallel), and of
  transformers' Mistral (the hf family's plan) under TP 2 x FSDP 2, train like one process: every
  step's loss (1e-5) and gradient norm, every step's adapter gradients (1e-4), and the final state
  (adapters, their AdamW moments, and the frozen base, which must not have moved).
- Negative control: adapters drawn per shard from the global generator instead of by the layout-
  invariant init give other step-1 adapter gradients (beyond 1e-4), so the comparison can fail.

Bugs caught: factors mis-split or left on no mesh (wrong values or a failing step), adapter gradients
not summed over the tensor-parallel group, FSDP not reduce-scattering the adapters' gradients beside
frozen weights, a frozen weight made trainable by a style's re-wrapping, an adapter init that depends
on the layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import lora_worker as worker
from tests.support.launch import torchrun
from tests.support.parity import RunResult, assert_matches_single_process

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
GRADIENTS = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import json

    out = tmp_path_factory.mktemp("lora")
    torchrun(4, HERE / "lora_worker.py", str(out / "results.json"), timeout=900)
    data = json.loads((out / "results.json").read_text())
    for name in [*worker.LAYOUTS, "drawn_per_shard"]:
        data[name] = torch.load(out / f"{name}.pt", weights_only=True)
    data["single"] = worker.reference(out)
    return data


def gradient_differences(run: dict[str, Any], single: dict[str, Any], steps: list[int]) -> dict[str, float]:
    """Relative L2 difference of every adapter gradient at `steps`, keyed step/name."""
    differences = {}
    for step in steps:
        got, want = run["grads"][step], single["grads"][step]
        assert got.keys() == want.keys() and got, (step, sorted(got)[:3], sorted(want)[:3])
        for name, grad in want.items():
            assert name.endswith((".lora_A", ".lora_B")), name  # only the adapters have gradients
            differences[f"{step}/{name}"] = float((got[name] - grad).norm() / grad.norm().clamp_min(1e-30))
    return differences


def test_a_sharded_adapter_pair_computes_like_one_device(results: dict[str, Any]) -> None:
    layer = results["layer"]
    assert len(layer) == 2 * (1 + 5)  # output and 5 gradients, with and without sequence parallelism
    assert max(layer.values()) < 1e-5, layer


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_lora_layout_trains_like_one_process(results: dict[str, Any], layout: str) -> None:
    single = results["single"]["mistral" if layout.startswith("hf") else "qwen3"]
    run = RunResult(**results[layout]["run"])
    reference = RunResult(**single["run"])
    assert_matches_single_process(run, reference, worker.STEPS, layout)
    differences = gradient_differences(results[layout], single, list(range(1, worker.STEPS + 1)))
    worst = max(differences, key=differences.__getitem__)
    print(f"{layout}: largest adapter-gradient difference {differences[worst]:.1e} ({worst})")
    assert differences[worst] < GRADIENTS, worst
    # The adapters trained (B moved off zero) and the base did not move.
    state = reference.state
    assert all(state[k].abs().max() > 0 for k in state if k.startswith("param/") and k.endswith("lora_B"))
    assert all(not k.endswith(("weight", "bias")) for k in state if k.startswith("exp_avg/"))


def test_negative_control_adapters_drawn_per_shard_do_not_match(results: dict[str, Any]) -> None:
    differences = gradient_differences(results["drawn_per_shard"], results["single"]["qwen3"], [1])
    print(f"adapters drawn per shard: largest step-1 adapter-gradient difference {max(differences.values()):.1e}")
    assert max(differences.values()) > 100 * GRADIENTS
