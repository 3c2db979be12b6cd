"""The GRPO objective against a float64 reference written out element by element in plain Python.

Each numerical check has a negative control: a deliberately wrong input (or formula) must miss the
reference, so a test that compares nothing cannot pass.
"""

from __future__ import annotations

import math

import pytest
import torch

from titan_tpu.tasks.grpo.objective import LOSS_AGGREGATIONS, group_advantages, grpo_loss, k3_kl

# Two groups of three completions, up to four tokens each.
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
LOGPS = [
    [-0.5, -1.2, -0.1, -2.0],
    [-0.7, -0.3, -1.5, -0.2],
    [-1.0, -0.05, -0.4, -0.9],
    [-0.2, -2.5, -0.6, -0.3],
    [-1.1, -0.8, -0.15, -0.45],
    [-0.35, -0.6, -1.8, -0.25],
]
OLD_LOGPS = [
    [-0.9, -1.0, -0.1, -1.0],  # ratios exp(0.4), exp(-0.2), 1, exp(-1)
    [-0.5, -0.6, -1.5, -0.2],
    [-0.8, -0.5, -0.4, -0.7],
    [-0.2, -2.2, -0.9, -0.3],
    [-1.4, -0.8, -0.1, -0.45],
    [-0.35, -0.9, -1.2, -0.25],
]
REF_LOGPS = [[lp - 0.1 * (i + j) for j, lp in enumerate(row)] for i, row in enumerate(LOGPS)]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
EPS_LOW, EPS_HIGH, BETA, MAX_TOKENS = 0.2, 0.28, 0.05, 4


def reference_advantages(rewards: list[float], group: int, scale: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), group):
        values = rewards[start : start + group]
        mean = sum(values) / group
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (group - 1))
        out += [(v - mean) / (std + eps) if scale else v - mean for v in values]
    return out


def reference_per_token(advantages: list[float], beta: float) -> list[list[float]]:
    rows = []
    for i, adv in enumerate(advantages):
        row = []
        for lp, old, ref in zip(LOGPS[i], OLD_LOGPS[i], REF_LOGPS[i]):
            ratio = math.exp(lp - old)
            clipped = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH)
            kl = math.exp(ref - lp) - (ref - lp) - 1
            row.append(-min(ratio * adv, clipped * adv) + beta * kl)
        rows.append(row)
    return rows


def reference_loss(advantages: list[float], beta: float, aggregation: str) -> float:
    per_token = reference_per_token(advantages, beta)
    sums = [sum(v * m for v, m in zip(row, MASK[i])) for i, row in enumerate(per_token)]
    counts = [sum(m) for m in MASK]
    if aggregation == "token_mean":
        return sum(sums) / sum(counts)
    if aggregation == "seq_mean_token_mean":
        return sum(s / c for s, c in zip(sums, counts)) / len(sums)
    return sum(s / MAX_TOKENS for s in sums) / len(sums)


def tensor(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_advantages_match_hand_computed_groups() -> None:
    for scale in (True, False):
        got = group_advantages(tensor(REWARDS), group_size=3, scale_by_std=scale, eps=1e-4)
        assert torch.allclose(got, tensor(reference_advantages(REWARDS, 3, scale, 1e-4)), rtol=0, atol=1e-12)
    # Negative control: normalising over the wrong group boundaries (group of 2) must not match.
    wrong = group_advantages(tensor(REWARDS), group_size=2, scale_by_std=True, eps=1e-4)
    assert not torch.allclose(wrong, tensor(reference_advantages(REWARDS, 3, True, 1e-4)), atol=1e-3)


def test_group_with_equal_rewards_has_zero_advantage() -> None:
    adv = group_advantages(tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3, dtype=torch.float64))
    assert adv[3:].abs().sum() > 0


def test_k3_is_nonnegative_and_zero_at_equal_policies() -> None:
    logps = tensor(LOGPS)
    assert torch.equal(k3_kl(logps, logps), torch.zeros_like(logps))
    assert (k3_kl(logps, tensor(REF_LOGPS)) >= 0).all()


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_loss_matches_hand_computed_reference(aggregation: str, beta: float) -> None:
    advantages = reference_advantages(REWARDS, 3, True, 1e-4)
    terms = grpo_loss(
        tensor(LOGPS),
        tensor(OLD_LOGPS),
        tensor(advantages),
        tensor(MASK),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        aggregation=aggregation,  # type: ignore[arg-type]
        max_completion_tokens=MAX_TOKENS,
        beta=beta,
        ref_logps=tensor(REF_LOGPS),
    )
    expected = reference_loss(advantages, beta, aggregation)
    assert terms.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    # Negative control: swapping the two clip ranges changes which ratios are clipped and the loss.
    swapped = grpo_loss(
        tensor(LOGPS),
        tensor(OLD_LOGPS),
        tensor(advantages),
        tensor(MASK),
        eps_low=EPS_HIGH,
        eps_high=EPS_LOW,
        aggregation=aggregation,  # type: ignore[arg-type]
        max_completion_tokens=MAX_TOKENS,
        beta=beta,
        ref_logps=tensor(REF_LOGPS),
    )
    assert swapped.loss.item() != pytest.approx(expected, rel=1e-6)


def test_kl_and_clip_fraction_are_masked_means() -> None:
    advantages = reference_advantages(REWARDS, 3, True, 1e-4)
    terms = grpo_loss(
        tensor(LOGPS),
        tensor(OLD_LOGPS),
        tensor(advantages),
        tensor(MASK),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        aggregation="token_mean",
        max_completion_tokens=MAX_TOKENS,
        beta=BETA,
        ref_logps=tensor(REF_LOGPS),
    )
    kls, clipped, count = 0.0, 0, 0
    for i, adv in enumerate(advantages):
        for j in range(MAX_TOKENS):
            if not MASK[i][j]:
                continue
            ratio = math.exp(LOGPS[i][j] - OLD_LOGPS[i][j])
            delta = REF_LOGPS[i][j] - LOGPS[i][j]
            kls += math.exp(delta) - delta - 1
            clipped += (ratio < 1 - EPS_LOW and adv < 0) or (ratio > 1 + EPS_HIGH and adv > 0)
            count += 1
    assert clipped > 0, "the example must clip some tokens, or the clip fraction is untested"
    assert terms.kl.item() == pytest.approx(kls / count, rel=1e-12)
    assert terms.clip_fraction.item() == pytest.approx(clipped / count, rel=1e-12)
    assert terms.tokens.item() == count


def test_token_normaliser_gives_the_mini_batch_token_mean() -> None:
    """Two micro-batches of unequal token counts, averaged as the trainer does, equal the token mean
    of the whole mini-batch only with the mini-batch normaliser (the bug: per-micro-batch means)."""
    advantages = tensor(reference_advantages(REWARDS, 3, True, 1e-4))
    args = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, aggregation="token_mean", max_completion_tokens=MAX_TOKENS)
    whole = grpo_loss(tensor(LOGPS), tensor(OLD_LOGPS), advantages, tensor(MASK), **args).loss  # type: ignore[arg-type]
    halves = [slice(0, 2), slice(2, 6)]
    per_micro = sum(tensor(MASK)[s].sum() for s in halves) / len(halves)

    def averaged(normaliser: torch.Tensor | None) -> torch.Tensor:
        parts = [
            grpo_loss(
                tensor(LOGPS)[s],
                tensor(OLD_LOGPS)[s],
                advantages[s],
                tensor(MASK)[s],
                token_normaliser=normaliser,
                **args,
            ).loss  # type: ignore[arg-type]
            for s in halves
        ]
        return sum(parts) / len(parts)

    assert averaged(per_micro).item() == pytest.approx(whole.item(), rel=1e-12)
    assert averaged(None).item() != pytest.approx(whole.item(), rel=1e-6)


def test_gradient_pushes_toward_positive_advantage() -> None:
    logps = tensor(LOGPS).requires_grad_(True)
    advantages = tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    grpo_loss(
        logps,
        logps.detach(),
        advantages,
        tensor(MASK),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        aggregation="seq_mean_token_mean",
        max_completion_tokens=MAX_TOKENS,
    ).loss.backward()
    assert logps.grad is not None
    assert (logps.grad[0][tensor(MASK)[0] > 0] < 0).all()  # descent raises the good completion's logps
    assert (logps.grad[1][tensor(MASK)[1] > 0] > 0).all()
    assert (logps.grad[:, 3][tensor(MASK)[:, 3] == 0] == 0).all()  # padding gets no gradient


def test_cispo_and_sequence_level_clip_fractions() -> None:
    """The record's clip_fraction with rl.objective = "cispo" is the share of completion tokens whose
    ratio weight was capped, whatever the advantage's sign; with importance_level = "sequence" every
    token of a completion has its ratio exp(mean over the completion of logp - old), clipped as PPO
    clips. Catches a CISPO fraction counted by PPO's sign rule (capped tokens of negative advantage
    missed) and a sequence-level fraction counted from the tokens' own ratios."""
    advantages = reference_advantages(REWARDS, 3, True, 1e-4)
    cap, eps = 1.06, 0.04  # close to 1: some tokens and some completions pass them, not the same ones

    def fraction(objective: str, level: str) -> float:
        return grpo_loss(
            tensor(LOGPS),
            tensor(OLD_LOGPS),
            tensor(advantages),
            tensor(MASK),
            eps_low=eps,
            eps_high=eps,
            aggregation="token_mean",
            max_completion_tokens=MAX_TOKENS,
            objective=objective,  # type: ignore[arg-type]
            cispo_cap=cap,
            importance_level=level,  # type: ignore[arg-type]
        ).clip_fraction.item()

    count = sum(map(sum, MASK))
    capped = by_sign = capped_sequences = clipped_sequences = 0
    for i, adv in enumerate(advantages):
        on = [j for j in range(MAX_TOKENS) if MASK[i][j]]
        for j in on:
            ratio = math.exp(LOGPS[i][j] - OLD_LOGPS[i][j])
            capped += ratio > cap
            by_sign += ratio > cap and adv > 0
        sequence_ratio = math.exp(sum(LOGPS[i][j] - OLD_LOGPS[i][j] for j in on) / len(on))
        capped_sequences += len(on) * (sequence_ratio > cap)
        clipped_sequences += len(on) * (
            (sequence_ratio < 1 - eps and adv < 0) or (sequence_ratio > 1 + eps and adv > 0)
        )
    assert capped > by_sign > 0 and capped_sequences > 0 and clipped_sequences > 0, (
        "the example must tell the rules apart"
    )
    assert fraction("cispo", "token") == pytest.approx(capped / count, rel=1e-12)
    assert fraction("cispo", "sequence") == pytest.approx(capped_sequences / count, rel=1e-12)
    assert fraction("clipped", "sequence") == pytest.approx(clipped_sequences / count, rel=1e-12)
    # Negative controls: each level's count differs from the other level's on this example.
    assert fraction("clipped", "token") != pytest.approx(clipped_sequences / count, rel=1e-6)
    assert fraction("cispo", "token") != pytest.approx(capped_sequences / count, rel=1e-6)
