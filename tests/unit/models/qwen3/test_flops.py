"""Qwen 3 training FLOPs per token against PyTorch's FlopCounterMode on a real forward + backward.

The MoE model is counted on its reference expert path (a loop of plain matmuls over each expert's
tokens): FlopCounterMode registers no formula for `torch._grouped_mm` (it would count 0), and the
padded-bmm path's padding rows are counted as if they were work.
"""

import dataclasses
import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS, Qwen3Args, Qwen3MoeArgs
from titan_tpu.models.qwen3.flops import qwen3_flops_per_token, qwen3_param_count
from titan_tpu.models.registry import get_model_spec

# As in test_flops.py: what the counter sees beyond our matmul count (norms, softmax, the router's
# softmax and top-k) is a fraction of a percent; 1% still sees a missing term.
TOLERANCE = 0.01


def spec_for(args: Qwen3Args):
    return get_model_spec("qwen3_moe" if isinstance(args, Qwen3MoeArgs) else "qwen3")


@functools.cache
def counted_flops_per_token(args: Qwen3Args, batch: int, seq_len: int) -> float:
    """FLOPs per token FlopCounterMode sees on a forward + backward of the model the registry builds."""
    torch.manual_seed(0)
    spec = spec_for(args)
    model = spec.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        spec.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return counter.get_total_flops() / (batch * seq_len)


MOE_LOOP = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], expert_impl="loop")


@pytest.mark.parametrize("seq_len", [64, 256])
@pytest.mark.parametrize(
    "args",
    [QWEN3_FLAVORS["debug"], dataclasses.replace(QWEN3_FLAVORS["debug"], tie_embeddings=True), MOE_LOOP],
    ids=["dense", "dense_tied", "moe"],
)
def test_registered_flops_match_the_counter(args: Qwen3Args, seq_len: int) -> None:
    """The function the trainer gets from the registry, against the count of the registry's model."""
    counted = counted_flops_per_token(args, batch=2, seq_len=seq_len)
    ours = spec_for(args).flops_per_token(args, seq_len)
    print(f"{type(args).__name__} seq_len={seq_len} ours={ours:.4e} counted={counted:.4e} ratio={ours / counted:.4f}")
    assert ours == pytest.approx(counted, rel=TOLERANCE)


def test_counter_comparison_catches_counting_every_expert() -> None:
    """Negative control: charging a token for all experts, not the top-k it is routed to, fails."""
    seq_len = 64
    counted = counted_flops_per_token(MOE_LOOP, batch=2, seq_len=seq_len)
    attention = 12 * MOE_LOOP.n_layers * MOE_LOOP.n_heads * MOE_LOOP.head_dim * seq_len
    every_expert = qwen3_param_count(MOE_LOOP, include_embedding=False)
    active = qwen3_param_count(MOE_LOOP, include_embedding=False, active=True)
    assert qwen3_flops_per_token(MOE_LOOP, seq_len) == 6 * active + attention
    assert 6 * every_expert + attention != pytest.approx(counted, rel=TOLERANCE)


def test_moe_counts_only_activated_experts() -> None:
    """30B-A3B by hand: attention + router + 8 of 128 experts per layer, the head, not the embedding."""
    args = QWEN3_MOE_FLAVORS["30B-A3B"]
    attention = 2048 * 128 * (2 * 32 + 2 * 4) + 2 * 128
    per_layer = attention + 128 * 2048 + 8 * 3 * 2048 * 768 + 2 * 2048
    non_embedding = 48 * per_layer + 2048 + 151936 * 2048
    expected = 6 * non_embedding + 12 * 48 * 32 * 128 * 4096
    assert qwen3_flops_per_token(args, 4096) == expected
    assert non_embedding == qwen3_param_count(args, include_embedding=False, active=True)


def test_tied_head_still_counts() -> None:
    untied = QWEN3_FLAVORS["debug"]
    tied = dataclasses.replace(untied, tie_embeddings=True)
    assert qwen3_flops_per_token(tied, 128) == qwen3_flops_per_token(untied, 128)
