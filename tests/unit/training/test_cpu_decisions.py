"""Every kind of training step under both dtypes `auto` picks on a CPU, whatever this machine's own
CPU is: float32 (no native bf16) and bf16 (AVX512-BF16 or AMX). The attention kernel is measured at
start-up (titan_tpu/autotune/), so either dtype may get SDPA or the blocked kernel; here float32 runs
SDPA and bf16 the blocked kernel, forced, so that both paths run whatever the timings say. Tiny
shapes, so the bf16 decision stays quick on CPUs that emulate bf16.

Bugs caught: a crash that only the bf16 decision reaches (the blocked kernel's backward, handed a
float32 gradient by Qwen 3's QK-norm path under autocast, crashed every GRPO run on bf16 CPUs while
the suite passed on the CPUs it was written on); a bf16 step that runs but computes something else
than the float32 one (its gradients are compared, with a perturbed model as negative control); and
a forward of the model that escapes the run's precision (GRPO's sampling ran in float32 under a bf16
run, so the policy that sampled was not the one trained).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.cpu_kinds import DECISIONS
from tests.support.token_sum_reward import REWARDS
from titan_tpu.config.loader import load_config
from titan_tpu.models.common.decode_step import FusedDecoder
from titan_tpu.training.trainer import Trainer

# config -> overrides that make one step take well under a second in float32.
RUNS = {
    "llama3_debug": ["--model.overrides={ n_layers = 2 }", "--training.seq_len=64", "--training.global_batch_size=2"],
    "qwen3_debug": ["--model.overrides={ n_layers = 2 }", "--training.seq_len=64", "--training.global_batch_size=2"],
    "flux_debug": ["--training.global_batch_size=4", "--metrics.eval_freq=0"],
    "grpo_qwen3_debug": [
        "--model.overrides={ n_layers = 2 }",
        "--training.global_batch_size=8",
        "--rl.prompts_per_step=2",
        "--rl.group_size=4",
        "--rl.max_new_tokens=4",
        "--rl.max_operand=9",
        "--rl.eval_prompts=4",
        "--metrics.eval_freq=2",
        REWARDS,  # from random weights the arithmetic reward is always 0
    ],
}
EXPECTED = {"fp32": (torch.float32, "sdpa"), "bf16": (torch.bfloat16, "blocked:128")}
FORCED_ATTENTION = {"fp32": "--model.attention_block=0", "bf16": "--model.attention_block=128"}
# Cosine similarity of the first step's gradient, bf16 decision against float32, every parameter.
# Measured here: 0.99985 or more; a model with other initial weights (the negative control): below 0.
GRADIENT_COSINE = 0.99


def _trainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str, decision: str, *extra: str) -> Trainer:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: DECISIONS[decision])
    overrides = [
        *RUNS[config],
        FORCED_ATTENTION[decision],
        f"--job.dump_folder={tmp_path / decision}",
        "--metrics.log_freq=1",
        *extra,
    ]
    trainer = Trainer(load_config(config, overrides))
    dtype, kernel = EXPECTED[decision]
    assert trainer.compute_dtype == dtype
    if not config.startswith("flux"):
        assert trainer.model_args.attention.name == kernel
    return trainer


def _first_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    trainer.forward_backward()
    return {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def _cosines(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, the cosine similarity of two gradients. A gradient that is exactly zero in `b`
    (FLUX's zero-initialised output layers leave most of its first gradients at zero) must be zero
    in `a` too, and has no direction to compare."""
    assert a.keys() == b.keys()
    zero = {n for n in b if not b[n].any()}
    assert all(not a[n].any() for n in zero), sorted(n for n in zero if a[n].any())[:3]
    cosines = {
        n: float(torch.cosine_similarity(a[n].flatten().double(), b[n].flatten().double(), dim=0))
        for n in b
        if n not in zero
    }
    assert cosines
    return cosines


@pytest.mark.parametrize("config", ["llama3_debug", "qwen3_debug", "flux_debug"])
def test_bf16_decision_computes_the_float32_gradients(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str
) -> None:
    """The first step's gradients under both decisions (same seed, same batch) point the same way,
    every parameter; then each trains three steps with finite, changing losses."""
    gradients = {}
    for decision in DECISIONS:
        trainer = _trainer(monkeypatch, tmp_path, config, decision, "--training.steps=3")
        gradients[decision] = _first_gradients(trainer)
        trainer.optimizer.zero_grad(set_to_none=True)
        records = trainer.train()
        trainer.close()
        assert all(math.isfinite(r.loss) and r.grad_norm > 0 for r in records)
    cosines = _cosines(gradients["bf16"], gradients["fp32"])
    assert min(cosines.values()) > GRADIENT_COSINE, sorted(cosines.items(), key=lambda kv: kv[1])[:3]

    # Negative control: gradients of a model with other initial weights are refused at this bound.
    other = _trainer(monkeypatch, tmp_path / "other", config, "fp32", "--training.seed=1")
    refused = _cosines(gradients["bf16"], _first_gradients(other))
    other.close()
    assert min(refused.values()) < GRADIENT_COSINE


@pytest.mark.parametrize("decision", list(DECISIONS))
def test_grpo_runs_every_forward_in_the_run_precision(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, decision: str
) -> None:
    """Two GRPO steps (a rollout, its two optimizer steps, a held-out evaluation) under the decision:
    they run, the gradient is not zero, and every forward of the policy (sampling, rollout
    log-probabilities, training, evaluation) runs in the run's precision."""
    trainer = _trainer(monkeypatch, tmp_path, "grpo_qwen3_debug", decision, "--training.steps=2")
    autocast_seen: list[bool] = []

    def record(module: nn.Module, args: tuple) -> None:
        autocast_seen.append(torch.is_autocast_enabled("cpu"))

    trainer.model.register_forward_pre_hook(record)
    # The sampler's decode steps run through the fused step (titan_tpu/models/common/decode_step.py), not the
    # model's forward: they are forwards of the policy too.
    fused_step = FusedDecoder.step

    def recorded_step(self: FusedDecoder, *args: object, **kwargs: object) -> torch.Tensor:
        autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return fused_step(self, *args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "step", recorded_step)
    records = trainer.train()
    trainer.close()
    assert [r.step for r in records] == [1, 2]
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) for r in records)
    assert records[0].grad_norm > 0
    assert "heldout_accuracy" in records[-1].extras
    # One rollout (a prefill and up to 3 decode steps), 2 training forwards, the evaluation.
    assert len(autocast_seen) >= 6
    assert set(autocast_seen) == {decision == "bf16"}
