"""The FLOPs a GRPO rollout is charged (titan_tpu/tasks/grpo/rollout_flops.py): by hand on a tiny
case, and against PyTorch's FlopCounterMode on the real sampler and log-prob pass of every decoder
family GRPO trains (llama3, qwen3, qwen3_moe), each with wrong counts as negative controls."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from titan_tpu.generation.logprobs import token_logps
from titan_tpu.generation.sampler import generate
from titan_tpu.models.common.decode_step import DECODER_DECODING
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS, Qwen3Args
from titan_tpu.models.registry import get_model_spec
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.tasks.grpo.rollout_flops import ForwardCost, rollout_flops

# The convention's N includes the RMSNorm weights, which are elementwise, not matmuls, so the counter
# never sees them: 0.07-0.1% of these debug models' totals. 0.2% still sees every wrong count below
# (the smallest, a forgotten attention term, is 4% at a 64-token prompt).
TOLERANCE = 0.002
PROMPT, COMPLETION = 64, 8


def test_a_tiny_case_equals_the_hand_computation() -> None:
    """Catches a wrong decode sum (the prefill's square, the keys of each step, the last token fed
    back or not) and a wrong share of training FLOPs in the forward.

    Qwen 3, dim 8, one layer, 2 heads of 4, 1 kv head, SwiGLU 16, vocab 32. Non-embedding weights:
    q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, q/k norms 2 x 4, SwiGLU 3 x 8 x 16 = 384, two norms 16, final
    norm 8, head 32 x 8 = 256: N = 864, so 2N = 1728 per token, and 4 L H D = 4 x 1 x 2 x 4 = 32 per key.
    Prompt 3, completion 3: prefill 3 x (1728 + 32 x 3) = 5472; decode steps against 4 and 5 keys:
    (1728 + 128) + (1728 + 160) = 3744; sampling 9216. One log-prob pass over the 6 tokens:
    6 x (1728 + 32 x 6) = 11520.
    """
    args = Qwen3Args(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, vocab_size=32, ffn_hidden_dim=16)
    cost = ForwardCost.of_family(get_model_spec("qwen3").flops_per_token, args)
    assert cost == ForwardCost(per_token=1728, per_key=32)
    assert cost.sampling(3, 3) == 9216
    assert cost.sampling(3, 1) == 3 * (1728 + 96)  # one generated token: the prefill alone
    assert cost.scoring(6) == 11520
    scoring = 2 * (11520 + 4 * (1728 + 128))
    # Two rows sharing the prompt: one prefill, then each row's decode steps (3744 and none).
    assert rollout_flops(cost, [(3, [3, 1])], scoring_passes=2) == 5472 + 3744 + scoring
    assert rollout_flops(cost, [(3, [3]), (3, [1])], scoring_passes=2) == 9216 + 5472 + scoring
    # Negative controls: the prompt recomputed at every decode step (no cache), and no attention term.
    no_cache = 5472 + 4 * (1728 + 128) + 5 * (1728 + 160)
    no_attention = ForwardCost(per_token=1728, per_key=0)
    assert no_cache != cost.sampling(3, 3) and no_attention.sampling(3, 3) != cost.sampling(3, 3)


FAMILIES = {
    "llama3": LLAMA3_FLAVORS["debug"],
    "qwen3": QWEN3_FLAVORS["debug"],
    # The reference expert path: the counter has no formula for grouped_mm, and padded_bmm's padding
    # rows would be counted as work.
    "qwen3_moe": dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], expert_impl="loop"),
}


@functools.cache
def counted(family: str) -> tuple[float, float]:
    """(FLOPs the counter sees sampling COMPLETION tokens after a PROMPT-token prompt with the KV
    cache, FLOPs of one log-prob pass over prompt + completion), one row so nothing is padding."""
    args: Any = FAMILIES[family]
    torch.manual_seed(0)
    model = get_model_spec(family).model_cls(args)
    model.init_weights()
    prompt = torch.randint(0, args.vocab_size, (PROMPT,)).tolist()
    greedy_without_stop = SamplingParams(COMPLETION, temperature=0.0)
    sampling, scoring = FlopCounterMode(display=False), FlopCounterMode(display=False)
    # The CPU flash kernel has no FLOP formula; the math backend runs attention as matmuls the counter sees.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        with sampling:
            completion = generate(
                model, DECODER_DECODING, [prompt], greedy_without_stop, 0, torch.device("cpu")
            ).lists()[0]
        assert len(completion) == COMPLETION
        with scoring:
            token_logps(model, torch.tensor([prompt + completion]))
    return sampling.get_total_flops(), scoring.get_total_flops()


def family_cost(family: str) -> ForwardCost:
    return ForwardCost.of_family(get_model_spec(family).flops_per_token, FAMILIES[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_matches_the_counter(family: str) -> None:
    """The cost the task derives from the family's registered FLOPs function, against the counter on
    the family's model. Catches a family whose training count is not three forwards, or whose cached
    decode step attends to more (or fewer) keys than the count charges."""
    cost = family_cost(family)
    sampling, scoring = counted(family)
    print(
        f"{family}: sampling ours/counted {cost.sampling(PROMPT, COMPLETION) / sampling:.5f}, "
        f"scoring {cost.scoring(PROMPT + COMPLETION) / scoring:.5f}"
    )
    assert cost.sampling(PROMPT, COMPLETION) == pytest.approx(sampling, rel=TOLERANCE)
    assert cost.scoring(PROMPT + COMPLETION) == pytest.approx(scoring, rel=TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_counts_miss_the_counter(family: str) -> None:
    """Negative controls for the test above: counting the whole prompt again at every decode step,
    forgetting the attention term, feeding back the last token too, or charging the training FLOPs
    instead of a forward each fall outside its tolerance."""
    cost = family_cost(family)
    sampling, scoring = counted(family)
    no_cache = PROMPT * cost.token(PROMPT) + sum((PROMPT + j) * cost.token(PROMPT + j) for j in range(1, COMPLETION))
    no_attention = ForwardCost(cost.per_token, per_key=0.0)
    training = ForwardCost(3 * cost.per_token, 3 * cost.per_key)
    for wrong in (
        no_cache,
        no_attention.sampling(PROMPT, COMPLETION),
        cost.sampling(PROMPT, COMPLETION + 1),
        training.sampling(PROMPT, COMPLETION),
    ):
        assert wrong != pytest.approx(sampling, rel=TOLERANCE)
    assert no_attention.scoring(PROMPT + COMPLETION) != pytest.approx(scoring, rel=TOLERANCE)
