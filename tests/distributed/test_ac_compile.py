"""Activation checkpointing and per-block torch.compile change nothing numerically (one process):
same loss and gradients as the plain model, from the same sharding-invariant init. The MoE model,
whose blocks cannot be traced whole, compiles their parts and matches too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titan_tpu.config import ConfigError, load_config
from titan_tpu.distributed.compile import resolve_backend
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.distributed.sharded_init import canonical_name
from titan_tpu.models.qwen3.moe import GroupedExperts
from titan_tpu.models.registry import get_model_spec

SEQ = 32


def build(*overrides: str, config_name: str = "llama3_debug") -> nn.Module:
    config = load_config(config_name, [f"--training.seq_len={SEQ}", "--training.dtype=float32", *overrides])
    spec = get_model_spec(config.model.name)
    args = spec.flavor(config.model.flavor)
    with torch.device("meta"):
        model = spec.model_cls(args)
    ctx = ParallelContext(ParallelDims(1, 1, 1, 1, 1))
    return parallelize_model(model, None, ctx, config, torch.device("cpu"), torch.float32)


def loss_and_grads(model: nn.Module, name: str = "llama3", steps: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the last of `steps` batches (several batches: routing, hence the
    experts' run lengths, change from one to the next, as they do in training)."""
    for step in range(steps):
        model.zero_grad()
        tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(step))
        output = model(tokens[:, :-1])
        loss = get_model_spec(name).loss_fn(output, tokens[:, 1:])
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


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_moe_compiles_its_traceable_parts_and_matches_eager(ac: str) -> None:
    """qwen3_moe debug: routing is data-dependent, so the blocks compile their norms, attention,
    router and expert matmuls (the model's `compile_children`), not the whole block."""
    ref_loss, ref_grads = loss_and_grads(build(config_name="qwen3_moe_debug"), "qwen3_moe", steps=3)
    torch._dynamo.reset()
    model = build(
        "--compile.enable=true",
        "--compile.backend=aot_eager",
        f"--activation_checkpoint.mode={ac}",
        "--activation_checkpoint.selective_option=op",
        config_name="qwen3_moe_debug",
    )
    compiled = sorted(
        canonical_name(name).split(".", 2)[-1]
        for name, module in model.named_modules()
        if name.startswith("layers.0.") and isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
    )
    assert compiled == ["attention", "attention_norm", "feed_forward.experts.swiglu", "feed_forward.router", "ffn_norm"]
    loss, grads = loss_and_grads(model, "qwen3_moe", steps=3)
    print(
        f"\nMoE compile (aot_eager, ac {ac}) vs eager: loss {loss:.6f} vs {ref_loss:.6f}, max grad diff "
        f"{max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads):.1e}"
    )
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("impl, dtype", [("padded_bmm", torch.float32), ("grouped_mm", torch.bfloat16)])
def test_compiled_expert_matmuls_match_eager(impl: str, dtype: torch.dtype) -> None:
    """The experts' compiled part (`swiglu`) over changing run lengths, empty runs included, for
    both batched implementations (grouped_mm is the GPU bf16 path)."""
    torch.manual_seed(0)
    eager = GroupedExperts(32, 48, 4, impl)
    eager.init_weights(0.02)
    eager = eager.to(dtype)
    compiled = copy.deepcopy(eager)
    compiled.swiglu = torch.compile(compiled.swiglu, backend="aot_eager", fullgraph=True)
    for runs in ([3, 0, 5, 8], [1, 2, 3, 4], [16, 0, 0, 16]):
        counts = torch.tensor(runs)
        x = torch.randn(int(counts.sum()), 32, dtype=dtype, requires_grad=True)
        outs = [module(x, counts) for module in (eager, compiled)]
        grads = [
            torch.autograd.grad(out.float().square().sum(), [x, module.w1, module.w2])
            for out, module in zip(outs, (eager, compiled))
        ]
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        for got, want in zip(*grads[::-1]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_backend_lookup() -> None:
    assert resolve_backend("auto", "cpu") == "inductor"
    assert resolve_backend("aot_eager", "cpu") == "aot_eager"
    with pytest.raises(ConfigError, match=r"compile.backend: 'nonsense' is not a torch.compile backend"):
        resolve_backend("nonsense", "cpu")
