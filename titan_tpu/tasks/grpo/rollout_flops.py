"""Model FLOPs of a rollout's forward work, for its TFLOP/s and MFU beside the training step's.

Convention: the model family's own (`decoder_training_flops_per_token` for the decoders), read as a
forward pass alone, which is a third of the training count (`TRAINING_PASSES`). One token that
attends to c keys costs

    forward(c) = 2 N + 4 L H D c        (N: non-embedding matmul weights, active experts only)

A rollout row with a prompt of P tokens and a completion of T tokens (stop token included) costs:

- sampling with the KV cache: the prefill, P tokens each charged the prompt's full square
  (P forward(P): no causal discount, as training counts it), once for the group of rows that share
  the prompt (the sampler prefills a prompt once and copies its cache rows), then one decode step per
  generated token fed back, the j-th against the P + j keys its cache then holds, j = 1 .. T-1 (the
  last token is never fed back: nothing is sampled after it);
- each log-probability pass over prompt + completion (the reference's, when rl.beta > 0; the rollout
  policy's are recorded while sampling): (P + T) forward(P + T), the row's full square.

What the batch also computes for padding (left-padded prompts, finished rows decoded until the batch
is compacted, right-padded log-prob micro-batches) is overhead, not model work, and is not counted,
as the training MFU does not count a mixture of experts' padding. Nor is a second prefill of a group
whose rows two sampling batches or two ranks hold: the count errs low, never high.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from titan_tpu.models.common.flops import TRAINING_PASSES


@dataclass(frozen=True)
class ForwardCost:
    """Forward FLOPs of one token that attends to c keys: per_token + per_key * c."""

    per_token: float  # 2 N: every matmul weight the token passes through, the output head included
    per_key: float  # 4 L H D: attention's q k^T and p v against one key more

    @classmethod
    def of_family(cls, training_flops_per_token: Callable[[Any, int], float], args: Any) -> ForwardCost:
        """From the family's training FLOPs per token (`ModelSpec.flops_per_token(args, seq_len)`),
        which is linear in seq_len and TRAINING_PASSES forwards' worth."""
        at_no_keys = training_flops_per_token(args, 0) / TRAINING_PASSES
        return cls(at_no_keys, training_flops_per_token(args, 1) / TRAINING_PASSES - at_no_keys)

    def token(self, keys: int) -> float:
        return self.per_token + self.per_key * keys

    def sampling(self, prompt_len: int, completion_len: int) -> float:
        """Prefill of the prompt, then the completion's tokens but the last fed back one at a time."""
        return self.prefill(prompt_len) + self.decoding(prompt_len, completion_len)

    def prefill(self, prompt_len: int) -> float:
        return prompt_len * self.token(prompt_len)

    def decoding(self, prompt_len: int, completion_len: int) -> float:
        """The completion's tokens but the last fed back one at a time, after a prompt's prefill."""
        fed_back = completion_len - 1
        decode_keys = fed_back * prompt_len + fed_back * (fed_back + 1) // 2  # sum of P + j, j = 1 .. T-1
        return fed_back * self.per_token + self.per_key * decode_keys

    def scoring(self, length: int) -> float:
        """One forward over a whole row of `length` tokens (a log-probability pass)."""
        return length * self.token(length)


def rollout_flops(cost: ForwardCost, groups: Iterable[tuple[int, Sequence[int]]], scoring_passes: int) -> float:
    """Sampling plus `scoring_passes` log-probability passes of every group of rows sharing a prompt:
    (prompt length, the completion lengths of its rows)."""
    groups = list(groups)
    sampling = sum(cost.prefill(p) + sum(cost.decoding(p, t) for t in completions) for p, completions in groups)
    return sampling + scoring_flops(cost, groups, scoring_passes)


def scoring_flops(cost: ForwardCost, groups: Iterable[tuple[int, Sequence[int]]], passes: int) -> float:
    """`passes` log-probability passes over every row of the groups: (prompt length, completion lengths)."""
    return passes * sum(cost.scoring(p + t) for p, completions in groups for t in completions)
