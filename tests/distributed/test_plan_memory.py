"""The planner's per-device parameters + gradients + optimizer bytes against what each rank of a real
run holds after a training step (local shards of every parameter, gradient and AdamW state tensor),
under FSDP 2 with expert parallelism 2 (MoE), CP 2 (Llama 3), FSDP 4 (Llama 3) and TP 2 x FSDP 2
(Qwen 3), in one launch per process count (one process: tests/unit/test_plan_activations.py). Within 10% on every rank.

Bugs caught: a sharding rule the planner gets wrong (a tp-split weight counted whole, experts not
divided by ep, norms divided by tp, parameters not sharded over the cp ranks), a forgotten AdamW moment, or a size not divided over dp_shard;
the last two are shown to fail the same comparison.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from launch import torchrun  # noqa: E402
from plan_measure import within  # noqa: E402
from plan_memory_worker import LAYOUTS, overrides  # noqa: E402

from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.plan.planner import plan_memory  # noqa: E402

pytestmark = pytest.mark.slow
TOLERANCE = 0.10
LAUNCHES = {2: ["qwen3_moe_fsdp2_ep2", "llama3_cp2"], 4: ["llama3_fsdp4", "qwen3_tp2_fsdp2"]}


def estimates(layout: str, processes: int, tmp: Path) -> dict[str, int]:
    memory = plan_memory(load_config(LAYOUTS[layout][0], overrides(layout, tmp)), processes).memory
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer": memory.optimizer}


@pytest.mark.parametrize("processes", sorted(LAUNCHES))
def test_state_bytes_match_every_rank(processes: int, tmp_path: Path) -> None:
    torchrun(processes, HERE / "plan_memory_worker.py", str(tmp_path), *LAUNCHES[processes])
    for layout in LAUNCHES[processes]:
        estimate = estimates(layout, processes, tmp_path)
        for rank in range(processes):
            measured = json.loads((tmp_path / f"{layout}.rank{rank}.json").read_text())
            for kind, value in measured.items():
                assert within(estimate[kind], value, TOLERANCE), (layout, rank, kind, estimate[kind], value)
            # Negative controls: the same comparison rejects a planner without AdamW's second moment
            # and one that forgets to divide by the data-parallel shards.
            assert not within(estimate["optimizer"] / 2, measured["optimizer"], TOLERANCE)
            assert not within(estimate["parameters"] * processes, measured["parameters"], TOLERANCE)
