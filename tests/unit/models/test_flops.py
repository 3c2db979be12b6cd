"""Our analytic training FLOPs per token against PyTorch's FlopCounterMode on a real forward + backward."""

import dataclasses
import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from titan_tpu.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan_tpu.models.llama3.flops import llama3_flops_per_token, llama3_param_count
from titan_tpu.models.registry import get_model_spec

# The analytic count leaves out what is not a matmul (norms, softmax, rotary); those
# are a fraction of a percent here, so 1% is tight enough to see a missing attention term (3.8% of
# the total at seq_len 64 on the debug flavor) or a missing backward pass (two thirds of it).
TOLERANCE = 0.01


@functools.cache
def counted_flops_per_token(args: Llama3Args, batch: int, seq_len: int) -> float:
    """FLOPs per token FlopCounterMode sees on a forward + backward of the model the registry builds."""
    torch.manual_seed(0)
    spec = get_model_spec("llama3")
    model = spec.model_cls(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1))
    counter = FlopCounterMode(display=False)
    # The CPU flash kernel has no FLOP formula registered (it would count 0); the math backend runs the
    # same attention as plain bmm's, which the counter sees, so the count is complete and honest.
    with sdpa_kernel(SDPBackend.MATH), counter:
        loss = spec.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("seq_len", [64, 256])
def test_registered_flops_match_the_counter(tied: bool, seq_len: int) -> None:
    """The function the trainer gets from the registry, against the count of the registry's model."""
    args = dataclasses.replace(LLAMA3_FLAVORS["debug"], tie_embeddings=tied)
    counted = counted_flops_per_token(args, batch=2, seq_len=seq_len)
    ours = get_model_spec("llama3").flops_per_token(args, seq_len)
    print(f"tied={tied} seq_len={seq_len} ours={ours:.4e} counted={counted:.4e} ratio={ours / counted:.4f}")
    assert ours == pytest.approx(counted, rel=TOLERANCE)


def test_counter_comparison_catches_a_wrong_formula() -> None:
    """Negative control: formulas with a term left out fail the comparison above."""
    args = LLAMA3_FLAVORS["debug"]
    seq_len = 64
    counted = counted_flops_per_token(args, batch=2, seq_len=seq_len)
    non_embedding = llama3_param_count(args, include_embedding=False)  # untied: the head is in
    attention = 12 * args.n_layers * args.n_heads * args.attn_head_dim * seq_len
    without_attention = 6 * non_embedding
    forward_only = (6 * non_embedding + attention) / 3
    assert llama3_flops_per_token(args, seq_len) == without_attention + attention
    for wrong in (without_attention, forward_only):
        assert wrong != pytest.approx(counted, rel=TOLERANCE)


def test_8b_from_its_published_parameter_count() -> None:
    """6N + 12 L H D S with N = 8,030,261,248 (Llama 3.1 8B) - embeddings (the untied head stays in)."""
    args = LLAMA3_FLAVORS["8B"]
    non_embedding = 8_030_261_248 - 128256 * 4096
    expected = 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    assert llama3_flops_per_token(args, 8192) == expected


def test_tied_head_still_counts() -> None:
    untied = LLAMA3_FLAVORS["debug"]
    tied = dataclasses.replace(untied, tie_embeddings=True)
    assert llama3_flops_per_token(tied, 128) == llama3_flops_per_token(untied, 128)
