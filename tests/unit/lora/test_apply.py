"""LoRA swapped into a model built on meta (titan_tpu/lora/apply.py), initialised by the run's
layout-invariant init (titan_tpu/distributed/sharded_init.py), then trained by the run's optimizer
(titan_tpu/optim.py): the adapted model starts as the base, bit for bit, and only the adapters learn."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.support.lora_models import adapter_parameter_names
from titan_tpu.config.sections import LoRAConfig, OptimizerConfig
from titan_tpu.distributed.parallelize import block_containers
from titan_tpu.distributed.sharded_init import init_weights
from titan_tpu.lora.apply import apply_lora
from titan_tpu.models.common.lora import LoRALinear, lora_layers
from titan_tpu.models.registry import get_model_spec
from titan_tpu.optim import adamw_state_bytes, build_optimizer
from titan_tpu.training.run_report import count_parameters

LORA = LoRAConfig(enable=True, rank=4, alpha=8.0)


def build(lora: LoRAConfig | None, seed: int = 0) -> nn.Module:
    """A 2-layer debug Qwen 3 on meta (LoRA swapped in when given), materialised and initialised."""
    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavors["debug"], n_layers=2, max_seq_len=32)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if lora is not None:
        apply_lora(model, lora, block_containers(model), "qwen3 debug")
    model.to_empty(device="cpu")
    init_weights(model, seed, buffer_device=torch.device("cpu"))
    return model


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def test_step_zero_logits_are_the_base_models_exactly(one_thread: None, tokens: torch.Tensor) -> None:
    """B = 0 at the start: the adapted model computes the base model (same seed, same base weights by
    name) to the last bit. Negative control: with B != 0 the logits move. Catches an init that draws
    B (or draws the base differently because the adapters were swapped in), and an adapter term that
    is not zero when B is."""
    base, adapted = build(None), build(LORA)
    for name, tensor in base.state_dict().items():
        assert torch.equal(tensor, adapted.state_dict()[name]), name
    layers = dict(lora_layers(adapted))
    assert len(layers) == 14 and all(isinstance(layer, LoRALinear) for layer in layers.values())
    for layer in layers.values():
        assert torch.count_nonzero(layer.lora_B) == 0 and torch.count_nonzero(layer.lora_A) == layer.lora_A.numel()
    with torch.no_grad():
        assert torch.equal(adapted(tokens), base(tokens))
        layers["layers.1.attention.wv"].lora_B.normal_(std=0.02)
        assert not torch.allclose(adapted(tokens), base(tokens), atol=1e-4)


def test_the_adapters_are_drawn_the_same_on_every_build_and_by_seed(one_thread: None) -> None:
    """A is drawn by its own name from the run's seed: the same model twice, another seed differs."""
    first, again, other = (dict(build(LORA, seed).named_parameters()) for seed in (0, 0, 1))
    name = "layers.0.feed_forward.w2.lora_A"
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], other[name])
    # PEFT's Kaiming-uniform bound (a = sqrt(5)): 1 / sqrt(fan_in).
    assert float(first[name].detach().abs().max()) <= first[name].shape[1] ** -0.5


def test_only_the_adapters_are_trained(one_thread: None, tokens: torch.Tensor) -> None:
    """Gradients and AdamW state exist for lora_A / lora_B only, all in the decayed group (2-D, as PEFT
    and TRL decay them); the base does not move. Catches a frozen weight left trainable (by the swap or
    by a tensor-parallel style that re-wraps it) and optimizer state for the base."""
    model = build(LORA)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == set(adapter_parameter_names(model))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    assert [len(group["params"]) for group in optimizer.param_groups] == [len(trained)]  # no empty group
    for _ in range(2):  # the second step moves A too (its gradient is zero while B is)
        model(tokens).float().logsumexp(-1).mean().backward()
        for name, param in model.named_parameters():
            assert (param.grad is not None) == (name in trained), name
        optimizer.step()
        optimizer.zero_grad()
    names = {id(p): name for name, p in model.named_parameters()}
    assert {names[id(p)] for p in optimizer.state} == trained
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) != (name in trained), name
    # The start-up line's counts: the adapters trained, the whole model the base and them.
    adapters = count_parameters(model, trained_only=True)
    assert adapters == sum(model.get_parameter(name).numel() for name in trained)
    assert count_parameters(model) == adapters + count_parameters(build(None))
    # Two moments of every trained element (float32) and a step count per tensor.
    assert adamw_state_bytes([p for p in model.parameters() if p.requires_grad]) == 8 * adapters + 4 * 28


def test_rollouts_of_an_adapted_model_decode_through_its_modules(one_thread: None) -> None:
    """The builtin sampler's fused step snapshots the projections' weights and would sample from the
    base, adapters left out: it must decline an adapted model (its modules then decode). Negative
    control: the plain model gets the fused step."""
    from titan_tpu.models.common.decode_step import FusedDecoder

    assert FusedDecoder.of(build(None)) is not None
    assert FusedDecoder.of(build(LORA)) is None
