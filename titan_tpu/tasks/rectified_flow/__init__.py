"""Rectified-flow image training (FLUX.1): the task, generated and local image-caption data, frozen
encoders and the Euler sampler. Its `[flux]` section lives in titan_tpu/config/task_sections.py; the
rest loads when a run asks for the task."""
