"""The `[rl]` config section of the GRPO recipe (torch-free, so the config loader can import it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_tpu.config.sections import require, opt


@dataclass
class RLConfig:
    task: Literal["arithmetic"] = opt(
        "arithmetic", "Verifiable task: arithmetic = 'a+b=' prompts scored by exact match (+ format)."
    )
    group_size: int = opt(8, "Completions sampled per prompt (G); advantages are normalised within a group.")
    prompts_per_step: int = opt(
        8,
        "Prompts per rollout batch, over all data-parallel ranks; the batch's prompts_per_step x group_size "
        "completions are split into mini-batches of training.global_batch_size, one optimizer step each.",
    )
    updates_per_rollout: int = opt(1, "Passes over each rollout batch (PPO epochs); > 1 reuses the samples.")
    eps_low: float = opt(0.2, "Clip the importance ratio from below at 1 - eps_low.")
    eps_high: float = opt(0.2, "Clip the importance ratio from above at 1 + eps_high (DAPO uses 0.28).")
    beta: float = opt(
        0.0, "Weight of the k3 KL penalty against the frozen initial policy; 0 builds no reference model."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = opt(
        "token_mean",
        "token_mean: over all completion tokens of a mini-batch (DAPO); seq_mean_token_mean: per "
        "completion, then over completions (GRPO paper); seq_mean_token_sum_norm: token sums / "
        "max_new_tokens, then over completions (Dr. GRPO).",
    )
    scale_rewards: bool = opt(
        True, "Divide group-centred rewards by the group's std (GRPO); false keeps them centred only (Dr. GRPO)."
    )
    advantage_eps: float = opt(1e-4, "Added to the group std before dividing by it.")
    temperature: float = opt(1.0, "Sampling temperature of the rollouts (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling: keep the likeliest tokens whose mass reaches top_p.")
    max_new_tokens: int = opt(8, "Longest completion, in tokens; a completion also ends at the stop text.")
    stop_text: str = opt("\n", "Text whose token ends a completion (the tokenizer's eos always does).")
    format_reward_weight: float = opt(
        0.1, "Weight of the format reward (a finished, well-formed answer) added to exact match."
    )
    max_operand: int = opt(99, "arithmetic: operands are integers in [0, max_operand].")
    held_out_fraction: float = opt(0.05, "arithmetic: share of all problems kept out of training for evaluation.")
    eval_prompts: int = opt(
        256, "Held-out problems decoded greedily at each evaluation (metrics.eval_freq); 0 = all of them."
    )

    def validate(self) -> None:
        require(self.group_size >= 2, "rl.group_size", f"must be >= 2 (a group is its own baseline), got {self.group_size}")
        require(self.prompts_per_step >= 1, "rl.prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        require(self.updates_per_rollout >= 1, "rl.updates_per_rollout", f"must be >= 1, got {self.updates_per_rollout}")
        for key in ("eps_low", "eps_high"):
            value = getattr(self, key)
            require(0 < value < 10, f"rl.{key}", f"must be in (0, 10), got {value}")
        require(self.eps_low < 1, "rl.eps_low", f"must be < 1 (the lower clip 1 - eps_low stays > 0), got {self.eps_low}")
        require(self.beta >= 0, "rl.beta", f"must be >= 0, got {self.beta}")
        require(self.advantage_eps > 0, "rl.advantage_eps", f"must be > 0, got {self.advantage_eps}")
        require(self.temperature >= 0, "rl.temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "rl.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.max_new_tokens >= 1, "rl.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(bool(self.stop_text), "rl.stop_text", "must not be empty")
        require(self.max_operand >= 1, "rl.max_operand", f"must be >= 1, got {self.max_operand}")
        require(
            0 < self.held_out_fraction < 1, "rl.held_out_fraction", f"must be in (0, 1), got {self.held_out_fraction}"
        )
        require(self.eval_prompts >= 0, "rl.eval_prompts", f"must be >= 0, got {self.eval_prompts}")
