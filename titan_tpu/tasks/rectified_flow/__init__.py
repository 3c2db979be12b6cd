"""Rectified-flow image training (FLUX.1): the task, its `[flux]` config section, generated and local
image-caption data, frozen encoders and the Euler sampler. Only `config` is imported by the config
loader; the rest loads when a run asks for the task."""
