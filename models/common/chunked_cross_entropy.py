"""Cross-entropy over a large vocabulary without a float32 copy of the whole logits tensor.

`F.cross_entropy(logits.float(), ...)` keeps float32 log-probabilities ([tokens, V]) from forward into
backward, and backward makes float32 gradients of the log-probabilities and of the upcast logits: for
Llama 3 (V = 128256) at 8192 tokens that is 4.2 GB kept and 8.4 GB transient per sequence, more than
the rest of the model's activations. Here forward keeps only the logits (which exist anyway) and one
float32 log-sum-exp per token; backward recomputes the softmax from them. Each pass walks the tokens
in chunks and upcasts one chunk at a time, so float32 memory is bounded by one chunk.
"""

from __future__ import annotations

from typing import Any

import torch

# Float32 elements in one chunk: 2^26 (256 MiB) is 523 tokens of a 128k vocabulary, 1/8 of the
# bf16 logits of an 8192-token sequence, yet large enough that each chunk's kernels run at full
# bandwidth and a sequence takes tens of chunks, not thousands, so per-op launch costs stay small.
CHUNK_ELEMENTS = 2**26


def chunk_tokens(vocab_size: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one float32 chunk holds at most `chunk_elements` (at least one token)."""
    return max(1, chunk_elements // vocab_size)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over tokens of -log softmax(logits)[label], divided by the number of counted labels.

    logits [N, V] in any float dtype, labels [N] (int64); labels equal to `ignore_index` contribute
    nothing. The arithmetic runs in float32, or float64 for float64 logits. With every label ignored
    the loss is 0/0 = nan and the gradient zero, as with `F.cross_entropy(reduction="mean")`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, tokens_per_chunk: int
    ) -> torch.Tensor:
        counted, targets = _counted_targets(labels, ignore_index)
        lse = torch.empty(logits.shape[0], dtype=_accumulation_dtype(logits), device=logits.device)
        for start in range(0, logits.shape[0], tokens_per_chunk):
            lse[start : start + tokens_per_chunk] = _log_sum_exp(logits[start : start + tokens_per_chunk])
        target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1).to(lse.dtype)
        count = counted.sum()
        loss = torch.where(counted, lse - target_logits, 0.0).sum() / count
        # The labels exist anyway; the mask and targets are recomputed rather than kept (9 bytes a token).
        ctx.save_for_backward(logits, labels, lse, count)
        ctx.ignore_index, ctx.tokens_per_chunk = ignore_index, tokens_per_chunk
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        logits, labels, lse, count = ctx.saved_tensors
        counted, targets = _counted_targets(labels, ctx.ignore_index)
        # d loss / d logits = (softmax - one_hot(label)) * grad / count on counted rows, 0 elsewhere.
        # clamp: with no counted label every row is zero already; 1/0 would turn 0 into nan.
        row_scale = counted.to(lse.dtype) * (grad_loss.to(lse.dtype) / count.clamp(min=1))
        grad_logits = torch.empty_like(logits)
        rows = torch.arange(logits.shape[0], device=logits.device)
        step = ctx.tokens_per_chunk
        for start in range(0, logits.shape[0], step):
            end = start + step
            # The subtraction promotes to float32 (lse's dtype) and allocates the chunk's one float32
            # buffer; the rest works in place on it (never on `logits`, which float32 input would alias).
            probs = logits[start:end] - lse[start:end].unsqueeze(1)
            probs.exp_()
            probs[rows[: probs.shape[0]], targets[start:end]] -= 1.0
            probs.mul_(row_scale[start:end].unsqueeze(1))
            grad_logits[start:end] = probs  # cast to the logits' dtype
            del probs  # else it lives on while the next chunk's buffer is made: two chunks at once
        return grad_logits, None, None, None


def _counted_targets(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels count, and labels safe to index with: ignored positions read column 0, whose
    term is then masked out."""
    counted = labels != ignore_index
    return counted, labels.masked_fill(~counted, 0)


def _accumulation_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _log_sum_exp(chunk: torch.Tensor) -> torch.Tensor:
    """Float32 log-sum-exp of each row, with one float32 buffer of the chunk's size
    (`torch.logsumexp` on an upcast chunk would hold two)."""
    row_max = chunk.amax(dim=1).to(_accumulation_dtype(chunk))  # the max is exact in any dtype
    # A row of -inf would give -inf - -inf = nan; shifting it by 0 instead gives log(0) = -inf.
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    shifted = chunk - row_max.unsqueeze(1)
    return shifted.exp_().sum(dim=1).log_() + row_max


def chunked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, tokens_per_chunk: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of logits [N, V] against labels [N]; `tokens_per_chunk` defaults to
    `chunk_tokens(V)`."""
    step = chunk_tokens(logits.shape[-1]) if tokens_per_chunk is None else tokens_per_chunk
    return ChunkedCrossEntropy.apply(logits, labels, ignore_index, step)
