"""Language-model loss."""

import torch
import torch.nn.functional as F

# Labels with this value (padding, prompt tokens in fine-tuning) contribute nothing to the loss.
IGNORE_INDEX = -100


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labels that are not IGNORE_INDEX.

    logits [B, S, V] (any float dtype), labels [B, S] already shifted by the data pipeline. The logits
    are upcast to float32 here because the log-sum-exp over a 128k vocabulary in bf16 is too coarse.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="mean"
    )
