"""The training forward of a rollout micro-batch in runs of rows of similar length.

A micro-batch's rows (prompt + completion) are right-padded to its longest, and completions differ in
length: one forward over the whole [b, L] pays for the padding (18-20% of the tokens of the CPU recipe's
GRPO micro-batches, far more where completions run from tens to thousands of tokens). The rows sorted by
length and cut into a few runs, each padded only to its own longest row, leave most of that out; the
log-probabilities are the same (right padding changes nothing before it under a causal mask), put back
in the micro-batch's row order, and one backward covers every run.

Every rank of a micro-batch of b rows runs exactly min(RUNS, b) forwards, whatever its rows' lengths,
so ranks whose forwards exchange activations stay in step. Only a family whose forward may run several
times before one backward takes this path (Capabilities.repeated_forward), and only uncompiled (a
compiled block specialises on the sequence length, so each run's width would be a compilation); the
others forward once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.generation.logprobs import logps_of

# Forwards per micro-batch. The forward and backward of a [64, 61] micro-batch of the CPU recipe's
# lengths took 0.74-0.80 s in one forward, 0.54-0.69 s in 4 runs and 0.70 s in 8, where each
# forward's fixed cost outweighs the padding it leaves out (2-core AMD EPYC, fp32).
RUNS = 4


def length_runs(lengths: Sequence[int], runs: int) -> list[list[int]]:
    """Row indices sorted by length, cut into exactly min(runs, len(lengths)) non-empty runs of
    consecutive rows so that the padded tokens, the sum over runs of rows x longest row, are fewest."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    count = min(runs, len(order))
    if count <= 1:
        return [order]
    n = len(order)
    # On the training step's path: one [n+1, n+1] tensor operation per run, not a Python loop over
    # n^2 cuts. cost[j]: fewest padded tokens of the first j sorted rows in k runs so far; a run of
    # sorted rows start..j-1 costs (j - start) x the length of row j-1, its longest.
    longest = torch.tensor([0] + [lengths[i] for i in order], dtype=torch.float64)[:, None]  # [j]: row j-1's
    ends = torch.arange(n + 1)[:, None]
    starts = torch.arange(n + 1)[None, :]
    cost = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    cost[0] = 0.0
    cuts = []
    for k in range(1, count + 1):
        possible = (starts >= k - 1) & (starts < ends)
        values = torch.where(possible, cost[None, :] + (ends - starts) * longest, float("inf"))
        cost, cut = values.min(dim=1)
        cuts.append(cut)
    bounds = [n]
    for cut in reversed(cuts):
        bounds.append(int(cut[bounds[-1]]))
    bounds.reverse()
    return [order[bounds[k] : bounds[k + 1]] for k in range(count)]


def logps_in_runs(model: nn.Module, tokens: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Log-probabilities of every next token of `tokens` [b, L] (row i real up to lengths[i]), [b, L-1]
    in float32 and 0 past each row's end, from one forward per length run, in the rows' order. The
    model's forward must return its logits (a dense model: see Capabilities.repeated_forward)."""
    width = tokens.shape[1]
    pieces, rows = [], []
    for run in length_runs(lengths, RUNS):
        index = torch.tensor(run, device=tokens.device)
        longest = max(lengths[i] for i in run)
        part = tokens.index_select(0, index)[:, :longest]
        pieces.append(F.pad(logps_of(model(part), part), (0, width - longest)))
        rows.append(index)
    return torch.cat(pieces)[torch.argsort(torch.cat(rows))]
