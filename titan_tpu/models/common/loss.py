"""Language-model loss."""

import torch
import torch.nn.functional as F

from titan_tpu.models.common.chunked_cross_entropy import CHUNK_ELEMENTS, chunk_tokens, chunked_cross_entropy

# Labels with this value (padding, prompt tokens in fine-tuning) contribute nothing to the loss.
IGNORE_INDEX = -100


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not IGNORE_INDEX.

    logits [B, S, V] (any float dtype), labels [B, S] already shifted by the data pipeline. The
    log-sum-exp is taken in float32 because in bf16 it is too coarse over a 128k vocabulary; the chunked
    loss does that one chunk of tokens at a time, so no float32 copy of the whole logits is ever kept;
    `chunk_elements` bounds a chunk (the run measures the fastest, `loss_tunable.py`).
    """
    if type(logits) is not torch.Tensor:
        # A tensor subclass: vocab-sharded DTensor logits under tensor parallelism with loss parallel
        # (model code names no torch.distributed type). They keep F.cross_entropy, which
        # `loss_parallel()` implements without gathering the vocabulary; each rank upcasts its shard.
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="mean"
        )
    step = chunk_tokens(logits.shape[-1], chunk_elements)
    return chunked_cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), IGNORE_INDEX, step)
