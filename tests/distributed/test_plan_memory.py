"""The planner's per-device parameters + gradients + optimizer bytes against what each rank of a real
run holds after a training step (local shards of every parameter, gradient and AdamW state tensor),
under FSDP 2 with expert parallelism 2 (MoE), CP 2 (Llama 3), FSDP 4 (Llama 3), TP 2 x FSDP 2
(Qwen 3) and PP 2 (1F1B) x FSDP 2 (Llama 3, each pp rank against the planner's figure for that rank;
there also the planner's whole per-rank total, state + activations + buffers, against the rank's
parameters and optimizer state plus the live-tensor peak of a step: two micro-batches in flight on pp
rank 0, the stage gathered and its gradients unsharded across the step), in one launch per process count (one process: tests/unit/plan/test_activations.py). Within 10% on every rank.

Bugs caught: a sharding rule the planner gets wrong (a tp-split weight counted whole, experts not
divided by ep, norms divided by tp, parameters not sharded over the cp ranks, a pipeline stage's
embedding or head on the wrong rank), a forgotten AdamW moment, a size not divided over dp_shard, or
the whole model counted on each pp rank; the last three are shown to fail the same comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

from tests.distributed.plan_memory_worker import LAYOUTS, PIPELINE_DEGREES, overrides  # noqa: E402
from tests.support.launch import torchrun  # noqa: E402
from tests.support.plan_measure import within  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.plan.planner import plan_memory  # noqa: E402

pytestmark = pytest.mark.slow
TOLERANCE = 0.10
LAUNCHES = {2: ["qwen3_moe_fsdp2_ep2", "llama3_cp2"], 4: ["llama3_fsdp4", "qwen3_tp2_fsdp2", "llama3_pp2_fsdp2"]}


def estimates(layout: str, processes: int, tmp: Path, rank: int, extra: tuple[str, ...] = ()) -> dict[str, int]:
    """The planner's bytes for global `rank` (its pp rank's share under pipeline parallelism)."""
    config = load_config(LAYOUTS[layout][0], [*overrides(layout, tmp), *extra])
    pp = config.parallelism.pp
    memory = plan_memory(config, processes, pp_rank=rank // (processes // pp) if pp > 1 else None).memory
    return {
        "parameters": memory.parameters,
        "gradients": memory.gradients,
        "optimizer": memory.optimizer,
        "step_total": memory.total,
    }


@pytest.mark.parametrize("processes", sorted(LAUNCHES))
def test_state_bytes_match_every_rank(processes: int, tmp_path: Path) -> None:
    torchrun(processes, HERE / "plan_memory_worker.py", str(tmp_path), *LAUNCHES[processes])
    for layout in LAUNCHES[processes]:
        for rank in range(processes):
            estimate = estimates(layout, processes, tmp_path, rank)
            measured = json.loads((tmp_path / f"{layout}.rank{rank}.json").read_text())
            print(
                f"\n{layout} rank {rank}: planned / measured "
                + ", ".join(f"{kind} {estimate[kind] / value:.3f}" for kind, value in measured.items())
            )
            for kind, value in measured.items():
                assert within(estimate[kind], value, TOLERANCE), (layout, rank, kind, estimate[kind], value)
            if layout in PIPELINE_DEGREES:
                # Negative control: the whole model on each pp rank (the same mesh without pp, FSDP over
                # the rank's dp_shard pair) is far from either stage.
                whole = estimates(
                    layout, processes // PIPELINE_DEGREES[layout], tmp_path, rank, ("--parallelism.pp=1",)
                )
                assert not within(whole["parameters"], measured["parameters"], TOLERANCE)
                assert not within(whole["step_total"], measured["step_total"], TOLERANCE)
            # Negative controls: the same comparison rejects a planner without AdamW's second moment
            # and one that forgets to divide by the data-parallel shards.
            assert not within(estimate["optimizer"] / 2, measured["optimizer"], TOLERANCE)
            assert not within(estimate["parameters"] * processes, measured["parameters"], TOLERANCE)
