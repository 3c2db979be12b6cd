"""What a GRPO run says on the console: its prompts in the start-up line, a step line that fits a
terminal, why a step's loss is exactly 0, and one sampled completion at each evaluation.

A group whose completions all got the same reward has advantage 0 on every completion, so it adds
nothing to the loss or the gradient; when every group of a step's mini-batch is tied (common early,
when the policy never or always solves a problem) the loss is exactly 0 (with rl.beta = 0), which
reads like a bug unless the line says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from titan_tpu.config import TrainConfig
from titan_tpu.metrics.console import ConsoleView, SampleField, sample_lines
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.prompts import PromptSet

logger = logging.getLogger("titan_tpu")

# The handful of GRPO's values on its console line; metrics.jsonl keeps all of them.
SHOWN = (("reward_mean", "reward"), ("heldout_accuracy", "held-out acc"))
WITH_KL = (*SHOWN, ("kl", "kl"))


def tied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] rewards laid out group after group -> [N / group_size] bool: all of the group's equal."""
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def mini_batch_ties(tied: torch.Tensor, rows: int, global_batch: int, group_size: int) -> list[tuple[int, int]]:
    """(tied groups, groups) of each mini-batch: the `global_batch` rows of each in row order, and
    the groups they hold rows of (a group split between two mini-batches counts in both)."""
    ties = []
    for start in range(0, rows, global_batch):
        first, last = start // group_size, (start + global_batch - 1) // group_size
        ties.append((int(tied[first : last + 1].sum()), last - first + 1))
    return ties


def console_view(loss: float, beta: float, step_ties: tuple[int, int]) -> ConsoleView:
    """Reward, held-out accuracy and (with a KL penalty) KL on a brief line; the note when the
    step's loss is 0 because every group of its mini-batch was tied."""
    tied, groups = step_ties
    note = None
    if loss == 0.0 and groups > 0 and tied == groups:
        which = f"all {groups} groups" if groups > 1 else "its one group"
        note = (
            f"{which} tied (every completion of each group got the same reward, so every advantage is 0): "
            "no learning signal this step"
        )
    return ConsoleView(shown=WITH_KL if beta > 0 else SHOWN, brief=True, note=note)


def describe_prompts(config: TrainConfig, prompts: PromptSet, steps_per_rollout: int) -> str:
    """The prompt source and set sizes, a rollout's shape, and how much of the prompts the steps use."""
    rl, steps = config.section(RLConfig), config.training.steps
    if rl.task == "arithmetic":
        source = f"arithmetic problems (operands up to {rl.max_operand})"
    else:
        source = f"prompt records of {config.data.path}"
    rollouts = -(-steps // steps_per_rollout)
    used = rollouts * rl.prompts_per_step
    passes = used / len(prompts.train)
    share = f"{passes:.2f} passes" if passes >= 1 else f"{100 * passes:.2g}% of them"
    # Dynamic sampling draws more prompts for each group it drops, up to rl.max_draws times as many.
    at_least = "at least " if rl.dynamic_sampling else ""
    return (
        f"{source}: {len(prompts.train):,} to train on, {len(prompts.held_out):,} held out; {rl.prompts_per_step} "
        f"prompts x {rl.group_size} completions a rollout, {steps_per_rollout} steps each; {steps} steps = "
        f"{rollouts} rollouts, {at_least}{used:,} prompts ({at_least}{share})"
    )


@dataclass(frozen=True)
class RolloutSample:
    """One completion of a rollout, kept to be shown at the next evaluation."""

    prompt: str
    completion: str
    reward: float
    reference: str | None


def log_sample(step: int, sample: RolloutSample) -> None:
    fields: list[SampleField] = [("prompt", sample.prompt, "end"), ("completion", sample.completion, "start")]
    if sample.reference is not None:
        fields.append(("reference", sample.reference, "start"))
    title = f"step {step}: a completion of the latest rollout (reward {sample.reward:.4g}):"
    for line in sample_lines(title, fields):
        logger.info(line)
