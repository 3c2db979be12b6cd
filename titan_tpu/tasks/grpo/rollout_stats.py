"""What GRPO counts between two records (rollouts, rewards, lengths, times, the engine/trainer
mismatch) and the per-rollout metrics the engine path adds: sums here, means in
`GRPOTask.step_metrics`."""

from __future__ import annotations

from typing import Any

import torch

from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.rollout import MicroBatch

# Summed over the rollouts and micro-batches since the last record.
STAT_KEYS = (
    "rollouts",
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
