"""Rectified-flow image training (FLUX.1): the task, its `[flux]` section (config.py), generated and
local image-caption data, frozen encoders and the Euler sampler. This door loads nothing, so the
config loader reads config.py without the rest."""
