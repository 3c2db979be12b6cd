"""Learning-rate schedule shape and optimizer parameter groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_tpu.config.sections import LRSchedulerConfig, OptimizerConfig
from titan_tpu.optim import adamw_options, build_lr_scheduler, build_optimizer, lr_multiplier


@pytest.mark.parametrize("decay_type", ["linear", "cosine"])
def test_warmup_then_decay_to_floor(decay_type: str) -> None:
    cfg = LRSchedulerConfig(warmup_steps=4, decay_type=decay_type, min_lr_ratio=0.1)
    factors = [lr_multiplier(step, 20, cfg) for step in range(21)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))  # non-increasing after warmup
    assert factors[20] == pytest.approx(0.1)
    midpoint = lr_multiplier(12, 20, cfg)
    assert midpoint == pytest.approx(0.55)  # both shapes pass through the middle at the midpoint


def test_constant_schedule_stays_at_peak() -> None:
    cfg = LRSchedulerConfig(warmup_steps=0, decay_type="constant", min_lr_ratio=0.0)
    assert {lr_multiplier(step, 10, cfg) for step in range(10)} == {1.0}


def test_scheduler_drives_optimizer_lr() -> None:
    model = nn.Linear(4, 4)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    scheduler = build_lr_scheduler(
        optimizer, LRSchedulerConfig(warmup_steps=1, decay_type="linear", min_lr_ratio=0.0), 3
    )
    seen = []
    for _ in range(3):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([5e-3, 1e-2, 5e-3])


def test_norms_and_biases_are_not_decayed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {p.ndim for p in decayed["params"]} == {2}
    assert len(plain["params"]) == 3  # linear bias, layernorm weight and bias
    assert isinstance(optimizer, torch.optim.AdamW)


def test_tpu_keeps_step_counts_on_the_device_and_cpu_does_not() -> None:
    """capturable=True on CPU parameters fails at the first step; on TPU it is TorchTPU's AdamW
    default (device-side step counts and bias corrections)."""
    cfg = OptimizerConfig(implementation="fused")
    assert adamw_options(cfg, "tpu") == {**adamw_options(cfg, "cpu"), "capturable": True}
    assert adamw_options(cfg, "cpu")["fused"] is True and "capturable" not in adamw_options(cfg, "cpu")
    model = nn.Linear(4, 4)
    optimizer = build_optimizer(model, cfg)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert optimizer.param_groups[0]["capturable"] is False
