"""A micro-batch of pairs as rows, and each completion's log-probability (titan_tpu/tasks/dpo/batch.py).

Bugs caught: prompt or padding tokens scored (their logits would move the loss), the first completion
token left out or the token after the sequence scored (an off-by-one in the shift), chosen and rejected
rows of different pairs put side by side, a width that is not a multiple of the tensor-parallel degree
under sequence parallelism (or not training.seq_len with compiled blocks)."""

from __future__ import annotations

import torch

from titan_tpu.tasks.dpo.batch import preference_batch, sequence_logps

PAD = 0


def _sample() -> dict[str, torch.Tensor]:
    """Two pairs, rows of 10: prompts of 3 and 2 tokens; completions of 2/4 and 3/1 tokens."""
    chosen = torch.tensor([[5, 6, 7, 11, 12, PAD, PAD, PAD, PAD, PAD], [8, 9, 21, 22, 23, PAD, PAD, PAD, PAD, PAD]])
    rejected = torch.tensor([[5, 6, 7, 13, 14, 15, 16, PAD, PAD, PAD], [8, 9, 24, PAD, PAD, PAD, PAD, PAD, PAD, PAD]])
    return {
        "chosen": chosen,
        "rejected": rejected,
        "prompt_length": torch.tensor([3, 2]),
        "chosen_length": torch.tensor([5, 5]),
        "rejected_length": torch.tensor([7, 3]),
    }


def test_rows_are_the_chosen_then_the_rejected_sequences_cut_to_the_longest() -> None:
    batch = preference_batch(_sample(), 1, None, torch.device("cpu"))
    assert batch.tokens.tolist() == [
        [5, 6, 7, 11, 12, PAD, PAD],
        [8, 9, 21, 22, 23, PAD, PAD],
        [5, 6, 7, 13, 14, 15, 16],
        [8, 9, 24, PAD, PAD, PAD, PAD],
    ]
    assert batch.pairs == 2 and batch.real_tokens == 5 + 5 + 7 + 3
    assert batch.completion_tokens.tolist() == [2.0, 3.0, 4.0, 1.0]
    # scored[r, p]: is token p + 1 of row r a completion token?
    assert batch.scored.int().tolist() == [
        [0, 0, 1, 1, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 1, 0, 0, 0, 0],
    ]


def test_width_is_a_multiple_of_the_degree_or_the_fixed_length() -> None:
    assert preference_batch(_sample(), 4, None, torch.device("cpu")).tokens.shape == (4, 8)
    assert preference_batch(_sample(), 1, 10, torch.device("cpu")).tokens.shape == (4, 10)


def test_only_completion_tokens_count() -> None:
    batch = preference_batch(_sample(), 1, None, torch.device("cpu"))
    logits = torch.randn(4, 7, 32, dtype=torch.float64)
    logps = sequence_logps(logits, batch)
    by_hand = torch.log_softmax(logits, dim=-1)
    rows = batch.tokens
    expected = [
        by_hand[0, 2, rows[0, 3]] + by_hand[0, 3, rows[0, 4]],
        by_hand[1, 1, rows[1, 2]] + by_hand[1, 2, rows[1, 3]] + by_hand[1, 3, rows[1, 4]],
        sum(by_hand[2, p, rows[2, p + 1]] for p in range(2, 6)),
        by_hand[3, 1, rows[3, 2]],
    ]
    assert torch.allclose(logps, torch.stack(expected))  # type: ignore[arg-type]
    assert logps.dtype == torch.float64  # never narrower than the logits
    # The logits at prompt positions (predicting prompt tokens), after a sequence's end and at the
    # last position move nothing ...
    moved = logits.clone()
    moved[0, :2] += 5 * torch.randn(2, 32, dtype=torch.float64)
    moved[0, 4:] += 5 * torch.randn(3, 32, dtype=torch.float64)
    moved[3, 0] += 5 * torch.randn(32, dtype=torch.float64)
    moved[3, 2:] -= 3 * torch.randn(5, 32, dtype=torch.float64)
    assert torch.equal(sequence_logps(moved, batch), logps)
    # ... those predicting a completion token do (negative control).
    moved[3, 1, rows[3, 2]] += 1
    assert sequence_logps(moved, batch)[3] != logps[3]
