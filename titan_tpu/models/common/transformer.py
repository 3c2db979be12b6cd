"""A pre-norm decoder block, generic over its attention and feed-forward modules."""

from typing import Any, Protocol

import torch
from torch import nn

from titan_tpu.models.common.attention import Attention
from titan_tpu.models.common.kv_cache import LayerKVCache
from titan_tpu.models.common.norms import RMSNorm


class InitializableFeedForward(Protocol):
    """What a block needs from its feed-forward: a dense SwiGLU and a mixture of experts both qualify."""

    def init_weights(self, out_init_std: float) -> None: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def depth_scaled_init_std(layer_id: int, base_std: float = 0.02) -> float:
    """Init std for the projections that write into the residual stream of block `layer_id`.

    Each block adds two such outputs; shrinking them with depth keeps the residual's variance bounded
    (TorchTitan's depth_init convention).
    """
    return base_std / (2 * (layer_id + 1)) ** 0.5


class TransformerBlock(nn.Module):
    """h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)).

    The submodules are built by the model family and passed in, so Llama, Qwen 3 and Qwen 3 MoE share
    this block and its parameter names (which tensor-parallel plans and checkpoint adapters address).
    """

    def __init__(
        self,
        attention: Attention,
        feed_forward: nn.Module,
        dim: int,
        norm_eps: float,
        out_init_std: float,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = feed_forward
        self.out_init_std = out_init_std

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        feed_forward: InitializableFeedForward = self.feed_forward  # type: ignore[assignment]  # every family's has it
        feed_forward.init_weights(self.out_init_std)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache | None = None,
        start_pos: int = 0,
        attn_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The cache and mask arguments serve generation and padded batches (see `Attention.forward`);
        training passes x, cos, sin, and `document_ids` for packed documents."""
        h = self.attention_residual(
            x, cos, sin, kv_cache=kv_cache, start_pos=start_pos, attn_mask=attn_mask, document_ids=document_ids
        )
        return h + self.feed_forward(self.ffn_norm(h))

    def attention_residual(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attention_args: Any
    ) -> torch.Tensor:
        """x plus the attention of its norm; `attention_args` are `forward`'s cache, mask and documents.
        Keywords, not positions: tensor-parallel plans (PrepareModuleInput) lay out the positional
        inputs x, cos, sin only."""
        return x + self.attention(self.attention_norm(x), cos, sin, **attention_args)
