"""Recipes: kinds of training built on top of the engine's public pieces (model registry, trainer seam,
parallelism, checkpoints). `grpo/` is group relative policy optimisation for verifiable rewards."""
