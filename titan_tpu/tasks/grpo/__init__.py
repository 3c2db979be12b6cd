"""GRPO (group relative policy optimisation) for verifiable rewards: the task, the arithmetic problems
and their rewards, the KV-cached sampler, rollouts and the clipped objective. Its `[rl]` section lives
in titan_tpu/config/task_sections.py; the rest loads when a run asks for the task."""
