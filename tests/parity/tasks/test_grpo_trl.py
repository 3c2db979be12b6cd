"""Our GRPO loss against TRL's `GRPOTrainer._compute_loss` on identical tensors, in float64.

TRL's loss method takes a model and a batch; it gets the policy's per-token log-probs from the model
through `_get_per_token_logps_and_entropies`. Here that method returns given log-probs, and the rest
of `_compute_loss` (ratio, clipping, k3 KL, aggregation) is TRL's own code. A trainer is not
constructed (that needs a Hugging Face model and dataset); the attributes `_compute_loss` reads are
set to the values of the configuration named in each case.

Pairs compared (TRL loss_type / scale_rewards -> ours):
- grpo / "group"  -> seq_mean_token_mean, advantages scaled by the group std
- dr_grpo / "none" -> seq_mean_token_sum_norm with max_completion_tokens = TRL's max_completion_length,
  advantages not scaled (the Dr. GRPO paper drops both the length and the std normalisation)
- dapo / "group"  -> token_mean; TRL divides by `num_items_in_batch` (completion tokens of the whole
  generation batch) / processes x accumulation steps / steps per generation; with one process, one
  micro-batch and one step per generation that is this batch's token count, our default normaliser.

Variants, with the same tensors: TRL's importance_sampling_level = "sequence" (GSPO) -> ours, with each
aggregation above; TRL's loss_type = "cispo" (its epsilon_high the cap on the ratio's weight, its
aggregation dapo's) -> rl.objective = "cispo" with token_mean, at both importance levels. The advantage
estimators, reward scalings and the overlong punishment: test_grpo_advantages_trl.py.

TRL computes advantages inside its rollout method (`_generate_and_score_completions`, which needs a
model, tokenizer and reward functions), so the reference advantages below are its formula written out
with TRL's own `nanstd` helper: (r - group mean) / (group nanstd + 1e-4), or r - group mean.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.support.trl_accelerator import OneProcessAccelerator

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

from titan_tpu.tasks.grpo.objective import group_advantages, grpo_loss  # noqa: E402

GROUP, PROMPTS, T = 4, 3, 7
EPS_LOW, EPS_HIGH = 0.2, 0.28
CASES = [
    ("grpo", True, "seq_mean_token_mean"),
    ("dr_grpo", False, "seq_mean_token_sum_norm"),
    ("dapo", True, "token_mean"),
]


def trl_loss(loss_type: str, beta: float, inputs: dict, logps: torch.Tensor, **trainer_values: object) -> torch.Tensor:
    trainer = trl_grpo.GRPOTrainer.__new__(trl_grpo.GRPOTrainer)
    values = dict(
        loss_type=loss_type,
        beta=beta,
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        importance_sampling_level="token",
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        accelerator=OneProcessAccelerator(),
        model=nn.Linear(1, 1),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    trainer.__dict__.update(values)
    trainer.__dict__.update(trainer_values)
    # The model's log-probs are the given tensor (entropies only feed TRL's metrics).
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    return trainer._compute_loss(trainer.model, inputs)


def trl_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    grouped = rewards.view(-1, GROUP)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(GROUP)
    std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(GROUP)
    return (rewards - mean) / (std + 1e-4) if scale else rewards - mean


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = GROUP * PROMPTS
    logps = -torch.rand(n, T, generator=gen, dtype=torch.float64) * 3
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    return {
        "logps": logps,
        "old": logps + 0.4 * torch.randn(n, T, generator=gen, dtype=torch.float64),
        "ref": logps + 0.3 * torch.randn(n, T, generator=gen, dtype=torch.float64),
        "rewards": torch.randint(0, 3, (n,), generator=gen).to(torch.float64) / 2,
        "mask": (torch.arange(T)[None, :] < lengths[:, None]).to(torch.int64),
    }


def trl_inputs(batch: dict[str, torch.Tensor], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """What TRL's rollout hands its `_compute_loss` for `batch`: two-token prompts, the completion mask,
    the advantages, the old and reference log-probs, and the batch's token count."""
    n = len(advantages)
    return {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.int64),
        "prompt_mask": torch.ones(n, 2, dtype=torch.int64),
        "completion_ids": torch.zeros(n, T, dtype=torch.int64),
        "completion_mask": batch["mask"],
        "advantages": advantages,
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": batch["mask"].sum().to(torch.float64),
    }


@pytest.mark.parametrize("loss_type,scale,aggregation", CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_equals_trl(loss_type: str, scale: bool, aggregation: str, beta: float) -> None:
    batch = make_batch(seed=len(loss_type) + int(beta * 100))
    ours_adv = group_advantages(batch["rewards"], GROUP, scale_by_std=scale, eps=1e-4)
    theirs_adv = trl_advantages(batch["rewards"], scale)
    # Not bit-equal: TRL's nanstd forms Bessel's factor count / (count - 1) from integer counts, which
    # torch divides in float32 (4/3 off by ~1e-8); ours is float64 throughout.
    assert torch.allclose(ours_adv, theirs_adv, rtol=1e-6, atol=1e-12)

    theirs_logps = batch["logps"].clone().requires_grad_(True)
    theirs = trl_loss(loss_type, beta, trl_inputs(batch, theirs_adv), theirs_logps)
    ours_logps = batch["logps"].clone().requires_grad_(True)
    ours = grpo_loss(
        ours_logps,
        batch["old"],
        ours_adv,
        batch["mask"],
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        aggregation=aggregation,
        max_completion_tokens=T,
        beta=beta,
        ref_logps=batch["ref"],  # type: ignore[arg-type]
    ).loss
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-12)
    # The gradients (what training uses) agree too.
    theirs.backward()
    ours.backward()
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, rtol=1e-6, atol=1e-12)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_type,scale,aggregation", CASES)
def test_mismatched_aggregation_misses_trl(loss_type: str, scale: bool, aggregation: str) -> None:
    """Negative control: each of our other aggregations gives a different number on the same batch, so
    the comparison above distinguishes them."""
    batch = make_batch(seed=7)
    adv = trl_advantages(batch["rewards"], scale)
    theirs = trl_loss(loss_type, 0.0, trl_inputs(batch, adv), batch["logps"]).item()
    for other in {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"} - {aggregation}:
        ours = grpo_loss(
            batch["logps"],
            batch["old"],
            adv,
            batch["mask"],
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            aggregation=other,
            max_completion_tokens=T,
        ).loss.item()  # type: ignore[arg-type]
        assert ours != pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("loss_type,scale,aggregation", CASES)
def test_importance_sampling_correction_equals_trls(loss_type: str, scale: bool, aggregation: str) -> None:
    """rl.is_correction against TRL's vllm_importance_sampling_correction (token_truncate, its default
    cap 3.0): the old log-probs are the trainer's, the engine's sampled ones only weigh each token by
    min(exp(trainer - engine), cap), and the weight multiplies the clipped term before the KL is
    added. The weights are TRL's formula written out (it forms them in its rollout method, which
    needs a model and vLLM); the loss and its gradient are TRL's own `_compute_loss`."""
    batch = make_batch(seed=11)
    gen = torch.Generator().manual_seed(5)
    engine = batch["old"] + 0.6 * torch.randn(batch["old"].shape, generator=gen, dtype=torch.float64)
    mask = batch["mask"]
    cap = 3.0
    theirs_weights = torch.clamp(torch.exp((batch["old"] - engine) * mask), max=cap)
    ours_weights = torch.exp(batch["old"] - engine).clamp(max=cap) * mask  # rollout.build_micro_batches
    assert (theirs_weights > 1).any() and (theirs_weights == cap).any()  # both sides of 1, some truncated
    adv = trl_advantages(batch["rewards"], scale)
    inputs = {**trl_inputs(batch, adv), "importance_sampling_ratio": theirs_weights}
    theirs_logps = batch["logps"].clone().requires_grad_(True)
    trainer_values = {"use_vllm": True, "vllm_importance_sampling_correction": True}
    theirs = trl_loss(loss_type, 0.04, inputs, theirs_logps, **trainer_values)
    ours_logps = batch["logps"].clone().requires_grad_(True)

    def ours_loss(weights: torch.Tensor | None) -> torch.Tensor:
        return grpo_loss(
            ours_logps,
            batch["old"],
            adv,
            mask,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            aggregation=aggregation,  # type: ignore[arg-type]
            max_completion_tokens=T,
            beta=0.04,
            ref_logps=batch["ref"],
            token_weights=weights,
        ).loss

    ours = ours_loss(ours_weights)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-12)
    theirs.backward()
    ours.backward()
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, rtol=1e-6, atol=1e-12)  # type: ignore[arg-type]
    # Negative control: without the weights the loss is another number.
    assert ours_loss(None).item() != pytest.approx(theirs.item(), rel=1e-6)


# GSPO and CISPO (rl.importance_sampling_level, rl.objective) against TRL's `importance_sampling_level` and
# `loss_type="cispo"`. CISPO's cap is TRL's epsilon_high; 1.2 here (ScaleRL uses 5) so that some tokens of
# make_batch's ratios pass it and the cap is compared too.
CISPO_CAP = 1.2
# TRL loss_type, TRL importance_sampling_level, our aggregation, our objective
VARIANTS = [
    ("grpo", "sequence", "seq_mean_token_mean", "clipped"),  # GSPO as its paper averages
    ("dapo", "sequence", "token_mean", "clipped"),
    ("dr_grpo", "sequence", "seq_mean_token_sum_norm", "clipped"),
    ("cispo", "token", "token_mean", "cispo"),  # CISPO as MiniMax-M1 and TRL
    ("cispo", "sequence", "token_mean", "cispo"),
]


def _ours(
    batch: dict[str, torch.Tensor],
    logps: torch.Tensor,
    advantages: torch.Tensor,
    aggregation: str,
    objective: str,
    level: str,
    beta: float,
    cap: float = CISPO_CAP,
) -> torch.Tensor:
    return grpo_loss(
        logps,
        batch["old"],
        advantages,
        batch["mask"],
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        aggregation=aggregation,  # type: ignore[arg-type]
        max_completion_tokens=T,
        beta=beta,
        ref_logps=batch["ref"],
        objective=objective,  # type: ignore[arg-type]
        cispo_cap=cap,
        importance_level=level,  # type: ignore[arg-type]
    ).loss


def _trl_variant(
    loss_type: str, level: str, beta: float, batch: dict[str, torch.Tensor], logps: torch.Tensor, adv: torch.Tensor
) -> torch.Tensor:
    epsilon_high = CISPO_CAP if loss_type == "cispo" else EPS_HIGH
    return trl_loss(
        loss_type, beta, trl_inputs(batch, adv), logps, importance_sampling_level=level, epsilon_high=epsilon_high
    )


@pytest.mark.parametrize("loss_type,level,aggregation,objective", VARIANTS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_and_cispo_equal_trl(loss_type: str, level: str, aggregation: str, objective: str, beta: float) -> None:
    batch = make_batch(seed=20 + len(loss_type) + int(beta * 100))
    adv = trl_advantages(batch["rewards"], scale=True)
    mask = batch["mask"].to(torch.float64)
    log_ratio = batch["logps"] - batch["old"]
    # The comparison must reach the clip: some ratios past it (the sequence's mean ratio for GSPO).
    if level == "sequence":
        ratio = torch.exp((log_ratio * mask).sum(1) / mask.sum(1))
    else:
        ratio = torch.exp(log_ratio)[mask > 0]
    assert (ratio > (CISPO_CAP if objective == "cispo" else 1 + EPS_HIGH)).any()
    theirs_logps = batch["logps"].clone().requires_grad_(True)
    theirs = _trl_variant(loss_type, level, beta, batch, theirs_logps, adv)
    ours_logps = batch["logps"].clone().requires_grad_(True)
    ours = _ours(batch, ours_logps, adv, aggregation, objective, level, beta)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-12)
    theirs.backward()
    ours.backward()
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, rtol=1e-6, atol=1e-12)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_type,level,aggregation,objective", VARIANTS)
def test_a_variant_left_out_misses_trl(loss_type: str, level: str, aggregation: str, objective: str) -> None:
    """Negative controls: the other importance level, the other objective, and CISPO without its cap
    each give another loss or gradient on the same batch, so the comparison above tells them apart."""
    batch = make_batch(seed=31)
    adv = trl_advantages(batch["rewards"], scale=True)
    theirs_logps = batch["logps"].clone().requires_grad_(True)
    theirs = _trl_variant(loss_type, level, 0.0, batch, theirs_logps, adv)
    theirs.backward()
    other_level = "token" if level == "sequence" else "sequence"
    other_objective = "clipped" if objective == "cispo" else "cispo"
    wrong = [(other_level, objective, CISPO_CAP), (level, other_objective, CISPO_CAP)]
    if objective == "cispo":
        wrong.append((level, objective, float("inf")))
    for wrong_level, wrong_objective, cap in wrong:
        ours_logps = batch["logps"].clone().requires_grad_(True)
        ours = _ours(batch, ours_logps, adv, aggregation, wrong_objective, wrong_level, 0.0, cap)
        ours.backward()
        assert ours.item() != pytest.approx(theirs.item(), rel=1e-6) or not torch.allclose(
            ours_logps.grad,  # type: ignore[arg-type]
            theirs_logps.grad,  # type: ignore[arg-type]
            rtol=1e-6,
        ), (wrong_level, wrong_objective, cap)
