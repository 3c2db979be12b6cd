"""Qwen 3 training FLOPs per token against PyTorch's FlopCounterMode on a real forward + backward.

The MoE model is counted on its reference expert path (a loop of plain matmuls over each expert's
tokens): FlopCounterMode registers no formula for `torch._grouped_mm` (it would count 0), and the
padded-bmm path's padding rows are counted as if they were work.
"""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models import get_model_spec
from models.common.flops import decoder_training_flops_per_token
from models.qwen3 import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS, Qwen3Args, Qwen3MoeArgs, Qwen3Model, Qwen3MoeModel
from models.qwen3 import qwen3_flops_per_token, qwen3_param_count


def _counted_flops_per_token(args: Qwen3Args, batch: int, seq_len: int) -> float:
    torch.manual_seed(0)
    spec = get_model_spec("qwen3_moe" if isinstance(args, Qwen3MoeArgs) else "qwen3")
    model = (Qwen3MoeModel if isinstance(args, Qwen3MoeArgs) else Qwen3Model)(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        spec.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.mark.parametrize("seq_len", [64, 256])
@pytest.mark.parametrize(
    "args",
    [
        QWEN3_FLAVORS["debug"],
        dataclasses.replace(QWEN3_FLAVORS["debug"], tie_embeddings=True),
        dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], expert_impl="loop"),
    ],
    ids=["dense", "dense_tied", "moe"],
)
def test_flops_match_the_counter(args: Qwen3Args, seq_len: int) -> None:
    counted = _counted_flops_per_token(args, batch=2, seq_len=seq_len)
    ours = qwen3_flops_per_token(args, seq_len)
    print(f"{type(args).__name__} seq_len={seq_len} ours={ours:.4e} counted={counted:.4e} ratio={ours / counted:.4f}")
    assert ours == pytest.approx(counted, rel=0.05)


def test_moe_counts_only_activated_experts() -> None:
    """30B-A3B by hand: attention + router + 8 of 128 experts per layer, the head, not the embedding."""
    args = QWEN3_MOE_FLAVORS["30B-A3B"]
    attention = 2048 * 128 * (2 * 32 + 2 * 4) + 2 * 128
    per_layer = attention + 128 * 2048 + 8 * 3 * 2048 * 768 + 2 * 2048
    non_embedding = 48 * per_layer + 2048 + 151936 * 2048
    expected = 6 * non_embedding + 12 * 48 * 32 * 128 * 4096
    assert qwen3_flops_per_token(args, 4096) == expected
    assert decoder_training_flops_per_token(non_embedding, 48, 32, 128, 4096) == expected
    assert non_embedding == qwen3_param_count(args, include_embedding=False, active=True)
    # All 128 experts would be ~9x more: the total is not what MFU is measured against.
    assert qwen3_param_count(args) > 9 * qwen3_param_count(args, active=True)


def test_tied_head_still_counts_and_registry() -> None:
    untied = QWEN3_FLAVORS["debug"]
    tied = dataclasses.replace(untied, tie_embeddings=True)
    assert qwen3_flops_per_token(tied, 128) == qwen3_flops_per_token(untied, 128)
    assert get_model_spec("qwen3").flops_per_token is qwen3_flops_per_token
    assert get_model_spec("qwen3_moe").flops_per_token is qwen3_flops_per_token
