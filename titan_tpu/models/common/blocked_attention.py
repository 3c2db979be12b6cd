"""Causal attention in query blocks with plain matmuls, and a backward that recomputes per block.

Each query block attends only to the keys up to its own end, so the blocks above the diagonal, half of
the work for long sequences, are never computed; only the diagonal block needs a mask. On CPUs this runs
at matmul speed where SDPA's bf16 kernel does not.

Letting autograd record the blocks would keep every block's probabilities for backward, O(S^2) per
layer: at S=2048 that made a small model need 3x SDPA's memory. Instead the forward keeps only its
inputs and its output (O(S)), and the backward recomputes one block's probabilities at a time, so at most O(S * block) scores live at once, forward or backward.

Grouped-query attention needs no repeated k/v: the query heads of a group are stacked as extra rows
against their one k/v head, so one matmul serves the whole group and dk/dv sum over it by construction.

Packed documents (`document_ids`, titan_tpu/models/common/documents.py) add a mask between documents, built per
block (O(S * block) like the scores), and a block skips the keys before the earliest document any of
its rows is in: with short documents most of the lower triangle is never computed either.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from titan_tpu.models.common.documents import document_positions, document_segments
from titan_tpu.models.common.precision import autocast_dtype


def _scaled_block_rows(x: torch.Tensor, start: int, stop: int, scale: float) -> torch.Tensor:
    """[B, H_kv, R, S, D] -> rows start:stop of every head in each group, times `scale`, as
    [B, H_kv, R * n, D]. Scaling the n x D queries is cheaper than scaling the n x S scores."""
    bs, n_kv_heads, n_rep, _, head_dim = x.shape
    return (x[:, :, :, start:stop] * scale).reshape(bs, n_kv_heads, n_rep * (stop - start), head_dim)


def _block_probs(
    q_rows: torch.Tensor, k: torch.Tensor, start: int, stop: int, n_rep: int, keys: tuple[int, torch.Tensor | None]
) -> torch.Tensor:
    """Float32 probabilities [B, H_kv, R * n, stop - lo] of one block of (scaled) queries over keys
    lo:stop, with the diagonal block's future keys masked; `keys` = (lo, the block's [B, n, stop - lo]
    mask of keys in other documents, or None)."""
    lo, other_documents = keys
    scores = (q_rows @ k[:, :, lo:stop].transpose(-1, -2)).float()
    rows = stop - start
    future = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu(diagonal=1)
    grouped = scores.view(scores.shape[0], scores.shape[1], n_rep, rows, stop - lo)
    grouped[..., start - lo :].masked_fill_(future, float("-inf"))
    if other_documents is not None:
        grouped.masked_fill_(other_documents[:, None, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


def _block_keys(
    segments: torch.Tensor | None, starts: list[int], block: int, seqlen: int
) -> list[tuple[int, torch.Tensor | None]]:
    """Per query block, the first key any of its rows may see and the mask of keys in other documents.

    Without documents every block starts at key 0. With them, a block starts at the first token of the
    document its first row is in (the earliest over the batch); `starts` holds those, read once on the
    host. Under torch.compile the skip is left out (a host read would break the graph); the mask alone
    keeps the result exact."""
    keys: list[tuple[int, torch.Tensor | None]] = []
    for i, start in enumerate(range(0, seqlen, block)):
        stop = min(start + block, seqlen)
        if segments is None:
            keys.append((0, None))
            continue
        lo = starts[i] if starts else 0
        keys.append((lo, segments[:, start:stop, None] != segments[:, None, lo:stop]))
    return keys


class _BlockedCausalAttention(torch.autograd.Function):
    """Saves q, k, v and the output; the backward recomputes each block's probabilities (one fused
    softmax, cheaper on CPUs than keeping a log-sum-exp, which costs extra passes over the scores)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block: int,
        segments: torch.Tensor | None,
        starts: list[int],
    ) -> torch.Tensor:
        bs, n_heads, seqlen, head_dim = q.shape
        n_kv_heads = k.shape[1]
        n_rep = n_heads // n_kv_heads
        scale = 1.0 / math.sqrt(head_dim)
        q5 = q.view(bs, n_kv_heads, n_rep, seqlen, head_dim)
        out = torch.empty_like(q5)
        for start, keys in zip(range(0, seqlen, block), _block_keys(segments, starts, block, seqlen)):
            stop = min(start + block, seqlen)
            probs = _block_probs(_scaled_block_rows(q5, start, stop, scale), k, start, stop, n_rep, keys)
            out[:, :, :, start:stop] = (probs.to(v.dtype) @ v[:, :, keys[0] : stop]).view(
                bs, n_kv_heads, n_rep, stop - start, head_dim
            )
        out = out.view(bs, n_heads, seqlen, head_dim)
        ctx.save_for_backward(q, k, v, out, segments)
        ctx.block, ctx.starts = block, starts
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, segments = ctx.saved_tensors
        block: int = ctx.block
        # q, k, v and out share one dtype (the wrapper's cast); the incoming gradient may not (a float32
        # loss path over a bf16 output), and every matmul below pairs it with one of them.
        grad_out = grad_out.to(out.dtype)
        bs, n_heads, seqlen, head_dim = q.shape
        n_kv_heads = k.shape[1]
        n_rep = n_heads // n_kv_heads
        scale = 1.0 / math.sqrt(head_dim)
        grouped = (bs, n_kv_heads, n_rep, seqlen, head_dim)
        q5, grad_out5 = q.view(grouped), grad_out.contiguous().view(grouped)
        # softmax backward: dS = P * (dP - rowsum(dO * O)); the row sums are the same for every block.
        delta = (grad_out.float() * out.float()).sum(-1).view(bs, n_kv_heads, n_rep, seqlen)
        grad_q5 = torch.empty_like(q5)
        grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for start, keys in zip(range(0, seqlen, block), _block_keys(segments, ctx.starts, block, seqlen)):
            stop = min(start + block, seqlen)
            lo = keys[0]
            rows = n_rep * (stop - start)
            q_rows = _scaled_block_rows(q5, start, stop, scale)
            grad_out_rows = _scaled_block_rows(grad_out5, start, stop, 1.0)
            probs = _block_probs(q_rows, k, start, stop, n_rep, keys)
            grad_v[:, :, lo:stop] += (probs.to(v.dtype).transpose(-1, -2) @ grad_out_rows).float()
            grad_scores = (grad_out_rows @ v[:, :, lo:stop].transpose(-1, -2)).float()
            grad_scores.sub_(delta[:, :, :, start:stop].reshape(bs, n_kv_heads, rows, 1)).mul_(probs)
            grad_scores = grad_scores.to(q.dtype)
            grad_q5[:, :, :, start:stop] = (grad_scores @ k[:, :, lo:stop] * scale).view(
                bs, n_kv_heads, n_rep, stop - start, head_dim
            )
            # Scores were formed from scaled queries, so dK takes them as they are.
            grad_k[:, :, lo:stop] += (grad_scores.transpose(-1, -2) @ q_rows).float()
        return grad_q5.view(q.shape), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def attention_compute_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype the kernel multiplies in, decided as SDPA decides it: under autocast, autocast's
    dtype (SDPA is on its lower-precision list), whatever q, k and v hold; there they do differ, since
    a norm whose float32 weight scales bf16 activations (Qwen 3's QK-norm) hands over float32 q and k
    beside a bf16 v. Outside autocast, q, k and v must share a dtype."""
    dtype = autocast_dtype(q)
    if dtype is not None:
        return dtype
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"attention outside autocast needs q, k and v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    return q.dtype


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of q [B, H, S, D] over k, v [B, H_kv, S, D] in `block`-token query blocks;
    with `document_ids` [B, S], within each packed document only.

    q, k and v are cast to one compute dtype (`attention_compute_dtype`); scores, softmax and the
    backward's sums are float32; the output has the compute dtype. The kernel runs with autocast off,
    so its forward multiplies in the same dtype as its backward (which autograd runs outside autocast).
    """
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    dtype = attention_compute_dtype(q, k, v)
    segments = None if document_ids is None else document_segments(document_ids)
    starts: list[int] = []
    if document_ids is not None and not torch.compiler.is_compiling():
        first = torch.arange(q.shape[2], device=q.device) - document_positions(document_ids)
        starts = first[:, ::block].amin(dim=0).tolist()
    with torch.autocast(q.device.type, enabled=False):
        return _BlockedCausalAttention.apply(
            q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(), block, segments, starts
        )
