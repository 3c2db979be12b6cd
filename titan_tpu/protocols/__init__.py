"""The interfaces the engine and the model families share, each defined once, at the bottom.

A model family implements `ModelSpec` (model_spec.py) with its `StateDictAdapter`
(state_dict_adapter.py), its measured kernels as `Tunable`s (tunable.py), its attention as an
`AttentionKernel` (attention.py) and what the planner asks of it (planning.py); an engine that
samples implements `RolloutEngine` (rollout.py). These modules import torch and the configuration's
error and value helpers, nothing else of titan_tpu, so the trainer, the checkpoint layer, the
planner, the kernel choice and the tasks depend on them and never on a model family. Import each name
from its module.
"""
