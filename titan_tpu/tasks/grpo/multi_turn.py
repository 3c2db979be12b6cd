"""GRPO's multi-turn episodes (rl.env): the prompts an environment opens its episodes with, a rollout's
episodes for this rank's rows, and held-out evaluation as greedy episodes.

Each row is one episode with its own environment instance; its turns are sampled with per-row,
per-turn seeds, so an episode does not depend on which rank or batch ran it and every parallel layout
runs the same episodes. The episode's reward (its per-turn rewards and the final one) is the row's
reward, and the group advantage is per trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.episode_codec import ChatTurnCodec
from titan_tpu.data.tokenizer import HFTokenizer, Tokenizer
from titan_tpu.generation.episodes import EpisodeLimits, Generate, Trajectory, run_episodes
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.environments import EnvFactory, GuardedCalls, environment_factory
from titan_tpu.tasks.grpo.prompts import Prompt, PromptSet, Record, chat_template_of, split_records
from titan_tpu.tasks.grpo.user_code import search_folders


def agree_over_ranks(count: int) -> int:
    """The most running episodes any rank has (this rank's count in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    most = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def _alone(count: int) -> int:
    return count


class EpisodeSource:
    def __init__(self, config: TrainConfig, tokenizer: Tokenizer) -> None:
        rl = config.section(RLConfig)
        self.rl = rl
        self.seed = config.training.seed
        self.factory: EnvFactory = environment_factory(rl.env, rl.env_args, search_folders(config))
        template = chat_template_of(config)
        # RLConfig.check_with refuses the byte tokenizer with rl.env: a checkpoint's folder or chatml_bytes.
        assert template is not None and isinstance(tokenizer, HFTokenizer)
        self.codec = ChatTurnCodec(template, tokenizer, dict(rl.template_switches))
        self.budget = rl.max_episode_tokens or config.training.seq_len
        self.limits = EpisodeLimits(rl.max_turns, self.budget)
        self.latest: dict[int, Trajectory] = {}  # the last rollout's episodes of this rank, by row

    def check_budget(self, needed: int, seq_len: int) -> None:
        """The episode's token budget holds its first turn and fits the training sequence."""
        if self.budget > seq_len:
            raise ConfigError(f"rl.max_episode_tokens {self.budget} is above training.seq_len {seq_len}")
        if self.budget < needed:
            raise ConfigError(
                f"rl.max_episode_tokens {self.budget} is below the longest prompt + rl.max_new_tokens = {needed}"
            )

    def prompt_set(self, config: TrainConfig) -> PromptSet:
        """data.path's records, each rendered as its environment opens an episode of it (which also
        refuses, in one line, a record the environment cannot start from)."""
        train, held_out = split_records(config)
        return PromptSet(self._prompts(train), self._prompts(held_out), self.codec.end_of_turn)

    def _prompts(self, records: Sequence[Record]) -> list[Prompt]:
        calls = GuardedCalls(self.factory.name, [where for where, _ in records], [r for _, r in records])
        prompts = []
        for index, (where, record) in enumerate(records):
            ids = self.codec.prompt(calls.start(self.factory(), index))
            prompts.append(Prompt(self.codec.tokenizer.decode(ids), ids, record, where))
        return prompts

    def sample(
        self,
        generate: Generate,
        prompts: Sequence[Prompt],
        rows: Sequence[int],
        rollout: int,
        params: SamplingParams,
        collective: bool,
    ) -> dict[int, Trajectory]:
        """This rank's episodes of rollout `rollout`: row r is an episode of prompts[r // group_size].
        `collective`: every rank runs its episodes now (their engine calls kept in step)."""
        asked = [prompts[r // self.rl.group_size] for r in rows]
        episodes = self._run(
            generate, asked, params, lambda i, turn: hash((self.seed, rollout, rows[i], turn)) % (2**63), collective
        )
        self.latest = dict(zip(rows, episodes))
        return self.latest

    def greedy(self, generate: Generate, prompts: Sequence[Prompt], params: SamplingParams) -> list[Trajectory]:
        """Greedy episodes of `prompts` (this rank's share of the held-out ones), in step with the other ranks."""
        return self._run(generate, prompts, params, None, collective=True)

    def _run(
        self,
        generate: Generate,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        seeds: Callable[[int, int], int] | None,
        collective: bool,
    ) -> list[Trajectory]:
        calls = GuardedCalls(self.factory.name, [p.place for p in prompts], [p.record for p in prompts])
        return run_episodes(
            generate,
            self.codec,
            [self.factory() for _ in prompts],
            calls,
            params,
            self.limits,
            seeds,
            agree_over_ranks if collective else _alone,
            idle_prompt=[self.codec.end_of_turn_id],
        )


def episode_columns(episodes: Sequence[Trajectory]) -> dict[str, list[float]]:
    """Per episode: its reward, the tokens the model sampled (what is trained), every token after the
    prompt (what the sampler went through), and the counts the record reports per episode."""
    return {
        "reward": [e.reward for e in episodes],
        "length": [float(e.model_tokens) for e in episodes],
        "tokens": [float(len(e.tokens)) for e in episodes],
        "turns": [float(e.turns) for e in episodes],
        "tool_calls": [float(e.tool_calls) for e in episodes],
        "tool_errors": [float(e.tool_errors) for e in episodes],
        "timeouts": [float(e.timeouts) for e in episodes],
    }
