"""Our FLUX.1 transformer against diffusers' FluxTransformer2DModel with the same (random) weights,
mapped through the state-dict adapter the checkpoint layer uses; parameter counts of flux-dev; export
to a diffusers folder and reload with diffusers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

from tests.support.flux_reference import (
    diffusers_model,
    inputs,
    random_diffusers_model,
    randomize,
    run_diffusers,
    run_ours,
)
from titan_tpu.models.flux.args import FLUX_FLAVORS, FluxArgs
from titan_tpu.models.flux.flops import flux_param_count
from titan_tpu.models.flux.model import FluxModel
from titan_tpu.models.flux.state_dict_adapter import FLUX_STATE_DICT_ADAPTER as ADAPTER

# Small but with every axis exercised: 3-axis rope with unequal axes, several heads, both block kinds.
ARGS = FluxArgs(
    in_channels=16,
    dim=96,
    n_heads=3,
    depth_double=2,
    depth_single=2,
    context_dim=40,
    pooled_dim=24,
    axes_dim=(8, 12, 12),
)
HEIGHT, WIDTH, TEXT_LEN, BATCH = 4, 6, 7, 2


def matched_pair(guidance: bool) -> tuple[FluxTransformer2DModel, FluxModel, dict[str, torch.Tensor | None]]:
    """A randomised diffusers model, ours with its weights through the adapter, and inputs."""
    args = dataclasses.replace(ARGS, guidance_embed=guidance)
    reference = random_diffusers_model(args)
    with torch.device("meta"):
        ours = FluxModel(args)
    ours.to_empty(device="cpu")
    ours.load_state_dict(ADAPTER.from_hf(reference.state_dict()), strict=True)
    return reference, ours.eval(), inputs(args, HEIGHT, WIDTH, TEXT_LEN, BATCH)


@pytest.mark.parametrize("guidance", [False, True], ids=["no-guidance", "guidance"])
def test_output_matches_diffusers(guidance: bool) -> None:
    """Catches any wrong name mapping, modulation chunk order, rope layout or axis order, text/image
    order in the joint sequence, timestep scaling, or GELU flavour."""
    reference, ours, x = matched_pair(guidance)
    expected = run_diffusers(reference, x)
    with torch.no_grad():
        actual = run_ours(ours, x)
    diff = (actual - expected).abs().max().item()
    print(f"guidance={guidance} max|out|={expected.abs().max().item():.3f} max|diff|={diff:.2e}")
    assert actual.shape == expected.shape == (BATCH, HEIGHT * WIDTH, ARGS.in_channels)
    assert diff <= 1e-4

    # Negative control: q and k of one single-stream block swapped must be caught at this tolerance.
    with torch.no_grad():
        attn = ours.single_blocks[1].attn
        q = attn.wq.weight.clone()
        attn.wq.weight.copy_(attn.wk.weight)
        attn.wk.weight.copy_(q)
        broken = (run_ours(ours, x) - expected).abs().max().item()
    assert broken > 1e-2, f"a swapped weight went unnoticed (diff {broken})"


def test_guidance_changes_output() -> None:
    """The guidance input must matter for flux-dev-shaped models (catches an embedder left unused)."""
    _, ours, x = matched_pair(guidance=True)
    with torch.no_grad():
        base = run_ours(ours, x)
        x["guidance"] = x["guidance"] + 2.0
        assert (run_ours(ours, x) - base).abs().max().item() > 1e-3


def test_flux_dev_param_count_matches_diffusers() -> None:
    """Both built on meta: catches a missing or extra tensor, or a wrong width anywhere."""
    args = FLUX_FLAVORS["flux-dev"]
    with torch.device("meta"):
        ours = FluxModel(args)
        theirs = diffusers_model(args)
    ours_count = sum(p.numel() for p in ours.parameters())
    theirs_count = sum(p.numel() for p in theirs.parameters())
    print(f"flux-dev parameters: ours {ours_count:,}, diffusers {theirs_count:,}")
    assert abs(ours_count - theirs_count) <= 0.005 * theirs_count
    assert ours_count == flux_param_count(args)
    assert 11.8e9 < ours_count < 12.0e9
    assert set(ADAPTER.to_hf(dict(ours.state_dict())).keys()) == set(theirs.state_dict().keys())


def test_export_reloads_in_diffusers(tmp_path: Path) -> None:
    """Through the checkpoint layer's exporter: config.json + safetensors that diffusers loads into the
    same function. Catches an export config that builds a different model, or names diffusers ignores
    (from_pretrained would leave them at their init and the outputs would differ)."""
    from titan_tpu.checkpoint.hf_export import export_model_to_hf

    torch.manual_seed(1)
    args = dataclasses.replace(ARGS, guidance_embed=True)
    with torch.device("meta"):
        ours = FluxModel(args)
    ours.to_empty(device="cpu")
    randomize(ours)
    ours.eval()
    out = export_model_to_hf(ours, tmp_path / "export", ADAPTER, args, dtype="float32")
    assert out is not None
    # diffusers' own file names and no "dtype" key (diffusers passes it to __init__, which fails).
    assert (out / f"{ADAPTER.weights_stem}.safetensors").is_file()
    assert "dtype" not in json.loads((out / "config.json").read_text())
    reloaded = FluxTransformer2DModel.from_pretrained(out).eval()
    x = inputs(args, HEIGHT, WIDTH, TEXT_LEN, BATCH, seed=3)
    with torch.no_grad():
        diff = (run_diffusers(reloaded, x) - run_ours(ours, x)).abs().max().item()
    print(f"export -> diffusers reload: max|diff|={diff:.2e}")
    assert diff <= 1e-5
