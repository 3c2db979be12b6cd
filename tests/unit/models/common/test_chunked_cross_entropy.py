"""The chunked cross-entropy against F.cross_entropy, and the memory it keeps and peaks at.

Memory is a live-tensor tally (`plan_measure.LiveTensorPeak`) of everything the loss's forward and
backward create, with the logits (made by the model anyway) not counted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.plan_measure import LiveTensorPeak  # noqa: E402
from titan_tpu.models.common.chunked_cross_entropy import ChunkedCrossEntropy, chunk_tokens, chunked_cross_entropy  # noqa: E402
from titan_tpu.models.common.loss import IGNORE_INDEX, cross_entropy_loss  # noqa: E402

TOKENS, VOCAB = 100, 64


def _inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(TOKENS, VOCAB, generator=generator)).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[::7] = IGNORE_INDEX  # ignored rows in the first, middle and last chunks
    return logits, labels


# The loss is scaled before backward, as gradient accumulation scales it, so the gradient reaching
# the loss is not 1 and a backward that ignored it would be caught.
LOSS_SCALE = 0.375


def _loss_and_grad(loss_fn: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().requires_grad_()
    loss = loss_fn(leaf, labels)
    (grad,) = torch.autograd.grad(LOSS_SCALE * loss, leaf)
    return loss.detach(), grad


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _loss_and_grad(lambda x, y: F.cross_entropy(x, y, ignore_index=IGNORE_INDEX), logits, labels)


def _chunked(tokens_per_chunk: int, function: type[torch.autograd.Function] = ChunkedCrossEntropy) -> Any:
    return lambda x, y: function.apply(x, y, IGNORE_INDEX, tokens_per_chunk, True)


def _matches(loss_fn: Any, logits: torch.Tensor, labels: torch.Tensor, rtol: float, atol: float) -> bool:
    """Loss and gradient of `loss_fn` against F.cross_entropy on float64 and on float32 logits."""
    loss, grad = _loss_and_grad(loss_fn, logits, labels)
    for reference_dtype in (torch.float64, torch.float32):
        ref_loss, ref_grad = _reference(logits.to(reference_dtype), labels)
        if not torch.allclose(loss.double(), ref_loss.double(), rtol=rtol, atol=atol):
            return False
        if not torch.allclose(grad.double(), ref_grad.double(), rtol=rtol, atol=atol):
            return False
    return True


# 1: every token its own chunk; 7 and 64 do not divide 100; 100 and 1000: one chunk.
@pytest.mark.parametrize("tokens_per_chunk", [1, 7, 64, 100, 1000])
def test_float32_matches_f_cross_entropy(tokens_per_chunk: int) -> None:
    logits, labels = _inputs(torch.float32)
    assert _matches(_chunked(tokens_per_chunk), logits, labels, rtol=1e-5, atol=1e-7)


def test_float64_logits_are_computed_in_float64() -> None:
    logits, labels = _inputs(torch.float64)
    loss, grad = _loss_and_grad(_chunked(7), logits, labels)
    ref_loss, ref_grad = _reference(logits, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)


def test_bf16_logits_match_the_float32_loss_of_the_same_values() -> None:
    # The float32 reference sees the very values the bf16 tensor holds, so the loss agrees to float32
    # rounding; the gradient is rounded to bf16 twice (made in forward, then scaled by the incoming
    # gradient), so it agrees with the reference cast to bf16 within two bf16 roundings.
    logits, labels = _inputs(torch.bfloat16)
    loss, grad = _loss_and_grad(_chunked(7), logits, labels)
    ref_loss, ref_grad = _reference(logits.float(), labels)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad.to(torch.bfloat16), rtol=2**-7, atol=1e-7)


class _KeepsTheLabels(ChunkedCrossEntropy):
    """The real kernel, with its labels kept so that a broken backward below can use them."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, *args: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.labels = labels
        return ChunkedCrossEntropy.forward(ctx, logits, labels, *args)


class _ForgetsTheCount(_KeepsTheLabels):
    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad, *rest = ChunkedCrossEntropy.backward(ctx, grad_loss)
        return (grad * (ctx.labels != IGNORE_INDEX).sum(), *rest)  # the count it should divide by


class _DropsTheOneHot(_KeepsTheLabels):
    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad, *rest = ChunkedCrossEntropy.backward(ctx, grad_loss)
        counted = ctx.labels != IGNORE_INDEX
        one_hot = F.one_hot(ctx.labels.clamp(min=0), grad.shape[1]) * counted.unsqueeze(1)
        return (grad + grad_loss * one_hot / counted.sum(), *rest)


class _IgnoresTheIncomingGradient(ChunkedCrossEntropy):
    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return ChunkedCrossEntropy.backward(ctx, torch.ones_like(grad_loss))


@pytest.mark.parametrize("wrong", [_ForgetsTheCount, _DropsTheOneHot, _IgnoresTheIncomingGradient])
def test_a_wrong_gradient_fails_the_same_comparison(wrong: type[torch.autograd.Function]) -> None:
    logits, labels = _inputs(torch.float32)
    assert not _matches(_chunked(7, wrong), logits, labels, rtol=1e-5, atol=1e-7)


def test_every_label_ignored_gives_nan_and_a_zero_gradient_like_f_cross_entropy() -> None:
    logits, _ = _inputs(torch.float32)
    labels = torch.full((TOKENS,), IGNORE_INDEX)
    loss, grad = _loss_and_grad(_chunked(7), logits, labels)
    ref_loss, ref_grad = _reference(logits, labels)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert torch.equal(grad, ref_grad) and not grad.any()


def test_the_model_loss_takes_the_chunked_path_for_batch_by_sequence_logits() -> None:
    logits, labels = _inputs(torch.float32)
    logits, labels = logits.view(4, 25, VOCAB).requires_grad_(), labels.view(4, 25)
    loss = cross_entropy_loss(logits, labels)
    assert type(loss.grad_fn).__name__ == "ChunkedCrossEntropyBackward"
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX))


def test_chunk_tokens_bounds_the_float32_chunk() -> None:
    assert chunk_tokens(128256) * 128256 <= 2**26 < (chunk_tokens(128256) + 1) * 128256
    assert chunk_tokens(10**9) == 1


# Memory: bf16 logits [2, 512, 4096] (8 MiB), chunks of 128 tokens (a float32 chunk is 2 MiB).
MEMORY_SHAPE, MEMORY_CHUNK = (2, 512, 4096), 128
# Scalars, the per-token mask, targets and row scales (at most 8 bytes each) that both passes make.
PER_TOKEN_SLACK = 4 * 8


def _tally(loss_fn: Any) -> tuple[int, int, int]:
    """Bytes alive after forward, forward's peak, and the peak of forward + backward."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*MEMORY_SHAPE, generator=generator).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, MEMORY_SHAPE[2], MEMORY_SHAPE[:2], generator=generator)
    with LiveTensorPeak([logits, labels]) as tally:
        loss = loss_fn(logits, labels)
        kept, forward_peak = tally.live, tally.peak
        loss.backward()
    return kept, forward_peak, tally.peak


def _chunked_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return chunked_cross_entropy(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX, MEMORY_CHUNK)


def _upcast_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def _within_bounds(loss_fn: Any) -> bool:
    tokens, vocab = MEMORY_SHAPE[0] * MEMORY_SHAPE[1], MEMORY_SHAPE[2]
    float32_chunk = MEMORY_CHUNK * vocab * 4
    grad = tokens * vocab * 2  # bf16, the logits' dtype
    slack = PER_TOKEN_SLACK * tokens
    kept, forward_peak, peak = _tally(loss_fn)
    # Kept: the gradient, made in forward (the logits themselves are not needed by backward). Peaks: that
    # and one float32 chunk.
    return (
        kept <= grad + slack and forward_peak <= grad + float32_chunk + slack and peak <= grad + float32_chunk + slack
    )


def test_memory_is_the_gradient_and_one_float32_chunk() -> None:
    assert _within_bounds(_chunked_model_loss)


def test_without_grad_nothing_of_the_logits_size_is_made_and_a_second_backward_is_refused() -> None:
    # Evaluation (a held-out loss) makes no gradient: its peak is one float32 chunk, a quarter of the logits.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*MEMORY_SHAPE, generator=generator).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, MEMORY_SHAPE[2], MEMORY_SHAPE[:2], generator=generator)
    with torch.no_grad(), LiveTensorPeak([logits, labels]) as tally:
        _chunked_model_loss(logits, labels)
    assert tally.peak <= MEMORY_CHUNK * MEMORY_SHAPE[2] * 4 + PER_TOKEN_SLACK * MEMORY_SHAPE[0] * MEMORY_SHAPE[1]
    logits, labels = _inputs(torch.float32)
    leaf = logits.requires_grad_()
    loss = chunked_cross_entropy(leaf, labels, IGNORE_INDEX, 7)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_the_upcasting_loss_fails_the_memory_bounds() -> None:
    assert not _within_bounds(_upcast_loss)
