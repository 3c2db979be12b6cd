"""Causal attention kernels, interchangeable behind one call: kernel(q, k, v) -> out.

q is [B, H, S, D]; k and v are [B, H_kv, S, D] with H a multiple of H_kv (grouped-query attention is
the kernel's business, so a kernel that handles groups natively need not receive repeated copies).
The output is [B, H, S, D] in q's dtype, scaled by 1/sqrt(D), with a causal mask.

Kernels are small frozen values (hashable, printable), so they can sit in a frozen model-args
dataclass. A kernel is chosen by name ("sdpa", "blocked:128", "splash") through `attention_kernel`;
the TPU kernel is an op the caller hands in (model code imports no device library), so a test can hand
in a stand-in with the same signature. Which one a run uses ("auto") is measured at start-up, among
the candidates `attention_tunable.py` lists for the device (titan_tpu/autotune/).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from titan_tpu.models.common.blocked_attention import blocked_causal_attention
from titan_tpu.models.common.documents import document_causal_mask
from titan_tpu.protocols.attention import AttentionKernel


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D], each kv head repeated for its group of query heads.

    Done by hand rather than with SDPA's `enable_gqa` so the path relies on no backend-specific support
    for that flag (PyTorch's own CPU and CUDA kernels have it; an out-of-tree backend need not). The
    price is one k/v copy the size of q.
    """
    if n_rep == 1:
        return x
    bs, n_kv_heads, seqlen, head_dim = x.shape
    return (
        x[:, :, None].expand(bs, n_kv_heads, n_rep, seqlen, head_dim).reshape(bs, n_kv_heads * n_rep, seqlen, head_dim)
    )


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with each kv head repeated for its group of query heads."""
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), **options)


@dataclass(frozen=True)
class SdpaAttention:
    """`F.scaled_dot_product_attention` with is_causal: the fused kernels of CUDA and recent CPUs."""

    name: str = field(default="sdpa", init=False)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if document_ids is None:
            return _grouped_sdpa(q, k, v, is_causal=True)
        # An explicit [B, 1, S, S] mask: SDPA has no segment ids (its fused CPU and CUDA kernels take
        # a mask); the blocked kernel keeps this O(S) per row.
        return _grouped_sdpa(q, k, v, attn_mask=document_causal_mask(document_ids))


@dataclass(frozen=True)
class BlockedAttention:
    """Plain-matmul causal attention in `block`-token query blocks that skips the masked half and keeps
    O(S * block) memory for backward (see `blocked_attention.py`)."""

    block: int
    name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.block <= 0:
            raise ValueError(f"blocked attention needs a positive block size, got {self.block}")
        object.__setattr__(self, "name", f"blocked:{self.block}")

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return blocked_causal_attention(q, k, v, self.block, document_ids)


# The splash kernel tiles queries and keys in blocks of 512 by default and needs every block to be a
# multiple of 128 (the TPU's lane count); shorter or odd lengths get the largest block that divides them.
SPLASH_BLOCKS = (512, 256, 128)


def splash_block(seq_len: int) -> int | None:
    """The splash tile size for `seq_len`, or None when no multiple of 128 divides it."""
    return next((block for block in SPLASH_BLOCKS if seq_len % block == 0), None)


@dataclass(frozen=True)
class SplashAttention:
    """The TPU's Pallas splash kernel, `torch.tpu.ops.splash_sdpa`, handed in as `op`.

    The op takes q/k/v as [B, H, S, D] (HEAD_DIM_MINOR), keyword-only options, needs `enable_gqa`
    exactly when H != H_kv (it expands the groups itself), and returns q's dtype.
    """

    op: Callable[..., torch.Tensor] = field(compare=False)
    name: str = field(default="splash", init=False)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if document_ids is not None:
            # torch_tpu 0.2's splash_sdpa takes no segment ids; the measured choice leaves splash out
            # of document-masked runs, so only a forced choice gets here.
            raise ValueError(
                "splash attention (torch_tpu 0.2) takes no segment ids; with data.document_mask use 'sdpa'"
            )
        seq_len = q.shape[2]
        block = splash_block(seq_len)
        if block is None:
            raise ValueError(
                f"splash attention needs a sequence length that is a multiple of 128, got {seq_len}; "
                "use the 'sdpa' kernel for this length"
            )
        return self.op(
            q,
            k,
            v,
            scale=1.0 / math.sqrt(q.shape[-1]),
            is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1],
            block_q=block,
            block_kv=block,
            block_kv_compute=block,
            block_dkv=block,
            block_kv_dkv_compute=block,
        )


@dataclass(frozen=True)
class AutoAttention:
    """The kernel a run has not chosen yet: `model.attention_block = -1` puts it into the model
    arguments, and the trainer replaces it with the measured pick (titan_tpu/models/common/attention_tunable.py)
    before the model is built. Called, it fails: a model must never run with it."""

    name: str = field(default="auto", init=False)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise RuntimeError("attention kernel 'auto' was never replaced by a measured kernel")


KERNEL_NAMES = ("auto", "sdpa", "blocked:<block>", "splash")


def attention_kernel(name: str, splash_op: Callable[..., Any] | None = None) -> AttentionKernel:
    """The kernel called `name`: "sdpa", "blocked:N" (N-token query blocks) or "splash" (needs the
    TPU op `torch.tpu.ops.splash_sdpa`, passed as `splash_op` by the device layer), or "auto" (the
    placeholder the measured choice replaces)."""
    if name == "auto":
        return AutoAttention()
    if name == "sdpa":
        return SdpaAttention()
    if name == "splash":
        if splash_op is None:
            raise ValueError("attention kernel 'splash' needs the TPU op torch.tpu.ops.splash_sdpa")
        return SplashAttention(splash_op)
    kind, _, block = name.partition(":")
    if kind == "blocked" and block.isdigit() and int(block) > 0:
        return BlockedAttention(int(block))
    raise ValueError(f"unknown attention kernel '{name}'; known: {', '.join(KERNEL_NAMES)}")


def requested_attention(attention_block: int) -> AttentionKernel:
    """The kernel `model.attention_block` names: -1 "auto" (measured at start-up), 0 SDPA, N > 0
    blocked with N-token query blocks."""
    if attention_block < -1:
        raise ValueError(f"model.attention_block: -1 (auto), 0 (SDPA) or a query-block size, got {attention_block}")
    return attention_kernel({-1: "auto", 0: "sdpa"}.get(attention_block, f"blocked:{attention_block}"))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, H, S, D] over k, v [B, H_kv, L, D] under a boolean mask broadcastable to
    [B, H, S, L] (True = may attend; or its additive form, 0 and -inf): padded batches and cached
    decoding, where the causal kernels' square, unpadded mask does not fit. The kv heads are shared
    with their query heads by SDPA's own `enable_gqa`, not repeated: in cached decoding a repeat
    copies the whole cache in every layer at every token (measured on a 2-core CPU, batch 128, 300
    cached slots: 33 ms per call against 3 ms).

    A decode step (S = 1, one mask row for every head) goes further: the G query heads of each kv
    head become one query sequence of length G over that head's keys, so SDPA reads each kv head's
    cache once rather than once per query head (the same sums; batch 128, 176 slots, 2-core Xeon:
    0.84 against 1.11 ms per call)."""
    batch, heads, queries, head_dim = q.shape
    kv_heads = k.shape[1]
    if queries == 1 and heads != kv_heads and mask.shape[1] == 1:
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
        return out.reshape(batch, heads, 1, head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)


def decode_attention(
    q: torch.Tensor, keys_t: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor
) -> torch.Tensor:
    """Attention of one query per row, q [B, H, D], over the cache's keys stored transposed, keys_t
    [B, H_kv, D, L] (kv_cache.py's `transpose_keys`), and values v [B, H_kv, L, D] under an additive
    mask [B, 1, 1, L] (0 = may attend, -inf = not): out [B, H, D], scaled by 1/sqrt(D), query head h
    reading kv head h // (H / H_kv), as `masked_attention` computes it.

    A decode step's attention is B * H_kv products of [G, D] x [D, L] and [G, L] x [L, D] (G = H / H_kv
    query heads per kv head). SDPA's CPU kernel runs them one tile at a time with its online softmax;
    two batched matmuls over the whole batch, each reading its cache operand as the second factor of
    a plain product (hence the keys' layout), with the scale, mask and softmax in two calls between
    them, are faster (fp32, 2-core Xeon, batch 128, 176 slots: 0.31 + 0.28 ms for the two products
    where SDPA took 1.04 ms) and trace into a compiled step (decode_step.py). The same math (scores *
    scale + mask, softmax, times values) summed in another order: fp32 results agree with SDPA's to
    about 1e-6, not bit for bit."""
    batch, heads, head_dim = q.shape
    kv_heads, slots = keys_t.shape[1], keys_t.shape[3]
    group = heads // kv_heads
    # The views below are free: a cache slice [B, H_kv, D, :L] merges B and H_kv without a copy.
    keys = keys_t.reshape(batch * kv_heads, head_dim, slots)
    scores = torch.bmm(q.reshape(batch * kv_heads, group, head_dim), keys).view(batch, kv_heads, group, slots)
    scores = torch.add(additive_mask, scores, alpha=1.0 / math.sqrt(head_dim))
    weights = torch.softmax(scores, dim=-1).view(batch * kv_heads, group, slots)
    return torch.bmm(weights, v.reshape(batch * kv_heads, slots, head_dim)).view(batch, heads, head_dim)
