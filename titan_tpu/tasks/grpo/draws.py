"""One rollout batch from one draw, or from several with dynamic sampling (rl.dynamic_sampling, DAPO).

A draw samples rl.prompts_per_step prompts x rl.group_size completions, the next prompts of the
stream, exactly as a rollout batch without dynamic sampling is sampled: draw d holds the prompts from
position d x prompts_per_step on and seeds its rows from d, so the same draw samples the same
completions whatever came before it, on any parallel layout. Its rows are scored, and the scores
summed over the data-parallel ranks, so every rank knows every row's reward.

Without dynamic sampling the batch is the draw. With it, every group whose rewards are all equal is
dropped (its advantages would all be 0: no signal, only a smaller batch) and the next draw's groups
are added until rl.prompts_per_step groups are kept; the last draw's groups past that are dropped too,
as verl does. The stream position moves past every prompt drawn, so a resumed run draws what the
uninterrupted one would. A batch still short after rl.max_draws draws stops the run with one line.

The kept groups get the rows of the batch in the order they were drawn, and each row is trained by
the rank that owns its place in the batch, which is not always the rank that sampled it: the rows
that move (tokens, log-probs, the episode) are exchanged between the data-parallel ranks once, with
one all-gather. Every rank decides the same from the same global rewards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_tpu.config import ConfigError
from titan_tpu.generation.episodes import Trajectory
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.producer import Sampled
from titan_tpu.tasks.grpo.prompts import Prompt, PromptStream
from titan_tpu.tasks.grpo.sampling import RolloutSource
from titan_tpu.tasks.grpo.step_lines import tied_groups

# This rank's completions of its rows of one draw -> each row's columns (reward, length, tokens, ...).
Score = Callable[[Sampled], dict[str, list[float]]]
# A [k, rows] tensor of this rank's rows -> summed with every data-parallel rank's.
SumRanks = Callable[[torch.Tensor], torch.Tensor]
Row = tuple[int, int]  # (draw, row of that draw)


class DynamicSamplingShort(ConfigError):
    """rl.max_draws draws did not fill a rollout batch with groups whose rewards differ: one line, exit 2."""


class RolloutPosition:
    """The GRPO run's data state: the prompt stream's position (prompts drawn) and the rollout batches
    trained, which with dynamic sampling is not position / prompts_per_step (a Stateful object)."""

    def __init__(self, stream: PromptStream, prompts_per_draw: int) -> None:
        self.stream = stream
        self.prompts_per_draw = prompts_per_draw
        self.rollouts = 0

    @property
    def draw(self) -> int:
        """The index of the next draw."""
        return self.stream.position // self.prompts_per_draw

    def state_dict(self) -> dict[str, Any]:
        return {**self.stream.state_dict(), "rollouts": self.rollouts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        # A checkpoint from before dynamic sampling: one draw per rollout batch.
        self.rollouts = int(state.get("rollouts", self.stream.position // self.prompts_per_draw))


@dataclass
class Draw:
    sampled: Sampled  # this rank's rows
    table: dict[str, torch.Tensor]  # every row's columns, every rank's rows
    waited: float  # seconds the trainer waited for it beyond sampling it itself


@dataclass
class RolloutBatch:
    """The batch training takes: its prompts and every row's columns in the batch's row order, this
    rank's rows' completions, and the draws it was made from (every row of them, kept or not, was
    sampled: their cost and their tied groups are the run's)."""

    prompts: list[Prompt]
    table: dict[str, torch.Tensor]
    completions: dict[int, list[int]]
    logps: dict[int, torch.Tensor]
    episodes: dict[int, Trajectory]
    draws: list[Draw]


def kept_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """The groups of a draw whose rewards are not all equal."""
    return [int(g) for g in torch.nonzero(~tied_groups(rewards, group_size)).flatten()]


class RolloutDrawer:
    def __init__(
        self,
        rl: RLConfig,
        source: RolloutSource,
        position: RolloutPosition,
        score: Score,
        sum_ranks: SumRanks,
        dp_group: dist.ProcessGroup | None,
    ) -> None:
        self.rl, self.source, self.position = rl, source, position
        self.score, self.sum_ranks, self.dp_group = score, sum_ranks, dp_group
        self.rows = rl.prompts_per_step * rl.group_size

    def next_batch(self, model: nn.Module, version: int, params: SamplingParams) -> RolloutBatch:
        """The next rollout batch, sampled by weights `version` (optimizer steps taken)."""
        rl, group = self.rl, self.rl.group_size
        draws: list[Draw] = []
        kept: list[Row] = []  # (draw, group) of each group of the batch, in order
        while True:
            draw = self._draw(model, version, params)
            draws.append(draw)
            index = len(draws) - 1
            if not rl.dynamic_sampling:
                kept = [(index, g) for g in range(rl.prompts_per_step)]
                break
            kept += [(index, g) for g in kept_groups(draw.table["reward"], group)]
            if len(kept) >= rl.prompts_per_step:
                kept = kept[: rl.prompts_per_step]
                break
            if len(draws) == rl.max_draws:
                raise DynamicSamplingShort(
                    f"rl.dynamic_sampling: {len(draws)} draws (rl.max_draws) of {rl.prompts_per_step} prompts, up "
                    f"to prompt {self.position.stream.position}, found {len(kept)} of the {rl.prompts_per_step} "
                    "groups with differing rewards a rollout batch needs; raise rl.max_draws, or check that the "
                    "rewards tell completions apart (most groups tie when nearly all answers are right or wrong)"
                )
        self.position.rollouts += 1
        return self._assemble(draws, kept)

    def _draw(self, model: nn.Module, version: int, params: SamplingParams) -> Draw:
        rl = self.rl
        index = self.position.draw
        sampled, waited = self.source.rollout(model, index, version, params)
        taken: list[Prompt] = self.position.stream.take(rl.prompts_per_step)
        if [p.ids for p in taken] != [p.ids for p in sampled.prompts]:
            raise RuntimeError(f"GRPO: draw {index} was sampled for other prompts than training takes")
        return Draw(sampled, self._global_rows(self.score(sampled), self.source.mine), waited)

    def _global_rows(self, columns: dict[str, list[float]], mine: list[int]) -> dict[str, torch.Tensor]:
        """Each column of this rank's rows placed at their rows of the draw and summed with the other
        ranks': every row's value, on every rank."""
        table = torch.zeros(len(columns), self.rows, dtype=torch.float64)
        rows = torch.tensor(mine, dtype=torch.long)
        for k, values in enumerate(columns.values()):
            table[k, rows] = torch.tensor(values, dtype=torch.float64)
        return dict(zip(columns, self.sum_ranks(table)))

    def _assemble(self, draws: list[Draw], kept: list[Row]) -> RolloutBatch:
        group = self.rl.group_size
        # Row j x G + i of the batch is row g x G + i of draw d, for the j-th kept group (d, g).
        origin = [(d, g * group + i) for d, g in kept for i in range(group)]
        prompts = [draws[d].sampled.prompts[g] for d, g in kept]
        if all(origin[r] == (0, r) for r in range(self.rows)):  # the one draw as it is: nothing moves
            sampled = draws[0].sampled
            return RolloutBatch(prompts, draws[0].table, sampled.completions, sampled.logps, sampled.episodes, draws)
        table = {
            name: torch.cat([draws[d].table[name][g * group : (g + 1) * group] for d, g in kept])
            for name in draws[0].table
        }
        mine = self.source.mine
        wanted = set(origin)
        local = {
            (d, row): _row_of(draw.sampled, row) for d, draw in enumerate(draws) for row in mine if (d, row) in wanted
        }
        rows = gather_rows(local, self.dp_group)
        completions, logps, episodes = {}, {}, {}
        for r in mine:
            tokens, row_logps, episode = rows[origin[r]]
            completions[r], logps[r] = tokens, row_logps
            if episode is not None:
                episodes[r] = episode
        return RolloutBatch(prompts, table, completions, logps, episodes, draws)


RowData = tuple[list[int], torch.Tensor, Trajectory | None]


def _row_of(sampled: Sampled, row: int) -> RowData:
    return sampled.completions[row], sampled.logps[row], sampled.episodes.get(row)


def gather_rows(local: dict[Row, RowData], group: dist.ProcessGroup | None) -> dict[Row, RowData]:
    """Every data-parallel rank's rows, on every rank (None: one data-parallel rank, which has them all)."""
    if group is None:
        return local
    everyone: list[dict[Row, RowData] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    merged: dict[Row, RowData] = {}
    for rows in everyone:
        assert rows is not None
        merged.update(rows)
    return merged
