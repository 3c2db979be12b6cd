"""Multi-turn episodes (titan_tpu/generation/episodes.py) with the real calculator environment and the
chatml_bytes template, the model replaced by scripted turns: the tokens trained are the tokens sampled,
turn after turn, and only they are marked as the model's; the environment's answers come in through the
template's delta; every way an episode ends; ranks kept in step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.chat_tokenizer import tokenizer_folder
from titan_tpu.data.episode_codec import ChatTurnCodec
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.environments.calculator import Calculator
from titan_tpu.generation.episodes import EpisodeLimits, Trajectory, run_episodes
from titan_tpu.protocols.environment import Environment, EnvReply, EpisodeStart, ModelTurn
from titan_tpu.protocols.rollout import Rollout, SamplingParams

TOKENIZER = build_tokenizer("chatml_bytes")
CODEC = ChatTurnCodec(ChatTemplate.from_folder(tokenizer_folder("chatml_bytes")), TOKENIZER, {})  # type: ignore[arg-type]
EOT = CODEC.end_of_turn_id
# The model's spelling of a call: compact JSON, which the template would write with spaces.
CALL = '<tool_call>\n{"name":"calculator","arguments":{"expression":"347*829"}}\n</tool_call>'
RECORD = {"prompt": "What is 347 * 829?", "answer": "287663"}
PARAMS = SamplingParams(max_new_tokens=96, temperature=1.0)


class Calls:
    """The environment's methods as the trainer calls them, on one record."""

    def __init__(self, record: dict[str, str]) -> None:
        self.record = record

    def start(self, env: Environment, index: int) -> EpisodeStart:
        return env.start(self.record)

    def step(self, env: Environment, index: int, turn: ModelTurn) -> EnvReply:
        return env.step(turn)

    def reward(self, env: Environment, index: int) -> float:
        return env.reward()


class Scripted:
    """`generate` answering every prompt with the next of its turns (text, whether it ends with the
    end-of-turn token); records what it was asked."""

    def __init__(self, turns: Sequence[tuple[str, bool]]) -> None:
        self.turns = list(turns)
        self.asked: list[list[list[int]]] = []
        self.sampled: list[list[int]] = []

    def __call__(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None
    ) -> Rollout:
        self.asked.append([list(p) for p in prompts])
        text, ends = self.turns.pop(0)
        ids = TOKENIZER.encode(text) + ([EOT] if ends else [])
        self.sampled.append(ids)
        logps = torch.linspace(-1.0, -2.0, len(ids))
        return Rollout(tokens=[ids] * len(prompts), logps=[logps] * len(prompts), stopped=[ends] * len(prompts))


def episode(turns: Sequence[tuple[str, bool]], max_turns: int = 4, budget: int = 4096) -> tuple[Trajectory, Scripted]:
    generate = Scripted(turns)
    [trajectory] = run_episodes(
        generate,
        CODEC,
        [Calculator()],
        Calls(RECORD),
        PARAMS,
        EpisodeLimits(max_turns, budget),
        None,
        lambda n: n,
        [EOT],
    )
    return trajectory, generate


def test_trained_tokens_are_the_sampled_ones_and_the_environment_answers_through_the_delta() -> None:
    """Catches a rollout that re-tokenises the conversation (the compact call would come back with the
    template's spaces), one that marks the tool result as the model's, and a delta that loses the
    tool's answer."""
    trajectory, generate = episode([(CALL, True), ("287663", True)])
    assert trajectory.end == "environment" and trajectory.turns == 2 and trajectory.reward == 1.0
    sampled = [t for t, mine in zip(trajectory.tokens, trajectory.trained) if mine]
    assert sampled == generate.sampled[0] + generate.sampled[1]
    # The second turn was prompted with exactly the first prompt, the first turn's tokens and the delta.
    delta = trajectory.tokens[len(generate.sampled[0]) : len(trajectory.tokens) - len(generate.sampled[1])]
    assert generate.asked[1][0] == trajectory.prompt + generate.sampled[0] + delta
    assert not any(trajectory.trained[len(generate.sampled[0]) : len(generate.sampled[0]) + len(delta)])
    assert TOKENIZER.decode(delta) == (
        "\n<|im_start|>user\n<tool_response>\n287663\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert trajectory.logps[: len(generate.sampled[0])] == torch.linspace(-1.0, -2.0, len(generate.sampled[0])).tolist()
    assert all(value == 0.0 for value, mine in zip(trajectory.logps, trajectory.trained) if not mine)
    # Negative control: rendering the conversation again and tokenising it whole gives other tokens than
    # were sampled (the template writes the call's JSON with spaces), which a text round trip would train on.
    rerendered = TOKENIZER.encode(CODEC.template.render(trajectory.messages, tools=trajectory.tools))
    assert rerendered[: len(trajectory.prompt)] == trajectory.prompt
    assert rerendered[len(trajectory.prompt) :][: len(trajectory.tokens)] != trajectory.tokens


def test_invalid_utf8_survives_only_token_in_token_out() -> None:
    """A sampled byte sequence that is not UTF-8 is kept as sampled; decoding and encoding it again
    (what a text round trip does) turns it into the replacement character's bytes."""
    broken = TOKENIZER.encode("é")[:1]  # the first byte of a two-byte character
    generate = Scripted([])
    generate.turns = []

    def once(prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None) -> Rollout:
        generate.sampled.append(broken + [EOT])
        return Rollout(tokens=[broken + [EOT]], logps=[torch.zeros(2)], stopped=[True])

    [trajectory] = run_episodes(
        once, CODEC, [Calculator()], Calls(RECORD), PARAMS, EpisodeLimits(1, 4096), None, lambda n: n, [EOT]
    )
    assert trajectory.tokens == broken + [EOT]
    assert TOKENIZER.encode(TOKENIZER.decode(broken)) != broken


def test_a_malformed_call_is_answered_as_an_error_and_the_episode_goes_on() -> None:
    """Catches a parse failure that crashes the rollout instead of telling the model."""
    trajectory, generate = episode([("<tool_call>\n{not json}\n</tool_call>", True), (CALL, True), ("287663", True)])
    assert trajectory.turns == 3 and trajectory.tool_calls == 2 and trajectory.tool_errors == 1
    assert trajectory.messages[2]["role"] == "tool" and trajectory.messages[2]["content"].startswith("error: ")
    assert trajectory.reward == 1.0


def test_every_way_an_episode_ends() -> None:
    """max_turns, a turn cut without its end-of-turn token, and a next turn that would not fit the budget;
    the reward is the environment's for each (no answer: 0)."""
    by_turns, generate = episode([(CALL, True), (CALL, True)], max_turns=2)
    assert (by_turns.end, by_turns.turns, by_turns.reward) == ("max_turns", 2, 0.0)
    assert len(generate.asked) == 2
    cut, generate = episode([("287", False)])
    assert (cut.end, cut.turns, cut.reward) == ("cut", 1, 0.0)
    assert cut.tokens == TOKENIZER.encode("287")  # no end-of-turn, no delta after it
    first_prompt = len(CODEC.prompt(Calculator().start(RECORD)))
    # Room for one turn, not two: the second is never sampled.
    tight, generate = episode([(CALL, True), ("287663", True)], budget=first_prompt + PARAMS.max_new_tokens + 40)
    assert (tight.end, tight.turns) == ("token_budget", 1) and len(generate.asked) == 1
    assert len(tight.prompt) + len(tight.tokens) <= first_prompt + PARAMS.max_new_tokens + 40


def test_a_rank_without_running_episodes_keeps_sampling_in_step() -> None:
    """Under FSDP every `generate` gathers the policy with the other ranks: a rank whose episodes ended
    (or that has none) must call it as often as the busiest rank, or the job hangs."""
    generate = Scripted([("x", True)] * 3)
    agreed = iter([2, 1, 0])
    out = run_episodes(
        generate, CODEC, [], Calls(RECORD), PARAMS, EpisodeLimits(4, 4096), None, lambda n: next(agreed), [EOT]
    )
    assert out == [] and generate.asked == [[[EOT]], [[EOT]]]


class Echo:
    """A user's environment: answers each turn with a user message, ends after the second, and rewards
    per turn (0.25 each) plus 0.5 at the end."""

    def __init__(self) -> None:
        self.turns = 0

    def start(self, record: dict[str, str]) -> EpisodeStart:
        return EpisodeStart([{"role": "user", "content": record["prompt"]}])

    def step(self, turn: ModelTurn) -> EnvReply:
        self.turns += 1
        return EnvReply([{"role": "user", "content": f"again ({self.turns})"}], done=self.turns == 2, reward=0.25)

    def reward(self) -> float:
        return 0.5


def test_per_turn_rewards_add_to_the_final_one_and_a_user_reply_is_a_delta() -> None:
    generate = Scripted([("a", True), ("b", True)])
    [trajectory] = run_episodes(
        generate, CODEC, [Echo()], Calls(RECORD), PARAMS, EpisodeLimits(4, 4096), None, lambda n: n, [EOT]
    )
    assert trajectory.reward == 1.0 and trajectory.end == "environment"
    assert "<|im_start|>user\nagain (1)<|im_end|>" in TOKENIZER.decode(trajectory.tokens)
