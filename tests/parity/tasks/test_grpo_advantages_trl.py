"""Our advantages (rl.advantage_estimator, rl.scale_rewards) and soft overlong punishment
(rl.overlong_buffer) against TRL's and verl's, in float64 within 1e-6.

- grpo with scale_rewards group / batch / none: TRL's GRPOTrainer, and rloo with scale_rewards none /
  batch: TRL's RLOOTrainer (normalize_advantages). Both compute advantages inline in their rollout
  method `_generate_and_score_completions`; it runs here as TRL wrote it, on a trainer made with
  `__new__` whose generation (`_generate`), reward functions (`_calculate_rewards`) and log-prob
  forward return fixed values, so everything from the rewards to the advantages is TRL's own code.
- reinforce_pp: verl's `compute_reinforce_plus_plus_outcome_advantage` (verl 0.9.1,
  verl/trainer/ppo/core_algos.py) with its `masked_whiten` (verl/utils/torch_functional.py),
  transcribed below: verl is not a dependency and its package does not import without ray (the
  transcription gave verl's own function, run from its source, to the last bit). The
  outcome reward sits on each response's last token (verl's reward managers put it there), gamma 1.
- overlong: TRL's `trl.rewards.get_soft_overlong_punishment` (penalty 1), and verl's DAPO reward
  manager's overlong term (verl/workers/reward_manager/dapo.py, with its penalty_factor), transcribed.

Each comparison has a negative control: the neighbouring option gives other numbers.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.trl_accelerator import OneProcessAccelerator

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_rloo = pytest.importorskip("trl.trainer.rloo_trainer")
trl_rewards = pytest.importorskip("trl.rewards")

from titan_tpu.tasks.grpo.advantages import rollout_advantages  # noqa: E402
from titan_tpu.tasks.grpo.overlong import overlong_penalties  # noqa: E402

GROUP, PROMPTS = 4, 5
EPS = 1e-4  # TRL's, fixed in both trainers; rl.advantage_eps's default


def rewards_with_a_tie(seed: int) -> torch.Tensor:
    """Rewards of PROMPTS groups, the third group tied (its advantages are 0 in GRPO and RLOO)."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 5, (GROUP * PROMPTS,), generator=gen).to(torch.float64) / 4
    rewards[2 * GROUP : 3 * GROUP] = 0.5
    return rewards


def _trainer(cls: Any, rewards: torch.Tensor, **values: object) -> Any:
    """A TRL trainer whose rollout method runs on fixed completions and rewards."""
    n = len(rewards)
    trainer = cls.__new__(cls)
    model = nn.Linear(1, 1)
    model.is_gradient_checkpointing = False  # type: ignore[assignment]
    trainer.__dict__.update(
        accelerator=OneProcessAccelerator(),
        model=model,
        _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        beta=0.0,
        num_generations=GROUP,
        reward_weights=torch.ones(1, dtype=torch.float64),
        reward_func_names=["reward"],
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
            "images": [],
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
        **values,
    )
    trainer._calculate_rewards = lambda *args, **kwargs: rewards[:, None].clone()
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (torch.zeros(n, 3), None, None)
    return trainer


def trl_grpo_advantages(rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    n = len(rewards)
    trainer = _trainer(
        trl_grpo.GRPOTrainer,
        rewards,
        environment_factories=None,
        tools=None,
        environments=None,
        args=SimpleNamespace(
            per_device_train_batch_size=n,
            gradient_checkpointing_kwargs=None,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
        ),
        num_iterations=1,
        use_vllm=False,
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards=scale_rewards,
    )
    # prompt ids, completion ids, tool mask, texts, sampler log-probs, extra fields, images, tool images
    trainer._generate = lambda prompts: ([[1, 2]] * n, [[3, 4, 5]] * n, None, ["c"] * n, None, {}, None, None)
    return trainer._generate_and_score_completions([{"prompt": "p"}] * n)["advantages"]


def trl_rloo_advantages(rewards: torch.Tensor, normalize: bool) -> torch.Tensor:
    n = len(rewards)
    trainer = _trainer(
        trl_rloo.RLOOTrainer,
        rewards,
        args=SimpleNamespace(per_device_train_batch_size=n, gradient_checkpointing_kwargs=None),
        reward_clip_range=None,
        normalize_advantages=normalize,
    )
    trainer._generate = lambda prompts: ([[1, 2]] * n, [[3, 4, 5]] * n, ["c"] * n)
    return trainer._generate_and_score_completions([{"prompt": "p"}] * n)["advantages"]


def ours(rewards: torch.Tensor, estimator: str, scaling: str, lengths: torch.Tensor | None = None) -> torch.Tensor:
    counts = torch.ones_like(rewards) if lengths is None else lengths
    return rollout_advantages(rewards, counts, GROUP, estimator, scaling, EPS)  # type: ignore[arg-type]


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_grpo_advantages_equal_trls(scaling: str) -> None:
    rewards = rewards_with_a_tie(seed=1)
    theirs = trl_grpo_advantages(rewards, scaling)
    assert theirs[2 * GROUP : 3 * GROUP].abs().max() == 0
    # Not bit-equal: TRL's nanstd forms Bessel's factor from integer counts divided in float32.
    assert torch.allclose(ours(rewards, "grpo", scaling), theirs, rtol=1e-6, atol=1e-12)
    for other in {"group", "batch", "none"} - {scaling}:
        assert not torch.allclose(ours(rewards, "grpo", other), theirs, rtol=1e-6)


@pytest.mark.parametrize(("scaling", "normalize"), [("none", False), ("batch", True)])
def test_rloo_advantages_equal_trls(scaling: str, normalize: bool) -> None:
    rewards = rewards_with_a_tie(seed=2)
    theirs = trl_rloo_advantages(rewards, normalize)
    assert torch.allclose(ours(rewards, "rloo", scaling), theirs, rtol=1e-6, atol=1e-12)
    # Negative controls: the group-mean baseline (GRPO's, G/(G-1) times smaller), and the other scaling.
    assert not torch.allclose(ours(rewards, "grpo", scaling), theirs, rtol=1e-6)
    assert not torch.allclose(ours(rewards, "rloo", "batch" if scaling == "none" else "none"), theirs, rtol=1e-6)


# ---------------------------------------------------------------------------- verl, transcribed


def verl_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = verl_masked_mean(values, mask)
    variance = verl_masked_mean((values - mean) ** 2, mask)
    variance = variance * mask.sum() / (mask.sum() - 1)  # unbiased=True
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_reinforce_plus_plus(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    returns = torch.zeros_like(token_level_rewards)
    running_return: torch.Tensor | float = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = new_running_return * response_mask[:, t]
        running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
    return verl_masked_whiten(returns, response_mask) * response_mask


def test_reinforce_pp_equals_verls() -> None:
    rewards = rewards_with_a_tie(seed=3)
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 9, (len(rewards),), generator=gen)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).to(torch.float64)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards  # the score on the last response token
    theirs = verl_reinforce_plus_plus(token_rewards, mask, gamma=1.0)
    mine = ours(rewards, "reinforce_pp", "none", lengths.to(torch.float64))
    assert torch.allclose(mine[:, None] * mask, theirs, rtol=1e-6, atol=1e-12)
    # Negative controls: whitening per completion instead of per token (lengths ignored), and a
    # group baseline (verl's reinforce_plus_plus_baseline subtracts the group mean first).
    per_completion = ours(rewards, "reinforce_pp", "none")
    assert not torch.allclose(per_completion[:, None] * mask, theirs, rtol=1e-6)
    centred = rewards - rewards.view(-1, GROUP).mean(1).repeat_interleave(GROUP)
    with_baseline = ours(centred, "reinforce_pp", "none", lengths.to(torch.float64))
    assert not torch.allclose(with_baseline[:, None] * mask, theirs, rtol=1e-6)


# ---------------------------------------------------------------------------- overlong


@pytest.mark.parametrize(("max_tokens", "buffer"), [(16, 4), (16, 16), (9, 1)])
def test_overlong_penalty_equals_trls(max_tokens: int, buffer: int) -> None:
    lengths = list(range(1, max_tokens + 1))
    theirs = trl_rewards.get_soft_overlong_punishment(max_tokens, buffer)([[7] * n for n in lengths])
    mine = overlong_penalties([float(n) for n in lengths], max_tokens, buffer, penalty=1.0)
    assert mine == pytest.approx(theirs, rel=1e-12, abs=1e-12)
    assert any(v < 0 for v in theirs) and theirs[-1] == -1.0
    # Negative control: a buffer one token longer punishes other lengths.
    if buffer < max_tokens:
        assert overlong_penalties([float(n) for n in lengths], max_tokens, buffer + 1, 1.0) != pytest.approx(theirs)


def test_overlong_penalty_factor_equals_verls() -> None:
    max_tokens, buffer, factor = 12, 5, 0.5
    lengths = list(range(1, max_tokens + 1))
    # verl/workers/reward_manager/dapo.py: exceed_len = valid_response_length - (max_resp_len - buffer_len)
    theirs = [min(-(n - (max_tokens - buffer)) / buffer * factor, 0) for n in lengths]
    assert overlong_penalties([float(n) for n in lengths], max_tokens, buffer, factor) == pytest.approx(theirs)
    assert overlong_penalties([float(n) for n in lengths], max_tokens, buffer, 1.0) != pytest.approx(theirs)
