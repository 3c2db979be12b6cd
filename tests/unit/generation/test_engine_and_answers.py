"""The builtin rollout engine and the greedy answer check (titan_tpu/generation/builtin.py, answers.py).

Bugs caught: an engine that samples from the first policy it was given after new weights were loaded,
seeds that do not reach the sampler (or reach the wrong rows), log-probabilities that are not the
sampler's own, and an answer check whose ranks' shares overlap, leave a prompt out, or whose lockstep
rank without prompts skips the forwards its peers wait for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from titan_tpu.generation.answers import greedy_answer_score
from titan_tpu.generation.builtin import BuiltinEngine
from titan_tpu.generation.sampler import generate_by_length, row_uniforms
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.protocols.rollout import Rollout, SamplingParams

PAD = 0
PROMPTS = [[5, 9, 23, 7, 11], [42, 8], [100, 3, 17], [64], [7, 7, 7]]
CPU = torch.device("cpu")


def tiny_model(seed: int) -> Qwen3Model:
    torch.manual_seed(seed)
    args = dataclasses.replace(
        QWEN3_FLAVORS["debug"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden_dim=128,
        vocab_size=128,
        max_seq_len=64,
    )
    model = Qwen3Model(args)
    model.init_weights()
    with torch.no_grad():  # clear margins, so greedy tokens depend on the weights
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def engine(buckets: int = 1) -> BuiltinEngine:
    return BuiltinEngine(DECODER_DECODING, PAD, CPU, reshard_after=lambda group: True, buckets=buckets)


def test_the_engine_samples_what_the_sampler_samples_row_by_row() -> None:
    model, params = tiny_model(0), SamplingParams(8, temperature=1.0, top_p=0.9)
    seeds = [11, 12, 13, 14, 15]
    sampler = generate_by_length(model, DECODER_DECODING, PROMPTS, params, PAD, CPU, 2, row_uniforms(seeds, 8))
    built = engine(buckets=2)
    built.load_weights(model, version=3)
    got = built.generate(PROMPTS, params, seeds)
    assert got.tokens == sampler.lists() and got.stopped == sampler.stopped.tolist()
    for ours, theirs in zip(got.logps, sampler.logp_lists()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert "step 3" in built.describe()
    # Negative control: other seeds are other completions.
    assert built.generate(PROMPTS, params, [s + 100 for s in seeds]).tokens != got.tokens


def test_loading_weights_switches_the_policy() -> None:
    greedy = SamplingParams(8, temperature=0.0)
    first, second = tiny_model(0), tiny_model(1)
    built = engine()
    built.load_weights(first, version=0)
    before = built.generate(PROMPTS, greedy).tokens
    built.load_weights(second, version=1)
    after = built.generate(PROMPTS, greedy).tokens
    reference = engine()
    reference.load_weights(second, version=1)
    assert after == reference.generate(PROMPTS, greedy).tokens and after != before


def test_the_engine_refuses_what_it_cannot_do() -> None:
    built = engine()
    with pytest.raises(RuntimeError, match="before load_weights"):
        built.generate(PROMPTS, SamplingParams(4))
    built.load_weights(tiny_model(0), version=0)
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        built.generate(PROMPTS, SamplingParams(4), seeds=[1, 2])


class RecordingEngine:
    """Answers each prompt with its own first token; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[list[int]]] = []

    def load_weights(self, policy: torch.nn.Module, version: int) -> None: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> Rollout:
        self.asked.append([list(p) for p in prompts])
        return Rollout([[p[0]] for p in prompts], [torch.zeros(1) for _ in prompts], [True] * len(prompts))

    def describe(self) -> str:
        return "recording"


def test_the_answer_check_splits_prompts_over_ranks_and_scores_each_once() -> None:
    greedy = SamplingParams(4, temperature=0.0)

    # An answer scores its prompt's index + 1, so a prompt answered twice or never shows in the sum.
    def score(indices: list[int], answers: list[list[int]]) -> float:
        assert [a[0] for a in answers] == [PROMPTS[i][0] for i in indices]
        return float(sum(i + 1 for i in indices))

    whole = greedy_answer_score(RecordingEngine(), PROMPTS, greedy, score, 0, 1, None, CPU)
    shares = [greedy_answer_score(RecordingEngine(), PROMPTS, greedy, score, rank, 3, None, CPU) for rank in range(3)]
    assert whole == (15.0, 5)
    assert sum(s for s, _ in shares) == 15.0 and [n for _, n in shares] == [2, 2, 1]
    with pytest.raises(ValueError, match="temperature 0"):
        greedy_answer_score(RecordingEngine(), PROMPTS, SamplingParams(4), score, 0, 1, None, CPU)


def test_a_rank_without_prompts_decodes_one_in_lockstep_only() -> None:
    greedy = SamplingParams(4, temperature=0.0)
    alone, locked = RecordingEngine(), RecordingEngine()
    # Rank 5 of 8 has no prompt among 5.
    assert greedy_answer_score(alone, PROMPTS, greedy, lambda i, a: 1.0, 5, 8, None, CPU) == (0.0, 0)
    assert greedy_answer_score(locked, PROMPTS, greedy, lambda i, a: 1.0, 5, 8, None, CPU, in_lockstep=True) == (0.0, 0)
    assert alone.asked == [] and locked.asked == [[PROMPTS[0]]]
