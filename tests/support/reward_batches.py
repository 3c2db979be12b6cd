"""Rollout batches for reward tests: completions with their records, as the GRPO task hands them over."""

from __future__ import annotations

from titan_tpu.tasks.grpo.rewards import Completions


def batch_of(completions: list[str], references: list[str]) -> Completions:
    """One completion per reference, each with a record {"prompt", "answer"} from line i of data.jsonl."""
    return Completions(
        prompts=[f"question {i}" for i in range(len(completions))],
        texts=list(completions),
        records=[{"prompt": f"question {i}", "answer": r} for i, r in enumerate(references)],
        places=[f"data.jsonl:{i + 1}" for i in range(len(completions))],
    )
