"""Shared by the FLUX tests: diffusers' FluxTransformer2DModel as the reference, inputs for both
models, and one call of each with those inputs."""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel

from titan_tpu.models.flux.args import FluxArgs
from titan_tpu.models.flux.model import FluxModel
from titan_tpu.models.flux.state_dict_adapter import FLUX_STATE_DICT_ADAPTER as ADAPTER


def diffusers_model(args: FluxArgs) -> FluxTransformer2DModel:
    """diffusers' transformer of the flavor's shape, at diffusers' own init."""
    return FluxTransformer2DModel(**{k: v for k, v in ADAPTER.to_hf_config(args).items() if not k.startswith("_")})


def randomize(model: torch.nn.Module) -> None:
    """Weights of O(1) effect everywhere (the default init leaves norms at 1 and some layers at 0),
    so a tensor loaded under the wrong name, or not at all, changes the output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)


def random_diffusers_model(args: FluxArgs, seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = diffusers_model(args).eval()
    randomize(model)
    return model


def inputs(
    args: FluxArgs, height: int, width: int, text_len: int, batch: int = 2, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    """A batch for a height x width grid of image tokens; guidance (1.0, 4.5, ...) for guidance flavors."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    # Text ids with a non-zero first axis, so a wrong axis order in the rope shows.
    txt_ids = torch.stack([torch.arange(text_len), torch.zeros(text_len), torch.zeros(text_len)], dim=-1).float()
    return {
        "img": torch.randn(batch, height * width, args.in_channels, generator=g),
        "img_ids": img_ids,
        "txt": torch.randn(batch, text_len, args.context_dim, generator=g),
        "txt_ids": txt_ids,
        "timesteps": torch.rand(batch, generator=g),
        "pooled": torch.randn(batch, args.pooled_dim, generator=g),
        "guidance": 1.0 + 3.5 * torch.arange(batch, dtype=torch.float32) if args.guidance_embed else None,
    }


@torch.no_grad()
def run_diffusers(model: FluxTransformer2DModel, x: dict[str, torch.Tensor | None]) -> torch.Tensor:
    return model(
        hidden_states=x["img"],
        encoder_hidden_states=x["txt"],
        pooled_projections=x["pooled"],
        timestep=x["timesteps"],
        img_ids=x["img_ids"],
        txt_ids=x["txt_ids"],
        guidance=x["guidance"],
        return_dict=False,
    )[0]


def run_ours(model: FluxModel | torch.nn.Module, x: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """Not under no_grad: the FLOP count test runs backward through it."""
    return model(x["img"], x["img_ids"], x["txt"], x["txt_ids"], x["timesteps"], x["pooled"], x["guidance"])
