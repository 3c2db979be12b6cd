"""The hf family under per-layer compile, activation checkpointing and gradient accumulation changes
nothing numerically (one process, fp32), as for the native families (tests/distributed/
test_ac_compile.py, tests/unit/training/test_trainer.py).

Bugs caught: transformers' decoder layers not found as the compile / checkpoint units (the type
checks), a compiled or recomputed layer that computes something else (a graph break that drops the
mask, a recompute with another rotary table), and accumulation that sums micro-batch means instead of
averaging them (the gradient norms then differ by the accumulation factor: the negative control).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titan_tpu.config import load_config
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.parallelize import block_containers, parallelize_model
from titan_tpu.models.registry import get_model_spec
from titan_tpu.training.trainer import Trainer

SEQ = 32
CONFIG = "hf_mistral_debug"


def build(*overrides: str) -> nn.Module:
    config = load_config(CONFIG, [f"--training.seq_len={SEQ}", "--training.dtype=float32", *overrides])
    spec = get_model_spec("hf")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(spec.args_for(config))
    return parallelize_model(
        model, None, ParallelContext(ParallelDims(1, 1, 1, 1, 1)), config, torch.device("cpu"), torch.float32
    )


def loss_and_grads(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 512, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loss = get_model_spec("hf").loss_fn(model(tokens[:, :-1]), tokens[:, 1:], -1)
    loss.backward()
    return float(loss.detach()), {
        name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", ""): p.grad
        for name, p in model.named_parameters()
    }


@pytest.fixture(scope="module")
def plain() -> tuple[float, dict[str, torch.Tensor]]:
    return loss_and_grads(build())


def layers(model: nn.Module) -> list[nn.Module]:
    return [layer for container in block_containers(model) for layer in container]


@pytest.mark.parametrize("compiled, mode", [(False, "full"), (True, "none"), (True, "full")])
def test_compiled_and_checkpointed_layers_match_eager(plain, compiled: bool, mode: str) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    model = build(
        f"--compile.enable={str(compiled).lower()}",
        "--compile.backend=aot_eager",
        f"--activation_checkpoint.mode={mode}",
    )
    units = layers(model)
    assert len(units) == 2
    if compiled:
        assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in units)
    if mode == "full":
        assert all(any(isinstance(m, CheckpointWrapper) for m in layer.modules()) for layer in units)
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = plain
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def train(tmp_path: Path, local: int, summed: bool = False) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """3 steps of 4 sequences in micro-batches of `local`: per-step losses and gradient norms, final
    weights. `summed` breaks the accumulation on purpose: each micro-batch's loss is scaled back up
    by the accumulation count, so the step's gradient is their sum, not their mean."""
    config = load_config(
        CONFIG,
        [
            f"--job.dump_folder={tmp_path / f'{local}{summed}'}",
            f"--training.seq_len={SEQ}",
            "--training.global_batch_size=4",
            f"--training.local_batch_size={local}",
            "--training.steps=3",
            "--metrics.log_freq=1",
            "--training.dtype=float32",
        ],
    )
    trainer = Trainer(config)
    assert trainer.grad_accum_steps == 4 // local
    if summed:
        mean_loss = trainer.task.loss_fn
        trainer.task.loss_fn = lambda *args: mean_loss(*args) * trainer.grad_accum_steps
    records = trainer.train()
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    return [r.loss for r in records], [r.grad_norm for r in records], state


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    big_losses, big_norms, big_state = train(tmp_path, 4)
    losses, norms, state = train(tmp_path, 1)
    assert losses == pytest.approx(big_losses, rel=1e-5)
    # The gradient norms, before clipping: AdamW and clipping would hide a wrongly scaled gradient
    # in the weights, the norms do not.
    assert norms == pytest.approx(big_norms, rel=1e-5)
    assert state.keys() == big_state.keys()
    for name, value in state.items():
        torch.testing.assert_close(value, big_state[name], rtol=1e-4, atol=1e-6, msg=name)


def test_summed_accumulation_is_caught(tmp_path: Path) -> None:
    """Negative control: micro-batch gradients summed instead of averaged fail the check above."""
    _, big_norms, _ = train(tmp_path, 4)
    _, norms, _ = train(tmp_path, 1, summed=True)
    assert norms[0] == pytest.approx(4 * big_norms[0], rel=1e-4)
    assert norms != pytest.approx(big_norms, rel=1e-5)
