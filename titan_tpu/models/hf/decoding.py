"""Token-by-token decoding of an hf-family model with transformers' own KV cache, behind the forward
our sampler calls (`model(tokens, cache=..., start_pos=..., key_padding_mask=...)`).

Prompts arrive left-padded; the cache keeps the batch's attention mask (1 on real tokens) so that
padding is never attended to, and each row's positions count its real tokens only (a row's first
real token is at position 0, as transformers' `generate` places it). Rows the sampler drops as they
finish are dropped from the cache too.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_tpu.protocols.model_spec import Decoding

# Layer kinds transformers' dynamic cache holds as keys and values; others (state-space, linear
# attention) keep a state of their own that the sampler's row dropping does not handle.
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}


class HFDecodeCache:
    """transformers' DynamicCache and the batch's attention mask so far."""

    def __init__(self, max_len: int) -> None:
        from transformers import DynamicCache

        self.max_len = max_len
        self.kv = DynamicCache()
        self.mask: torch.Tensor | None = None  # [B, L]: 1 on the real tokens seen so far

    def extend(self, tokens: torch.Tensor, start_pos: int, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """The attention mask with `tokens`' columns added ([B, L + S]); the positions of `tokens`."""
        new = torch.ones(tokens.shape, dtype=torch.long, device=tokens.device)
        if start_pos == 0:
            self.mask = key_padding_mask.long() if key_padding_mask is not None else new
        else:
            assert self.mask is not None, "a decode step before the prefill"
            self.mask = torch.cat([self.mask, new], dim=1)
        positions = (self.mask.cumsum(dim=1) - 1).clamp(min=0)
        return positions[:, -tokens.shape[1] :]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.kv.batch_select_indices(rows)
        assert self.mask is not None
        self.mask = self.mask[rows]


def unsupported(args: Any) -> str | None:
    kinds = set(getattr(args.config, "layer_types", None) or ["full_attention"])
    if not kinds <= ATTENTION_LAYERS:
        return f"{args.architecture} has {', '.join(sorted(kinds - ATTENTION_LAYERS))} layers, which transformers' KV cache does not hold"
    return None


HF_DECODING = Decoding(new_cache=HFDecodeCache, fused_step=lambda model: None, unsupported=unsupported)
