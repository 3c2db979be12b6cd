"""Llama 3 (3.1 / 3.2 shapes), single-device; parallelism is applied from outside.

Module names follow TorchTitan so that tensor-parallel plans and the Hugging Face adapter can address
them: tok_embeddings, layers["i"].{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
feed_forward.{w1,w2,w3}}, norm, output.
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import Attention
from models.common.feed_forward import FeedForward
from models.common.init import trunc_normal_std_
from models.common.norms import RMSNorm
from models.common.rope import RotaryEmbedding
from models.common.transformer import TransformerBlock, depth_scaled_init_std
from models.llama3.args import Llama3Args


def build_llama3_block(args: Llama3Args, layer_id: int) -> TransformerBlock:
    attention = Attention(
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.attn_head_dim,
        qk_norm=False,
        norm_eps=args.norm_eps,
    )
    return TransformerBlock(
        attention=attention,
        feed_forward=FeedForward(args.dim, args.ffn_hidden_dim),
        dim=args.dim,
        norm_eps=args.norm_eps,
        out_init_std=depth_scaled_init_std(layer_id),
    )


class Llama3Model(nn.Module):
    """tokens [B, S] -> logits [B, S, vocab_size] in the parameters' dtype (the loss upcasts).

    Build under `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()`; the result is a
    fully valid model, the rotary tables included.
    """

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.attn_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        # A ModuleDict keyed by the original index, so wrapping a block (activation checkpointing,
        # fully_shard) or dropping some (pipeline stages) keeps the names checkpoints refer to.
        self.layers = nn.ModuleDict({str(i): build_llama3_block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied: no separate head, the logits reuse tok_embeddings.weight (one parameter, one checkpoint key).
        self.output: nn.Linear | None = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise every parameter and recompute the rotary tables on `buffer_device`
        (default: where the tables already are, i.e. the device given to `to_empty`)."""
        self.rope.reset_buffers(buffer_device if buffer_device is not None else self.rope.cos.device)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            block: TransformerBlock = layer  # type: ignore[assignment]
            block.init_weights()
        self.norm.reset_parameters()
        if self.output is not None:
            # Scaled so the initial logits have unit variance given a unit-RMS normed input.
            trunc_normal_std_(self.output.weight, self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(tokens.shape[1])
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)
