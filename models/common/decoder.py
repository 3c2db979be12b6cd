"""The frame every decoder-only family shares: token embedding, rotary tables, a ModuleDict of blocks,
final norm and output head (or the embedding reused as the head when tied). Families pass in their
blocks; `forward` is the plain decoder, which a family overrides when its blocks return more (MoE)."""

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_std_
from models.common.kv_cache import KVCache, padded_causal_mask
from models.common.norms import RMSNorm
from models.common.rope import RopeScaling, RotaryEmbedding
from models.common.transformer import TransformerBlock


class DecoderLM(nn.Module):
    def __init__(
        self,
        blocks: list[nn.Module],
        vocab_size: int,
        dim: int,
        head_dim: int,
        max_seq_len: int,
        rope_theta: float,
        rope_scaling: RopeScaling | None,
        norm_eps: float,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.rope = RotaryEmbedding(head_dim, max_seq_len, rope_theta, rope_scaling)
        # A ModuleDict keyed by the original index, so wrapping a block (activation checkpointing,
        # fully_shard) or dropping some (pipeline stages) keeps the names checkpoints refer to.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(dim, norm_eps)
        # Tied: no separate head, the logits reuse tok_embeddings.weight (one parameter, one checkpoint key).
        self.output: nn.Linear | None = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)

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
            trunc_normal_std_(self.output.weight, self.dim**-0.5)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size] in the parameters' dtype (the loss upcasts).

        Training passes tokens only. Generation passes a `KVCache` and the slot of tokens[:, 0]
        (`start_pos`): prefill the prompts at 0, then feed one token per call. `key_padding_mask`
        [B, S] marks real tokens (True) of left-padded rows, with or without a cache; the convention
        is in kv_cache.py.
        """
        if cache is None and start_pos != 0:
            raise ValueError(f"start_pos {start_pos} needs a KVCache holding the earlier positions")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(start_pos + tokens.shape[1])
        cos, sin = cos[start_pos:], sin[start_pos:]
        if cache is None and key_padding_mask is None:
            for layer in self.layers.values():
                h = layer(h, cos, sin)
            return self.logits(h)
        if cache is None:
            attn_mask = padded_causal_mask(key_padding_mask)  # type: ignore[arg-type]
        else:
            attn_mask = cache.advance(start_pos, tokens, key_padding_mask)
        for name, layer in self.layers.items():
            layer_cache = cache.layer(name) if cache is not None else None
            h = layer(h, cos, sin, kv_cache=layer_cache, start_pos=start_pos, attn_mask=attn_mask)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)
