"""GRPO (group relative policy optimisation) for verifiable rewards: the task, its `[rl]` section
(config.py), the arithmetic problems and their rewards, rollouts and the clipped objective. This door
loads nothing, so the config loader reads config.py without the rest."""
