"""One rollout batch: prompts -> G sampled completions each -> rewards -> advantages -> training
micro-batches carrying the rollout policy's (and the reference's) per-token log-probabilities. The
rollout policy's are the sampler's own, recorded from the logits each token was drawn from: the
same function of the same weights as a training forward over the finished row (the KV cache and
left padding change the rounding only), without that forward's cost.

Rows are numbered globally: row = prompt index x G + completion index, the same on every parallel
layout. The batch is cut into mini-batches of `global_batch` rows in order (one optimizer step each);
within a mini-batch, data-parallel rank r holds the r-th slice, cut into its micro-batches. Rewards and
completion lengths are shared between ranks with one sum, so each group's advantage is computed from
the whole group wherever its rows were sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    """tokens [b, L]: prompt then completion, right-padded; mask [b, L-1] marks the positions whose
    next token is a completion token; old/ref log-probs [b, L-1] of those next tokens; advantages [b];
    token_normaliser: the mini-batch's completion tokens / (micro-batches x ranks) (token_mean).

    old_logps is None where the batch is trained by the very weights that sampled it (the first
    mini-batch of a rollout used once, the builtin engine): the old log-probs are then the training
    forward's own, detached, so the importance ratio is exactly 1 there.

    From a rollout engine other than the trainer's own modules: sampled_logps are the engine's (the
    behaviour policy's) and trainer_logps the trainer's forward on the same tokens at rollout time;
    with the importance-sampling correction, old_logps are the trainer's and is_weights the truncated
    per-token ratios trainer / engine."""

    tokens: torch.Tensor
    mask: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    token_normaliser: float
    lengths: list[int]  # each row's prompt and completion tokens (its real tokens, no padding)
    sampled_logps: torch.Tensor | None = None
    trainer_logps: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    # (tied groups, groups) of its mini-batch: all tied means every advantage of the step is 0.
    groups_tied: tuple[int, int] = (0, 0)

    @property
    def real_tokens(self) -> int:
        """What one forward-backward covers: the rows' tokens without padding."""
        return sum(self.lengths)


def rank_rows(n_rows: int, global_batch: int, dp_rank: int, dp_world: int) -> list[list[int]]:
    """The global row indices of each mini-batch that this rank trains on."""
    per_rank = global_batch // dp_world
    return [
        list(range(start + dp_rank * per_rank, start + (dp_rank + 1) * per_rank))
        for start in range(0, n_rows, global_batch)
    ]


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
    trained: Sequence[Sequence[bool]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows prompt + completion, right-padded with `pad_id` (right padding changes nothing before it
    under a causal mask, so the training forward needs no mask), and the completion mask [b, L-1].
    `trained` (a multi-turn episode's): per completion token, whether the model sampled it; the others
    (the environment's messages, the template between turns) stay out of the mask."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width - 1, dtype=torch.float32)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        row = list(prompt) + list(completion)
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        if trained is None:
            mask[i, len(prompt) - 1 : len(row) - 1] = 1.0
        else:
            mask[i, len(prompt) - 1 : len(row) - 1] = torch.tensor(trained[i], dtype=torch.float32)
    return tokens.to(device), mask.to(device)


def place_completion_logps(
    prompt_lengths: Sequence[int], completion_logps: Sequence[torch.Tensor], mask: torch.Tensor
) -> torch.Tensor:
    """Each row's completion log-probs [T_i] at its completion positions of a [b, L-1] tensor laid out
    like `pack_sequences`' mask (the position before each token predicts it); 0 elsewhere."""
    placed = torch.zeros(mask.shape, dtype=torch.float32)
    for i, (prompt_len, logps) in enumerate(zip(prompt_lengths, completion_logps)):
        placed[i, prompt_len - 1 : prompt_len - 1 + len(logps)] = logps
    return placed.to(mask.device)


def build_micro_batches(
    rows: list[list[int]],
    prompts: dict[int, list[int]],
    completions: dict[int, list[int]],
    advantages: torch.Tensor,
    completion_lengths: torch.Tensor,
    global_batch: int,
    micro_batch: int,
    dp_world: int,
    pad_id: int,
    device: torch.device,
    sampled_logps: dict[int, torch.Tensor],
    reference_logps: Callable[[torch.Tensor], torch.Tensor] | None,
    first_on_policy: bool,
    trainer_logps: Callable[[torch.Tensor], torch.Tensor] | None = None,
    is_cap: float | None = None,
    trained: dict[int, list[bool]] | None = None,
) -> list[MicroBatch]:
    """Micro-batches of every mini-batch in `rows` (this rank's rows per mini-batch), with the rollout
    policy's log-probs of each row's completion tokens (`sampled_logps`, as the sampler recorded them)
    and the reference's. `completion_lengths` [N] holds every row's completion length, all ranks'
    rows included. `first_on_policy`: the first mini-batch is trained before any update (each
    mini-batch is used once), so it trains on its own log-probs (its old_logps None).

    `trainer_logps`: for an engine other than the trainer's modules, the trainer's log-probs of the
    same tokens, recorded beside the engine's; with `is_cap` (the importance-sampling correction) they
    are the old log-probs and min(exp(trainer - engine), is_cap) weighs each token. `trained`: each
    multi-turn row's mask of model-sampled tokens (`completion_lengths` then counts those only)."""
    batches = []
    for index, mini in enumerate(rows):
        on_policy = first_on_policy and index == 0
        micro_count = len(mini) // micro_batch
        first = mini[0] // global_batch * global_batch
        mini_batch_tokens = float(completion_lengths[first : first + global_batch].sum())
        for k in range(micro_count):
            chunk = mini[k * micro_batch : (k + 1) * micro_batch]
            tokens, mask = pack_sequences(
                [prompts[r] for r in chunk],
                [completions[r] for r in chunk],
                pad_id,
                device,
                None if trained is None else [trained[r] for r in chunk],
            )
            sampled = place_completion_logps([len(prompts[r]) for r in chunk], [sampled_logps[r] for r in chunk], mask)
            trainer = trainer_logps(tokens).float() * mask if trainer_logps is not None else None
            old: torch.Tensor | None = None if on_policy else sampled
            weights = None
            if trainer is not None:
                old = sampled
                if is_cap is not None:
                    old = trainer
                    weights = torch.exp(trainer - sampled).clamp(max=is_cap) * mask
            batches.append(
                MicroBatch(
                    tokens=tokens,
                    mask=mask,
                    old_logps=old,
                    ref_logps=reference_logps(tokens) if reference_logps is not None else None,
                    advantages=advantages[chunk].to(device),
                    token_normaliser=mini_batch_tokens / (micro_count * dp_world),
                    lengths=[len(prompts[r]) + len(completions[r]) for r in chunk],
                    sampled_logps=sampled if trainer is not None else None,
                    trainer_logps=trainer,
                    is_weights=weights,
                )
            )
    return batches
