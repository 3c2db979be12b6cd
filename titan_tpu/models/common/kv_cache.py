"""Key/value cache for generation: prefill a batch of prompts once, then decode a token at a time.

Convention (what a caller of `DecoderLM.forward(tokens, cache=..., start_pos=..., key_padding_mask=...)`
relies on):
- `start_pos` is the cache slot of `tokens[:, 0]`; the same for every row. The first call (prefill)
  uses 0, each later call the number of positions already fed (prompt length, then +1 per token).
- Prompts of different lengths are left-padded to one length, and `key_padding_mask` [B, S] marks the
  real tokens of this call (True) and the padding (False). The cache records it for its slots, so later
  tokens never attend to padding; a call without a mask marks its tokens real (decode steps).
- Positions are slots: a row padded by p tokens has its real tokens at rotary positions p, p+1, ...
  Rotary attention depends only on the distance between query and key, so this gives the same logits
  as the unpadded prompt at positions 0, 1, ... (to float rounding).
- A padding query attends only to itself (its output is finite and meaningless; ignore its logits).

Buffers are [B, H_kv, max_len, D] per attention layer, allocated on a layer's first write with the
shape, dtype and device of its keys, so under tensor parallelism a rank holds only its own heads and
under mixed precision the compute dtype. A decode step that multiplies its queries by the keys as
matrices [D, L] (decode_step.py) has a layer keep its keys transposed, [B, H_kv, D, max_len], from
then on (`transpose_keys`); `update` serves either layout. Build a fresh cache per batch of prompts.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One attention layer's key and value buffers."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k: torch.Tensor | None = None  # [B, H_kv, max_len, D], or [B, H_kv, D, max_len] once transposed
        self.v: torch.Tensor | None = None
        self.keys_transposed = False

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, S, D] at slots start_pos:start_pos+S; return every key and value up to
        there, [B, H_kv, start_pos + S, D] (the keys a view of the transposed buffer, when it is)."""
        if self.keys_transposed:
            keys_t, values = self.update_transposed(k, v, start_pos)
            return keys_t.transpose(2, 3), values
        return self._write(k, v, start_pos)

    def update_transposed(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` for a layer whose keys are transposed: the keys come back as [B, H_kv, D,
        start_pos + S], the values as `update` gives them."""
        if not self.keys_transposed:
            raise ValueError("update_transposed needs the keys transposed first (transpose_keys)")
        return self._write(k.transpose(2, 3), v, start_pos)

    def transpose_keys(self) -> None:
        """Keep the keys as [B, H_kv, D, max_len] from now on (one copy of the buffer): in that layout
        a decode step's scores q [G, D] x keys [D, L] read the cache as the second operand of a plain
        matrix product, which the CPU's batched product streams at about memory speed (0.31 against
        0.46-0.51 ms per layer for the [L, D] layout transposed, batch 128, 176 slots, 2-core Xeon).
        Idempotent; a layer not yet written allocates in this layout."""
        if not self.keys_transposed and self.k is not None:
            self.k = self.k.transpose(2, 3).contiguous()
        self.keys_transposed = True

    def _write(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k in the buffer's own layout; slots along the keys' dimension 2, or 3 when transposed."""
        slot_dim = 3 if self.keys_transposed else 2
        stop = start_pos + k.shape[slot_dim]
        if self.k is None or self.v is None:
            shape = (*k.shape[:slot_dim], self.max_len, *k.shape[slot_dim + 1 :])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(v.shape[0], v.shape[1], self.max_len, v.shape[3], dtype=v.dtype, device=v.device)
        self.k.narrow(slot_dim, start_pos, stop - start_pos).copy_(k)
        self.v[:, :, start_pos:stop] = v
        return self.k.narrow(slot_dim, 0, stop), self.v[:, :, :stop]

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)


class KVCache:
    """The k/v buffers of every attention layer for one batch of sequences, and which slots hold real
    tokens. `max_len` bounds prompt plus generated tokens and must not exceed the model's max_seq_len."""

    def __init__(self, max_len: int) -> None:
        if max_len <= 0:
            raise ValueError(f"KVCache max_len must be positive, got {max_len}")
        self.max_len = max_len
        self.layers: dict[str, LayerKVCache] = {}
        # [B, max_len], True where a slot holds a real token; allocated by the first `advance`.
        self.key_padding_mask: torch.Tensor | None = None
        self.length = 0  # slots filled so far

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the sequences at indices `rows` (a 1-D long tensor), in that order: the decode
        batch shrinks as completions finish, so finished rows cost nothing more."""
        for layer in self.layers.values():
            layer.keep_rows(rows)
        if self.key_padding_mask is not None:
            self.key_padding_mask = self.key_padding_mask.index_select(0, rows)

    def layer(self, name: str) -> LayerKVCache:
        """The buffers of the attention layer in block `name` (the decoder's ModuleDict key)."""
        if name not in self.layers:
            self.layers[name] = LayerKVCache(self.max_len)
        return self.layers[name]

    def advance(self, start_pos: int, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Record that `tokens` [B, S] fill slots start_pos:start_pos+S (real where `key_padding_mask`
        [B, S] is True, all real when None) and return the attention mask [B, 1, S, start_pos + S]
        (True = may attend) for this call."""
        batch, seq_len = tokens.shape
        stop = start_pos + seq_len
        if start_pos < 0 or stop > self.max_len:
            raise ValueError(f"KVCache: slots {start_pos}:{stop} do not fit its max_len {self.max_len}")
        if start_pos > self.length:
            raise ValueError(
                f"KVCache: start_pos {start_pos} skips slots; {self.length} are filled, so the next "
                f"call must start at or before {self.length}"
            )
        if self.key_padding_mask is None:
            self.key_padding_mask = torch.ones(batch, self.max_len, dtype=torch.bool, device=tokens.device)
        elif self.key_padding_mask.shape[0] != batch:
            raise ValueError(f"KVCache holds {self.key_padding_mask.shape[0]} sequences, got a batch of {batch}")
        if key_padding_mask is None:
            self.key_padding_mask[:, start_pos:stop] = True
        else:
            if key_padding_mask.shape != tokens.shape:
                raise ValueError(
                    f"key_padding_mask must match tokens {tuple(tokens.shape)}, got {tuple(key_padding_mask.shape)}"
                )
            self.key_padding_mask[:, start_pos:stop] = key_padding_mask
        self.length = stop
        return padded_causal_mask(self.key_padding_mask[:, :stop], start_pos)


def padded_causal_mask(key_padding_mask: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """Attention mask [B, 1, S, L] for queries at slots start_pos:L over keys 0:L, L = the mask's width:
    a query sees the real keys up to its own slot, and always itself, so no row is empty."""
    batch, total = key_padding_mask.shape
    query_slots = torch.arange(start_pos, total, device=key_padding_mask.device)[:, None]
    key_slots = torch.arange(total, device=key_padding_mask.device)[None, :]
    causal = key_slots <= query_slots  # [S, L]
    visible = causal[None] & key_padding_mask[:, None, :]
    return (visible | (key_slots == query_slots)[None])[:, None]
