"""Blocked causal attention computes what scaled_dot_product_attention computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common.attention import Attention, blocked_causal_attention


@pytest.mark.parametrize("seqlen, block", [(7, 128), (128, 128), (300, 128), (300, 64), (97, 16)])
def test_blocked_equals_sdpa_forward_and_backward(seqlen: int, block: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, seqlen, 32, requires_grad=True) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    actual = blocked_causal_attention(q, k, v, block)
    actual_grads = torch.autograd.grad(actual, (q, k, v), grad_out)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_layer_output_does_not_depend_on_the_kernel() -> None:
    torch.manual_seed(0)
    fused = Attention(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, norm_eps=1e-6)
    blocked = Attention(
        dim=64, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, norm_eps=1e-6, attention_block=32
    )
    blocked.load_state_dict(fused.state_dict())
    x = torch.randn(2, 100, 64)
    angles = torch.randn(100, 8)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    torch.testing.assert_close(blocked(x, cos, sin), fused(x, cos, sin), atol=1e-5, rtol=1e-5)
