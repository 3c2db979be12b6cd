"""FLUX.1 model: registry, init, block containers, parameter counts, FLOPs and the adapter's names."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.support.flux_reference import inputs, run_ours
from titan_tpu.distributed.parallelize import blocks
from titan_tpu.models.flux.args import FLUX_FLAVORS
from titan_tpu.models.flux.flops import flux_param_count, flux_training_flops_per_sample
from titan_tpu.models.flux.model import FluxModel
from titan_tpu.models.flux.state_dict_adapter import FLUX_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.models.registry import get_model_spec


def build(flavor: str = "debug", **changes: object) -> FluxModel:
    args = dataclasses.replace(FLUX_FLAVORS[flavor], **changes)
    with torch.device("meta"):
        model = FluxModel(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def sample(model: FluxModel, batch: int, height: int, width: int, text: int, grad: bool = False) -> dict:
    x = inputs(model.args, height, width, text, batch)
    if grad:
        for key in ("img", "txt", "pooled"):
            x[key].requires_grad_()
    return x


def test_registered_with_valid_flavors() -> None:
    spec = get_model_spec("flux")
    assert set(spec.flavors) == {"debug", "flux-schnell", "flux-dev"}
    assert spec.model_cls is FluxModel
    with pytest.raises(ValueError, match="did you mean 'flux-dev'"):
        spec.flavor("flux_dev")


def test_blocks_are_where_parallelize_finds_them() -> None:
    """Activation checkpointing, compile and FSDP find blocks by container name; a rename would
    silently leave FLUX unsharded."""
    with torch.device("meta"):
        model = FluxModel(FLUX_FLAVORS["flux-dev"])
    assert len(blocks(model)) == 19 + 38


def test_init_is_finite_and_starts_at_zero_velocity() -> None:
    """adaLN-Zero: the final projection starts at zero, every weight is finite and initialised
    (catches a parameter left with to_empty's garbage)."""
    model = build()
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
    out = run_ours(model, sample(model, 2, 4, 4, 5))
    assert out.shape == (2, 16, model.args.in_channels)
    assert out.abs().max().item() == 0.0
    assert model.img_in.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_guidance_is_required_when_embedded() -> None:
    model = build(guidance_embed=True)
    x = sample(model, 1, 2, 2, 3)
    x["guidance"] = None
    with pytest.raises(ValueError, match="guidance"):
        run_ours(model, x)


@pytest.mark.parametrize("flavor", sorted(FLUX_FLAVORS))
def test_param_count_formula(flavor: str) -> None:
    """The analytic count (used for reporting) equals the built model's, for every flavor."""
    with torch.device("meta"):
        model = FluxModel(FLUX_FLAVORS[flavor])
    assert flux_param_count(model.args) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("guidance", [False, True])
def test_flops_match_flop_counter(guidance: bool) -> None:
    """The documented convention equals torch's own count of forward + backward (inputs requiring
    grad, so every Linear computes both gradients). Catches a dropped stream, a per-token term counted
    per sample, or a wrong attention term; the second shape checks the L^2 scaling."""
    model = build(guidance_embed=guidance)
    args = model.args
    # The sinusoidal timestep / guidance features never require grad, so torch skips the input
    # gradient of those embedders' first Linear; the convention (6 per weight per row) counts it.
    skipped = (2 if guidance else 1) * 2 * args.time_freq_dim * args.dim
    batch = 3
    for height, width, text in ((4, 4, 6), (6, 8, 11)):
        # The math kernel runs attention as matmuls the counter sees (the fused CPU kernel it skips).
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            run_ours(model, sample(model, batch, height, width, text, grad=True)).sum().backward()
        measured = counter.get_total_flops() / batch
        expected = flux_training_flops_per_sample(args, height * width, text) - skipped
        assert measured == pytest.approx(expected, rel=1e-9), (height, width, text)


def test_flux_dev_flops_scale() -> None:
    """Hand count for a 1024x1024 image (4096 tokens) with 512 T5 tokens: a token passes through
    12 * dim^2 weights per block (one stream of a double block; the single blocks but their
    modulation), 57 blocks, so 6 * 57 * 12 * 3072^2 * 4608 = 1.79e14, plus attention
    12 * 4608^2 * 3072 * 57 = 4.46e13: about 2.2e14 per training sample."""
    flops = flux_training_flops_per_sample(FLUX_FLAVORS["flux-dev"], 4096, 512)
    assert flops == pytest.approx(2.24e14, rel=0.02)


def test_adapter_names_round_trip() -> None:
    """Every name maps to a distinct diffusers name and back (a duplicate would load one tensor twice)."""
    with torch.device("meta"):
        model = FluxModel(FLUX_FLAVORS["flux-dev"])
    ours = list(model.state_dict())
    theirs = [ADAPTER.hf_name(name) for name in ours]
    assert len(set(theirs)) == len(ours)
    assert [ADAPTER.our_name(name) for name in theirs] == ours
    with pytest.raises(KeyError, match="no counterpart"):
        ADAPTER.our_name("transformer_blocks.0.attn.to_qkv.weight")


def test_adapter_config_check() -> None:
    """A config.json written for one flavor passes for it and names every mismatch for another."""
    dev, schnell = FLUX_FLAVORS["flux-dev"], FLUX_FLAVORS["flux-schnell"]
    config = ADAPTER.to_hf_config(dev)
    assert ADAPTER.check_hf_config(config, dev) == []
    problems = ADAPTER.check_hf_config(config, schnell)
    assert problems == ["guidance_embeds is True, the flavor has False"]
    debug_problems = ADAPTER.check_hf_config(config, FLUX_FLAVORS["debug"])
    assert any(p.startswith("num_layers") for p in debug_problems)
    # diffusers omits keys at their defaults: a minimal flux-schnell config is complete.
    assert ADAPTER.check_hf_config({"_class_name": "FluxTransformer2DModel"}, schnell) == []
