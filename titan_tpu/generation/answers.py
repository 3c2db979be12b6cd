"""The greedy answer check: held-out prompts answered greedily by a rollout engine and scored, split
over the data-parallel ranks and summed. SFT's exact answers and GRPO's held-out accuracy are both
this, with their own prompts and scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.protocols.rollout import RolloutEngine, SamplingParams

# (indices of the prompts this rank answered, their answers' token ids) -> the sum of their scores
Score = Callable[[list[int], list[list[int]]], float]


@torch.no_grad()
def greedy_answer_score(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    score: Score,
    dp_rank: int,
    dp_world: int,
    dp_mesh: DeviceMesh | None,
    device: torch.device,
    in_lockstep: bool = False,
) -> tuple[float, int]:
    """(sum of scores, prompts scored) over every data-parallel rank: rank r answers prompts r, r + W,
    ... at temperature 0. `in_lockstep`: the engine's ranks exchange activations in every forward
    (expert parallelism), so a rank left without a prompt still decodes one, unscored, for the
    forwards of the others to find it."""
    if params.temperature != 0:
        raise ValueError(f"the greedy answer check decodes at temperature 0, got {params.temperature}")
    mine = list(range(dp_rank, len(prompts), dp_world))
    total = 0.0
    if mine or (in_lockstep and prompts):
        answers = engine.generate([prompts[i] for i in mine] or [prompts[0]], params).tokens
        if mine:
            total = score(mine, answers)
    counts = torch.tensor([total, float(len(mine))], dtype=torch.float64, device=device)
    summed, scored = sum_over(counts, dp_mesh).tolist()
    return summed, int(scored)
