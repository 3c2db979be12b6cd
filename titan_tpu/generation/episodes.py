"""Multi-turn episodes, token in and token out: a model turn is sampled, the environment answers it, the
answer's tokens are appended, and the next turn is sampled from there.

Every turn's prompt is the previous turn's prompt, the tokens the model sampled, and the tokens of the
environment's messages as the chat template renders them after the model's end-of-turn (the codec's
`delta`). The conversation is never tokenised again as a whole, so the tokens trained on are exactly the
ones sampled: re-rendering a sampled turn would replace the model's own spelling of a tool call with the
template's (`{"a":1}` -> `{"a": 1}`) and bytes that are not valid UTF-8 with a replacement character.
Each token records whether the model sampled it (`trained`): the environment's tokens and the template's
scaffolding between turns get no gradient.

An episode ends when the environment says so, after `max_turns` model turns, when a turn does not end
with the template's end-of-turn token (cut by the token limit, or stopped by end-of-text), or before a
turn that could pass the token budget.

Ranks that hold other episodes may share the engine's collectives (FSDP gathers the policy for every
`generate`, expert parallelism exchanges tokens in every forward), so every rank calls `generate` as many
times: `agree` turns this rank's count of running episodes into the most any rank has, and a rank
whose episodes have all ended samples one idle prompt until every rank's have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from titan_tpu.protocols.environment import Environment, EnvReply, EpisodeStart, Message, ModelTurn
from titan_tpu.protocols.rollout import Rollout, SamplingParams

Generate = Callable[[Sequence[Sequence[int]], SamplingParams, Sequence[int] | None], Rollout]


class TurnCodec(Protocol):
    """Messages to tokens and back, as the checkpoint's chat template writes them."""

    end_of_turn_id: int  # the token that ends a model turn, after which the environment may answer

    def prompt(self, start: EpisodeStart) -> list[int]:
        """The episode's first prompt: its messages and tools, then the assistant's header."""
        ...

    def model_turn(self, ids: Sequence[int], ended: bool) -> ModelTurn:
        """A sampled turn (its end-of-turn token left out when `ended`) decoded and parsed."""
        ...

    def delta(self, history: Sequence[Message], new: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[int]:
        """The tokens after the last model turn's end-of-turn that bring `new` in and open the next
        assistant turn."""
        ...


class EnvironmentCalls(Protocol):
    """The environment's methods as the caller guards them (naming the environment and the record
    when one raises)."""

    def start(self, env: Environment, index: int) -> EpisodeStart: ...

    def step(self, env: Environment, index: int, turn: ModelTurn) -> EnvReply: ...

    def reward(self, env: Environment, index: int) -> float: ...


@dataclass
class Trajectory:
    """One episode: its first prompt's ids, then every token after it with whether the model sampled
    it and its log-probability under the sampling policy (0 on the environment's tokens)."""

    prompt: list[int]
    messages: list[Message]
    tools: list[dict[str, Any]]
    tokens: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    timeouts: int = 0
    end: str = ""  # why it ended: environment, max_turns, cut (no end-of-turn), token_budget

    @property
    def model_tokens(self) -> int:
        return sum(self.trained)

    def logp_tensor(self) -> torch.Tensor:
        return torch.tensor(self.logps, dtype=torch.float32)

    def _append(self, ids: Sequence[int], sampled: bool, logps: Sequence[float] | None = None) -> None:
        self.tokens += list(ids)
        self.trained += [sampled] * len(ids)
        self.logps += list(logps) if logps is not None else [0.0] * len(ids)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    token_budget: int  # the prompt and every token after it


def run_episodes(
    generate: Generate,
    codec: TurnCodec,
    envs: Sequence[Environment],
    calls: EnvironmentCalls,
    params: SamplingParams,
    limits: EpisodeLimits,
    seeds: Callable[[int, int], int] | None,
    agree: Callable[[int], int],
    idle_prompt: Sequence[int],
) -> list[Trajectory]:
    """Run one episode per environment to its end. `seeds(episode, turn)` seeds each sampled turn
    (None: greedy); `agree` and `idle_prompt` keep every rank's `generate` calls in step (see above)."""
    trajectories = []
    for index, env in enumerate(envs):
        start = calls.start(env, index)
        ids = codec.prompt(start)
        trajectories.append(Trajectory(prompt=ids, messages=list(start.messages), tools=list(start.tools)))
    running = list(range(len(envs)))
    for turn in range(limits.max_turns):
        if turn == 0:
            for i in running:
                if len(trajectories[i].prompt) + params.max_new_tokens > limits.token_budget:
                    trajectories[i].end = "token_budget"  # not even one whole turn fits
            running = [i for i in running if not trajectories[i].end]
        if agree(len(running)) == 0:
            break
        asked = [trajectories[i].prompt + trajectories[i].tokens for i in running]
        turn_seeds = None if seeds is None else [seeds(i, turn) for i in running]
        if not asked:
            asked, turn_seeds = [list(idle_prompt)], None if seeds is None else [0]
        out = generate(asked, params, turn_seeds)
        for k, i in enumerate(running):
            trajectory = trajectories[i]
            sampled = out.tokens[k]
            trajectory._append(sampled, True, out.logps[k].tolist())
            trajectory.turns += 1
            ended = bool(out.stopped[k]) and bool(sampled) and sampled[-1] == codec.end_of_turn_id
            model_turn = codec.model_turn(sampled[:-1] if ended else sampled, ended)
            trajectory.messages.append(model_turn.message())
            reply = calls.step(envs[i], i, model_turn)
            trajectory.tool_calls += len(model_turn.tool_calls) + len(model_turn.call_errors)
            trajectory.tool_errors += reply.tool_errors
            trajectory.timeouts += reply.timeouts
            trajectory.reward += reply.reward
            if not ended:
                trajectory.end = "cut"
            elif reply.done:
                trajectory.end = "environment"
            elif turn + 1 == limits.max_turns:
                trajectory.end = "max_turns"
            else:
                new = list(reply.messages)
                delta = codec.delta(trajectory.messages, new, trajectory.tools)
                held = len(trajectory.prompt) + len(trajectory.tokens) + len(delta)
                if held + params.max_new_tokens > limits.token_budget:
                    trajectory.end = "token_budget"  # the answer and a whole next turn would not fit
                else:
                    trajectory._append(delta, False)
                    trajectory.messages += new
        running = [i for i in running if not trajectories[i].end]
    for index, (env, trajectory) in enumerate(zip(envs, trajectories)):
        trajectory.reward += calls.reward(env, index)
    return trajectories
