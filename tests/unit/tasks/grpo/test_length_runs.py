"""GRPO's training forward in runs of rows of similar length (titan_tpu/tasks/grpo/length_runs.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch

from titan_tpu.generation.logprobs import token_logps
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.tasks.grpo import length_runs
from titan_tpu.tasks.grpo.length_runs import length_runs as cut_runs
from titan_tpu.tasks.grpo.length_runs import logps_in_runs


def padded_tokens(runs: list[list[int]], lengths: list[int]) -> int:
    return sum(len(run) * max(lengths[i] for i in run) for run in runs)


def fewest_padded_tokens(lengths: list[int], count: int) -> int:
    """By trying every way to cut the sorted rows into `count` non-empty runs."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    best = None
    for cuts in itertools.combinations(range(1, len(order)), count - 1):
        bounds = [0, *cuts, len(order)]
        runs = [order[a:b] for a, b in zip(bounds, bounds[1:])]
        cost = padded_tokens(runs, lengths)
        best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_runs_cover_every_row_once_and_pad_fewest_tokens(seed: int) -> None:
    """Catches a row lost or repeated, a run count that depends on the lengths (ranks whose forwards
    exchange activations would fall out of step), and cuts that are not the cheapest."""
    generator = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 11, (), generator=generator))
    lengths = torch.randint(3, 40, (rows,), generator=generator).tolist()
    for count in (1, 2, 4):
        runs = cut_runs(lengths, count)
        assert len(runs) == min(count, rows) and all(runs)
        assert sorted(i for run in runs for i in run) == list(range(rows))
        assert padded_tokens(runs, lengths) == fewest_padded_tokens(lengths, min(count, rows))


def test_the_log_probs_and_gradients_equal_one_forward_over_the_padded_batch() -> None:
    """Rows of different lengths, right-padded: the runs' log-probabilities on every real position,
    and the gradients of a loss over them, equal one forward's. Catches a row put back in another
    row's place and a run cut shorter than its longest row (the negative control)."""
    torch.manual_seed(0)
    args = dataclasses.replace(
        QWEN3_FLAVORS["debug"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=128
    )
    args = dataclasses.replace(args, vocab_size=128, max_seq_len=64)
    model = Qwen3Model(args)
    model.init_weights()
    lengths = [9, 23, 5, 17, 23, 12, 6, 20]
    tokens = torch.randint(1, 128, (len(lengths), max(lengths)))
    mask = torch.zeros(len(lengths), max(lengths) - 1)
    for row, length in enumerate(lengths):
        tokens[row, length:] = 0
        mask[row, : length - 1] = 1.0
    weights = torch.randn(mask.shape)

    def logps_and_grads(logps_fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logps = logps_fn() * mask
        (logps * weights).sum().backward()
        return logps.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    whole, whole_grads = logps_and_grads(lambda: token_logps(model, tokens))
    runs, runs_grads = logps_and_grads(lambda: logps_in_runs(model, tokens, lengths))
    assert len(cut_runs(lengths, length_runs.RUNS)) == 4
    torch.testing.assert_close(runs, whole, rtol=0, atol=1e-5)
    for got, expected in zip(runs_grads, whole_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)

    # Negative control: every row taken a token shorter than it is, so each run is cut before its
    # longest row's last token, whose log-probability is then missing.
    short = logps_in_runs(model, tokens, [n - 1 for n in lengths]).detach() * mask
    assert not torch.allclose(short, whole, atol=1e-3)
