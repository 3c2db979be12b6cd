"""DPO on 2 CPU processes (gloo) against 1 process: FSDP 2 and TP 2 (sequence parallel) train the
generated pairs like a single process taking the same global batch: the first step's gradients of every
parameter (relative 1e-4), every step's loss (1e-5) and gradient norm, the held-out DPO loss, and the
full final state (parameters, AdamW moments) within parity.py's tolerances.

Bugs caught: pairs dealt to ranks other than r, r+W, ... (another global batch), a pair's chosen and
rejected sequences split between ranks or micro-batches, a loss normalised per rank instead of over the
global batch, a reference that is not sharded or initialised like the policy (other log-ratios), rows
whose width does not split over the tp ranks, held-out sums not added over ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import dpo_layouts_worker as worker
from tests.support.launch import torchrun
from tests.support.one_thread import one_intra_op_thread
from tests.support.parity import RunResult, assert_parity

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dpo_layouts")
    torchrun(2, HERE / "dpo_layouts_worker.py", str(out / "results.json"), timeout=600)
    with one_intra_op_thread():
        single = worker.reference(out)
    layouts = {
        name: (RunResult.load(out / f"{name}.pt"), torch.load(out / f"{name}_grads.pt", weights_only=True))
        for name in worker.LAYOUTS
    }
    return {"single": single, **layouts}


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_dpo_layout_matches_one_process(runs: dict[str, Any], layout: str) -> None:
    (single, single_grads), (run, grads) = runs["single"], runs[layout]
    assert run.steps == single.steps == list(range(1, worker.STEPS + 1))
    assert sorted(single.validation_losses) == [2]
    assert single.losses[0] == pytest.approx(0.693147, abs=1e-6)  # the policy starts as its reference
    assert single.losses[1] != pytest.approx(single.losses[0], abs=1e-4)  # and has moved at step 2
    assert grads.keys() == single_grads.keys()
    for name, grad in single_grads.items():
        difference = float((grads[name] - grad).norm() / grad.norm())
        assert difference < 1e-4, (layout, name, difference)
    assert_parity(run, single, f"dpo {layout}")
