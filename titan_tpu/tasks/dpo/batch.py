"""A micro-batch of preference pairs as the model sees it, and each completion's log-probability.

As TRL's DPOTrainer concatenates them, the micro-batch's n pairs are 2n rows in one forward: the n
chosen sequences (prompt + chosen completion), then the n rejected ones, right-padded to a common
width. The width is the micro-batch's longest sequence, rounded up to a multiple of the tensor-parallel
degree when sequence parallelism shards rows along the sequence; with compiled blocks it is always
training.seq_len (a compiled block specialises on the sequence length, so each new width would be
another compilation). Right padding changes nothing before it under the causal mask.

A completion's log-probability is the sum, over its tokens, of the log-probability of the token given
everything before it (the first token of a sequence has no prediction and is never scored; TRL's shift).
The log-softmax runs in float32, or in the logits' dtype when it is wider (float64 in the parity tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_tpu.generation.logprobs import logits_of


@dataclass
class PreferenceBatch:
    tokens: torch.Tensor  # int64 [2n, W] on the device: chosen rows, then rejected rows
    scored: torch.Tensor  # bool [2n, W - 1]: positions whose next token is a completion token
    completion_tokens: torch.Tensor  # float32 [2n]: each sequence's completion tokens (IPO's average)
    real_tokens: int  # tokens of the 2n sequences, padding left out
    reference_logps: torch.Tensor | None = None  # [2n], the frozen reference's (set before the loss)

    @property
    def pairs(self) -> int:
        return self.tokens.shape[0] // 2


def preference_batch(
    sample: dict[str, torch.Tensor], width_multiple: int, fixed_width: int | None, device: torch.device
) -> PreferenceBatch:
    """The rows of a collated micro-batch of `PreferenceDataset` samples."""
    prompt = sample["prompt_length"].repeat(2)
    ends = torch.cat([sample["chosen_length"], sample["rejected_length"]])
    if fixed_width is None:
        longest = int(ends.max())
        width = -(-longest // width_multiple) * width_multiple
    else:
        width = fixed_width
    rows = torch.cat([sample["chosen"], sample["rejected"]])  # [2n, training.seq_len], a multiple of the degree
    positions = torch.arange(width)
    completion = (positions[None, :] >= prompt[:, None]) & (positions[None, :] < ends[:, None])
    return PreferenceBatch(
        tokens=rows[:, :width].to(device, non_blocking=True),
        scored=completion[:, 1:].to(device, non_blocking=True),
        completion_tokens=(ends - prompt).float().to(device),
        real_tokens=int(ends.sum()),
    )


def sequence_logps(output: Any, batch: PreferenceBatch) -> torch.Tensor:
    """[2n]: each sequence's completion log-probability under the model whose output this is."""
    logits = logits_of(output)[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = batch.tokens[:, 1:]
    token_logps = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.where(batch.scored, token_logps, 0.0).sum(dim=-1)
