"""Activation checkpointing and per-block torch.compile change nothing numerically (one process):
same loss and gradients as the plain model, from the same sharding-invariant init."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titan_tpu.config import ConfigError, load_config
from titan_tpu.distributed.compile import resolve_backend
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.distributed.sharded_init import canonical_name

import models

SEQ = 32


def build(*overrides: str) -> nn.Module:
    config = load_config("llama3_debug", [f"--training.seq_len={SEQ}", "--training.dtype=float32", *overrides])
    spec = models.get_model_spec("llama3")
    args = spec.flavor("debug")
    with torch.device("meta"):
        model = spec.model_cls(args)
    ctx = ParallelContext(ParallelDims(1, 1, 1, 1, 1))
    return parallelize_model(model, None, ctx, config, torch.device("cpu"), "cpu", torch.float32)


def loss_and_grads(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = models.get_model_spec("llama3").loss_fn(logits, tokens[:, 1:])
    loss.backward()
    return float(loss.detach()), {canonical_name(n): p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def plain() -> tuple[float, dict[str, torch.Tensor]]:
    return loss_and_grads(build())


@pytest.mark.parametrize(
    "mode, option, wrapped",
    [("full", "1", 4), ("selective", "2", 2), ("selective", "op", 4)],
)
def test_activation_checkpointing_is_exact(plain, mode: str, option: str, wrapped: int) -> None:  # type: ignore[no-untyped-def]
    model = build(f"--activation_checkpoint.mode={mode}", f"--activation_checkpoint.selective_option={option}")
    assert sum(isinstance(m, CheckpointWrapper) for m in model.layers.values()) == wrapped
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = plain
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=name)


def test_compile_per_block_matches_eager(plain) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    model = build("--compile.enable=true", "--compile.backend=aot_eager", "--activation_checkpoint.mode=full")
    assert all(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.layers.values())
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = plain
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_backend_lookup() -> None:
    assert resolve_backend("auto", "cpu") == "inductor"
    assert resolve_backend("aot_eager", "cpu") == "aot_eager"
    with pytest.raises(ConfigError, match=r"compile.backend: 'nonsense' is not a torch.compile backend"):
        resolve_backend("nonsense", "cpu")
