"""When GRPO pushes the trainer's weights to its engine (titan_tpu/tasks/grpo/sampling.py), with an
engine that records the pushes instead of a server.

Bugs caught: rl.sync_every ignored (a push before every rollout, or none after the first), and a
held-out evaluation run on weights rl.sync_every left behind (it would report an older model's
accuracy as the current one's)."""

from __future__ import annotations

from typing import Any

from torch import nn

from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.sampling import RolloutSource


class PushRecorder:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def load_weights(self, policy: nn.Module, version: int) -> None:
        self.versions.append(version)


def source_with(engine: Any, sync_every: int) -> RolloutSource:
    source = RolloutSource(ctx=None, rl=RLConfig(engine="vllm", sync_every=sync_every), stream=None, rows=1)  # type: ignore[arg-type]
    source.rollout_engine = source.evaluation_engine = engine
    return source


def test_rollouts_push_every_sync_every_steps_and_evaluation_always_has_the_current_weights() -> None:
    engine, model = PushRecorder(), nn.Linear(1, 1)
    source = source_with(engine, sync_every=3)
    for version in range(7):  # the pushes before rollouts 0 to 6
        source._push(model, version)
    assert engine.versions == [0, 3, 6]
    source.evaluation(model, 8)  # 2 steps after the last push: pushed all the same
    assert engine.versions == [0, 3, 6, 8]
    source._push(model, 9)  # counted from the evaluation's push
    source._push(model, 11)
    assert engine.versions == [0, 3, 6, 8, 11]
