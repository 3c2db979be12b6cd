"""Single-turn GRPO's scoring: one completion per row, scored by `rl.rewards` (the weighted total and
each reward's part), and held-out accuracy as the first reward's mean on greedy answers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.data.tokenizer import Tokenizer
from titan_tpu.generation.answers import greedy_answer_score
from titan_tpu.protocols.rollout import RolloutEngine, SamplingParams
from titan_tpu.tasks.grpo.prompts import Prompt
from titan_tpu.tasks.grpo.rewards import Completions, Reward, score, weighted_total
from titan_tpu.tasks.grpo.step_lines import RolloutSample, log_sample


class CompletionScores:
    def __init__(self, rewards: list[Reward], tokenizer: Tokenizer, reference_field: str) -> None:
        self.rewards = rewards
        self.tokenizer = tokenizer
        self.reference_field = reference_field
        self.sample: RolloutSample | None = None  # the writer's first completion, shown at the next evaluation

    def completions(self, prompts: Sequence[Prompt], ids: Sequence[list[int]]) -> Completions:
        return Completions(
            prompts=[p.text for p in prompts],
            texts=[self.tokenizer.decode(i) for i in ids],
            records=[p.record for p in prompts],
            places=[p.place for p in prompts],
        )

    def columns(self, prompts: Sequence[Prompt], ids: Sequence[list[int]], keep_sample: bool) -> dict[str, list[float]]:
        """Per row: the weighted reward, each reward's part and the completion's length."""
        scored = self.completions(prompts, ids)
        parts = score(self.rewards, scored)
        totals = weighted_total(self.rewards, parts, len(ids))
        if prompts and keep_sample:
            answer = prompts[0].record.get(self.reference_field)
            self.sample = RolloutSample(
                scored.prompts[0], scored.texts[0], totals[0], None if answer is None else str(answer)
            )
        lengths = [float(len(i)) for i in ids]
        return {
            "reward": totals,
            "length": lengths,
            "tokens": lengths,
            **{f"reward/{reward.name}": parts[reward.name] for reward in self.rewards},
        }

    def held_out_accuracy(
        self,
        engine: RolloutEngine,
        held_out: Sequence[Prompt],
        greedy: SamplingParams,
        dp_rank: int,
        dp_world: int,
        dp_mesh: DeviceMesh | None,
        device: torch.device,
        in_lockstep: bool,
    ) -> tuple[float, int]:
        """(the first reward's sum, prompts answered) over every rank's greedy answers."""
        first = self.rewards[0]

        def first_reward(indices: list[int], answers: list[list[int]]) -> float:
            completions = self.completions([held_out[i] for i in indices], answers)
            return sum(score([first], completions)[first.name])

        return greedy_answer_score(
            engine, [p.ids for p in held_out], greedy, first_reward, dp_rank, dp_world, dp_mesh, device, in_lockstep
        )

    def log_sample(self, step: int) -> None:
        if self.sample is not None:
            log_sample(step, self.sample)
