"""Held-out preference pairs: how often the policy's implicit reward ranks the chosen completion of a
pair it never trained on above the rejected one (`heldout_reward_accuracy`, TRL's rewards/accuracies
on its evaluation set), with the held-out loss and mean reward margin.

The same pairs every time: the first `validation.batches x training.global_batch_size` pairs of the
held-out source, unshuffled. Rank r of W evaluates pairs r, r+W, ... in micro-batches of
`local_batch_size`, so every rank runs as many forwards (FSDP's and the router's collectives need
that) and the ranks together evaluate the same pairs whatever the layout; the sums are then added
over the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from titan_tpu.distributed.fsdp import reshard_all
from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.dpo.batch import PreferenceBatch, sequence_logps
from titan_tpu.tasks.dpo.loss import PreferenceTerms

# (policy log-probabilities [2n], the batch with its reference log-probabilities) -> the batch's terms.
Objective = Callable[[torch.Tensor, PreferenceBatch], PreferenceTerms]


@torch.no_grad()
def held_out_preferences(
    model: nn.Module, batches: Iterable[PreferenceBatch], objective: Objective, ctx: TaskContext
) -> dict[str, float]:
    """Every rank calls it with as many batches (reference log-probabilities already set). The model
    is put in eval mode for the passes and given back in the mode it was in, every FSDP group
    sharded again."""
    sums = torch.zeros(4, dtype=torch.float64, device=ctx.device)  # pairs, accurate, loss x pairs, margins
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            terms = objective(sequence_logps(model(batch.tokens), batch), batch)
            pairs = batch.pairs
            margins = (terms.chosen_rewards - terms.rejected_rewards).sum()
            sums += torch.stack(
                [torch.tensor(float(pairs), device=ctx.device), terms.accurate.sum(), terms.loss * pairs, margins]
            ).double()
    finally:
        model.train(was_training)
        reshard_all(model)
    pairs, accurate, loss, margins = sum_over(sums, ctx.parallel.dp_reduce_mesh).tolist()
    return {
        "heldout_reward_accuracy": accurate / pairs,
        "heldout_reward_margin": margins / pairs,
        "validation/loss": loss / pairs,
        "validation/pairs": pairs,
    }
