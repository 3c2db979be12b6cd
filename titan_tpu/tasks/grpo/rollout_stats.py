"""What GRPO counts between two records (rollouts, rewards, lengths, times, the engine/trainer
mismatch) and the per-rollout metrics the engine path adds: sums here, means in
`GRPOTask.step_metrics`.

Rewards, lengths and tied groups are counted over every completion sampled, the groups dynamic
sampling dropped included: they describe the policy (what it gets right on fresh prompts), and
their sampling was work done. The log-probability passes are the trained rows' only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.prompts import Prompt
from titan_tpu.tasks.grpo.rollout import MicroBatch
from titan_tpu.tasks.grpo.rollout_flops import ForwardCost, rollout_flops, scoring_flops
from titan_tpu.tasks.grpo.step_lines import tied_groups

if TYPE_CHECKING:
    from titan_tpu.tasks.grpo.draws import RolloutBatch

# Summed over the rollouts and micro-batches since the last record.
STAT_KEYS = (
    "rollouts",
    "rows_drawn",
    "reward_sum",
    "reward_std_sum",
    "tied_groups",
    "length_sum",
    "rollout_time",
    "rollout_flops",
    "micro_batches",
    "train_tokens",
    "train_time",
    "rollout_wait",
    "sample_time",
    "staleness_sum",
    "engine_kl_sum",
    "engine_tokens",
    "is_truncated",
)
# A multi-turn episode's (rl.env), summed over its rollout's rows: `<name>_per_episode` in the record.
EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors", "timeouts")


def add_rollout(
    stats: dict[str, float],
    batch: RolloutBatch,
    group_size: int,
    version: int,
    cost: ForwardCost,
    scoring_passes: int,
) -> None:
    """One rollout batch's sums: each draw's rewards, lengths, tied groups, sampling time and work;
    the staleness of its oldest draw's weights; the log-probability passes over the trained rows.
    The tables hold every rank's rows (prompts are the same everywhere): the work of the whole job,
    which step_metrics shares out per process as the trainer's TFLOP/s are."""
    stats["rollouts"] += 1
    for draw in batch.draws:
        table = draw.table
        rewards = table["reward"]
        stats["rows_drawn"] += rewards.numel()
        stats["reward_sum"] += float(rewards.sum())
        stats["reward_std_sum"] += float(rewards.view(-1, group_size).std(dim=1).sum())
        stats["tied_groups"] += float(tied_groups(rewards, group_size).sum())
        for name, column in table.items():
            if name in stats:  # each reward's part, and an episode's turns, tool calls, errors and timeouts
                stats[name] += float(column.sum())
        stats["length_sum"] += float(table["length"].sum())
        stats["sample_time"] += draw.sampled.seconds
        stats["rollout_wait"] += draw.waited
        # Every token after the prompt goes through the sampler (an episode's environment tokens too).
        stats["rollout_flops"] += rollout_flops(cost, _groups(draw.sampled.prompts, table, group_size), 0)
    stats["staleness_sum"] += version - min(draw.sampled.version for draw in batch.draws)
    if scoring_passes:  # the reference's and the trainer's log-probability passes, over the trained rows only
        stats["rollout_flops"] += scoring_flops(cost, _groups(batch.prompts, batch.table, group_size), scoring_passes)


def _groups(prompts: Sequence[Prompt], table: dict[str, torch.Tensor], group_size: int) -> list[tuple[int, list[int]]]:
    """(prompt length, every row's tokens after the prompt) of each group."""
    after_prompt = table["tokens"]
    return [
        (len(prompt.ids), [int(n) for n in after_prompt[k * group_size : (k + 1) * group_size]])
        for k, prompt in enumerate(prompts)
    ]


def fresh_stats(reward_names: list[str]) -> dict[str, float]:
    """Every sum at 0, each reward's own (`reward/NAME`) included."""
    return dict.fromkeys((*STAT_KEYS, *EPISODE_COUNTS, *(f"reward/{name}" for name in reward_names)), 0.0)


def add_engine_mismatch(stats: dict[str, float], batches: list[MicroBatch], is_cap: float) -> None:
    """The engine/trainer mismatch on the sampled tokens (k3 KL of the trainer from the engine,
    estimated on the engine's samples) and the share of tokens the correction truncated."""
    for batch in batches:
        if batch.trainer_logps is None or batch.sampled_logps is None:
            continue
        # In float64: float32 rounds exp(x) - 1 - x to 0 for the |x| < 1e-4 of two float32 runs.
        log_ratio = (batch.trainer_logps.double() - batch.sampled_logps.double()) * batch.mask
        k3 = torch.exp(log_ratio) - 1 - log_ratio
        stats["engine_kl_sum"] += float((k3 * batch.mask).sum())
        stats["engine_tokens"] += float(batch.mask.sum())
        if batch.is_weights is not None:
            truncated = (torch.exp(log_ratio) > is_cap) & (batch.mask > 0)
            stats["is_truncated"] += float(truncated.sum())


def rollout_metrics(
    stats: dict[str, float], reward_parts: list[str], episodes: bool, world_size: int, rl: RLConfig
) -> dict[str, float]:
    """Per completion sampled: rewards (each part's too), lengths and (multi-turn) an episode's counts;
    per group: reward std and the tied share; the sampler's rates; with dynamic sampling the prompts a
    rollout batch drew."""
    rows = stats["rows_drawn"]
    groups = rows / rl.group_size
    metrics = {
        "reward_mean": stats["reward_sum"] / rows,
        "reward_std": stats["reward_std_sum"] / groups,
        # Share of groups whose rewards were all equal: no learning signal from them (TRL's
        # frac_reward_zero_std); dynamic sampling drops them before training.
        "tied_groups": stats["tied_groups"] / groups,
        "completion_length": stats["length_sum"] / rows,
        "rollout_tokens_per_sec": stats["length_sum"] / stats["rollout_time"],
        # Per process, like the record's tflops; the trainer adds rollout_mfu beside it.
        "rollout_tflops": stats["rollout_flops"] / world_size / stats["rollout_time"] / 1e12,
    }
    metrics.update({f"reward/{name}": stats[f"reward/{name}"] / rows for name in reward_parts})
    if rl.dynamic_sampling:
        metrics["prompts_drawn"] = groups / stats["rollouts"]  # per rollout batch of rl.prompts_per_step
    if episodes:
        metrics.update({f"{name}_per_episode": stats[name] / rows for name in EPISODE_COUNTS})
    return metrics


def engine_metrics(stats: dict[str, float], rl: RLConfig, source: Any) -> dict[str, float]:
    """Per rollout: its staleness in optimizer steps, sampling and waiting seconds (rank 0's), and
    with the vLLM engine the engine/trainer KL, the truncated share and the last push's cost.
    `source`: the task's RolloutSource."""
    metrics = {
        "rollout/staleness": stats["staleness_sum"] / stats["rollouts"],
        "rollout/sample_seconds": stats["sample_time"] / stats["rollouts"],
    }
    if rl.max_staleness > 0:
        metrics["rollout/trainer_wait_seconds"] = stats["rollout_wait"] / stats["rollouts"]
        producer = source.producer
        if producer is not None:
            metrics["rollout/engine_idle_seconds"] = producer.idle_seconds
    if stats["engine_tokens"] > 0:
        metrics["rollout/engine_kl"] = stats["engine_kl_sum"] / stats["engine_tokens"]
        if rl.is_correction:
            metrics["rollout/is_truncated"] = stats["is_truncated"] / stats["engine_tokens"]
    sync = source.sync_record()
    if sync is not None and sync.version >= 0:
        metrics.update({"sync/seconds": sync.seconds, "sync/bytes": float(sync.bytes)})
    return metrics
