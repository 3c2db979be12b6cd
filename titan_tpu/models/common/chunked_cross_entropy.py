"""Cross-entropy over a large vocabulary without a float32 copy of the whole logits tensor.

`F.cross_entropy(logits.float(), ...)` keeps float32 log-probabilities ([tokens, V]) from forward into
backward, and backward makes float32 gradients of the log-probabilities and of the upcast logits: for
Llama 3 (V = 128256) at 8192 tokens that is 4.2 GB kept and 8.4 GB transient per sequence, more than
the rest of the model's activations. Here one pass walks the tokens in chunks, upcasting one chunk
at a time, and computes the loss and (in training) its gradient in the logits' dtype: float32 memory
is bounded by one chunk, and what is kept for backward is that gradient, the logits' size.
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

    Where a gradient will be wanted, forward computes it too: d loss / d logits needs the softmax that
    the log-sum-exp has just exponentiated, so one pass over the chunks does both, and backward only
    scales it by the incoming gradient (the loss is a scalar, so that is exact). Forward then keeps
    the gradient (the logits' size and dtype) instead of the logits, which the model may then free;
    the exp over every logit, the loss's dominant cost, runs once per step instead of twice.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        tokens_per_chunk: int,
        with_grad: bool,
    ) -> torch.Tensor:
        counted, targets = _counted_targets(labels, ignore_index)
        count = counted.sum()
        accumulation = _accumulation_dtype(logits)
        lse = torch.empty(logits.shape[0], dtype=accumulation, device=logits.device)
        # d loss / d logits = (softmax - one_hot(label)) / count on counted rows, 0 elsewhere.
        # clamp: with no counted label every row is zero already; 1/0 would turn 0 into nan.
        row_scale = counted.to(accumulation) / count.clamp(min=1)
        grad_logits = torch.empty_like(logits) if with_grad else None
        rows = torch.arange(min(tokens_per_chunk, logits.shape[0]), device=logits.device)
        for start in range(0, logits.shape[0], tokens_per_chunk):
            end = start + tokens_per_chunk
            chunk = logits[start:end]
            # The chunk's one float32 buffer: shifted by the row max, exponentiated in place.
            row_max = chunk.amax(dim=1).to(accumulation)  # the max is exact in any dtype
            # A row of -inf would give -inf - -inf = nan; shifting it by 0 instead gives log(0) = -inf.
            row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
            exps = (chunk - row_max.unsqueeze(1)).exp_()
            sums = exps.sum(dim=1)
            lse[start:end] = sums.log() + row_max
            if grad_logits is not None:
                scale = row_scale[start:end]
                exps.mul_((scale / sums).unsqueeze(1))  # the softmax, scaled
                exps[rows[: exps.shape[0]], targets[start:end]] -= scale
                grad_logits[start:end] = exps  # cast to the logits' dtype
            del exps  # else it lives on while the next chunk's buffer is made: two chunks at once
        target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1).to(accumulation)
        # Held on ctx, not saved: backward scales it in place and lets it go (it is neither an input
        # nor an output, which is what save_for_backward guards).
        ctx.grad_logits = grad_logits
        return torch.where(counted, lse - target_logits, 0.0).sum() / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_logits, ctx.grad_logits = ctx.grad_logits, None
        if grad_logits is None:
            raise RuntimeError(
                "the chunked cross-entropy's gradient was not computed (forward ran without grad) or was "
                "already used (a second backward through it, e.g. retain_graph=True, is not supported)"
            )
        # A 0-dim float32 factor: the product is taken in float32 and rounded once to the logits' dtype.
        return grad_logits.mul_(grad_loss), None, None, None, None


def _counted_targets(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels count, and labels safe to index with: ignored positions read column 0, whose
    term is then masked out."""
    counted = labels != ignore_index
    return counted, labels.masked_fill(~counted, 0)


def _accumulation_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def chunked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, tokens_per_chunk: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of logits [N, V] against labels [N]; `tokens_per_chunk` defaults to
    `chunk_tokens(V)`."""
    step = chunk_tokens(logits.shape[-1]) if tokens_per_chunk is None else tokens_per_chunk
    with_grad = torch.is_grad_enabled() and logits.requires_grad
    return ChunkedCrossEntropy.apply(logits, labels, ignore_index, step, with_grad)
