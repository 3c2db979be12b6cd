"""The frame every decoder-only family shares: token embedding, rotary tables, a ModuleDict of blocks,
final norm and output head (or the embedding reused as the head when tied), all sized by
`DecoderArgs`. Families pass in their blocks (`decoder_block` builds the shared pre-norm one around
the family's feed-forward); `forward` is the plain decoder, which a family overrides when its blocks
return more (MoE).

A pipeline stage is this model with the modules of other stages removed (set to None, layers deleted
from the ModuleDict), the rest keeping their names: without tok_embeddings the input is the previous
stage's hidden states, without norm (and head) the output is the hidden states for the next stage.

Module names follow TorchTitan, so tensor-parallel plans (`titan_tpu/models/common/parallelize.py`) and the
Hugging Face adapters (`titan_tpu/models/common/hf_adapter.py`) address every family alike: tok_embeddings,
layers["i"].{attention_norm, attention.{wq, wk, wv, wo[, q_norm, k_norm]}, ffn_norm, feed_forward},
norm, output.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.models.common.attention import Attention
from titan_tpu.models.common.decoder_args import DecoderArgs
from titan_tpu.models.common.documents import document_positions
from titan_tpu.models.common.init import trunc_normal_std_
from titan_tpu.models.common.kv_cache import KVCache, padded_causal_mask
from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.rope import RotaryEmbedding
from titan_tpu.models.common.transformer import TransformerBlock, depth_scaled_init_std


def decoder_block(
    args: DecoderArgs, layer_id: int, feed_forward: nn.Module, block_cls: type[TransformerBlock] = TransformerBlock
) -> TransformerBlock:
    """Block `layer_id`: the args' grouped-query attention (with QK-norm when the family has it) and
    the family's `feed_forward`, its residual outputs initialised smaller with depth."""
    attention = Attention(
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.attn_head_dim,
        qk_norm=args.qk_norm,
        norm_eps=args.norm_eps,
        kernel=args.attention,
    )
    return block_cls(
        attention=attention,
        feed_forward=feed_forward,
        dim=args.dim,
        norm_eps=args.norm_eps,
        out_init_std=depth_scaled_init_std(layer_id),
    )


class DecoderLM(nn.Module):
    """tokens [B, S] -> logits [B, S, vocab_size] in the parameters' dtype (the loss upcasts).

    Build under `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()`; the result
    is a fully valid model, the rotary tables included.
    """

    def __init__(self, args: DecoderArgs, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.args = args
        self.dim = args.dim
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.attn_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
        # A ModuleDict keyed by the original index, so wrapping a block (activation checkpointing,
        # fully_shard) or dropping some (pipeline stages) keeps the names checkpoints refer to.
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        # Tied: no separate head, the logits reuse tok_embeddings.weight (one parameter, one checkpoint key).
        self.output: nn.Linear | None = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )

    def keep_pipeline_stage(self, layers: tuple[int, ...], first: bool, last: bool) -> None:
        """Cut this model (built on meta) down to one pipeline stage: the blocks `layers`, with the
        embedding when `first` and the norm and head when `last`; every kept module keeps its name."""
        if self.output is None and not (first and last):
            raise ValueError("tied embeddings cannot be split between pipeline stages (the head is the embedding)")
        keep = {str(i) for i in layers}
        for name in list(self.layers.keys()):
            if name not in keep:
                del self.layers[name]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = None
            self.output = None

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise every parameter and recompute the rotary tables on `buffer_device`
        (default: where the tables already are, i.e. the device given to `to_empty`)."""
        self.rope.reset_buffers(buffer_device if buffer_device is not None else self.rope.cos.device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for layer in self.layers.values():
            block: TransformerBlock = layer  # type: ignore[assignment]  # maybe wrapped; wrappers forward it
            block.init_weights()
        if self.norm is not None:
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
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size] in the parameters' dtype (the loss upcasts).

        Training passes tokens only. Generation passes a `KVCache` and the slot of tokens[:, 0]
        (`start_pos`): prefill the prompts at 0, then feed one token per call. `key_padding_mask`
        [B, S] marks real tokens (True) of left-padded rows, with or without a cache; the convention
        is in kv_cache.py. `document_ids` [B, S] (training) keeps packed documents apart: positions
        restart at each document and attention stays inside it (documents.py).
        """
        if cache is None and start_pos != 0:
            raise ValueError(f"start_pos {start_pos} needs a KVCache holding the earlier positions")
        # A later pipeline stage (no embedding) is handed the previous stage's hidden states.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope(start_pos + tokens.shape[1])
        cos, sin = cos[start_pos:], sin[start_pos:]
        if cache is None and key_padding_mask is None:
            cos, sin, extra = self.document_rotary(cos, sin, document_ids)
            for layer in self.layers.values():
                h = layer(h, cos, sin, **extra)
            return self.logits(h)
        if document_ids is not None:
            raise ValueError("document_ids are for training, without a KVCache or key_padding_mask")
        attn_mask = self.generation_mask(tokens, cache, start_pos, key_padding_mask)
        for name, layer in self.layers.items():
            layer_cache = cache.layer(name) if cache is not None else None
            h = layer(h, cos, sin, kv_cache=layer_cache, start_pos=start_pos, attn_mask=attn_mask)
        return self.logits(h)

    @staticmethod
    def generation_mask(
        tokens: torch.Tensor, cache: KVCache | None, start_pos: int, key_padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The attention mask of a cached or padded call (kv_cache.py's convention); a cached call also
        records its tokens' slots in the cache."""
        if cache is None:
            if key_padding_mask is None:
                raise ValueError("generation_mask needs a KV cache or a key padding mask")
            return padded_causal_mask(key_padding_mask)
        return cache.advance(start_pos, tokens, key_padding_mask)

    @staticmethod
    def document_rotary(
        cos: torch.Tensor, sin: torch.Tensor, document_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The rotary tables at each token's position in its document ([B, S, head_dim]) and the
        blocks' keyword for packed documents; unchanged tables and no keyword without documents, so
        the plain training call stays (h, cos, sin)."""
        if document_ids is None:
            return cos, sin, {}
        positions = document_positions(document_ids)
        return cos[positions], sin[positions], {"document_ids": document_ids}

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return h  # a pipeline stage before the last: its hidden states go to the next stage
        h = self.norm(h)
        if self.output is None:
            assert self.tok_embeddings is not None, "tied embeddings are one pipeline stage's"
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)
