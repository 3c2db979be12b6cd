"""Frozen encoders of the rectified-flow task: T5 (per-token text embeddings), CLIP (pooled text
vector) and an autoencoder (images <-> latents).

Each comes from a local folder when the user has the weights (transformers T5EncoderModel /
CLIPTextModel with their tokenizers, diffusers AutoencoderKL), else it is a tiny model built from a
config with seeded random weights (the same on every rank) and a byte-level tokenizer, so that runs
need no download. `identity` makes the latents the RGB pixels themselves (for tiny CPU runs whose
sample grids should be readable).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from titan_tpu.config.errors import ConfigError
from titan_tpu.tasks.rectified_flow.config import FluxConfig

PAD_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2
BYTE_VOCAB = 256 + BYTE_OFFSET


class ByteTokenizer:
    """UTF-8 bytes as ids (after pad 0 and eos 1), eos-terminated, padded to max_length."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    def __call__(self, texts: list[str]) -> torch.Tensor:
        ids = torch.full((len(texts), self.max_length), PAD_ID, dtype=torch.long)
        for row, text in enumerate(texts):
            tokens = [b + BYTE_OFFSET for b in text.encode("utf-8")][: self.max_length - 1] + [EOS_ID]
            ids[row, : len(tokens)] = torch.tensor(tokens)
        return ids


class HFTokenizer:
    """A transformers tokenizer from the encoder's folder, padded to max_length as FLUX.1 does."""

    def __init__(self, folder: str, max_length: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.max_length = max_length

    def __call__(self, texts: list[str]) -> torch.Tensor:
        encoded = self.tokenizer(
            texts, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        )
        return encoded["input_ids"]


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _seeded(seed: int, build: Callable[[], ModuleT]) -> ModuleT:
    """`build()` with the CPU generator seeded (the same random weights on every rank), restoring the
    run's RNG stream afterwards. Only the CPU generator is touched: torch.random.fork_rng and
    torch.manual_seed also reach the accelerator, which with torch_tpu installed and no chip starts a
    slow TPU discovery."""
    saved = torch.default_generator.get_state()
    torch.default_generator.manual_seed(seed)
    try:
        return build()
    finally:
        torch.default_generator.set_state(saved)


def _folder(value: str, key: str) -> str:
    if not Path(value).is_dir():
        raise ConfigError(f"flux.{key}: {value} is neither 'random' nor a folder")
    return value


class TextEncoders(nn.Module):
    """captions -> (T5 embeddings [B, t5_max_length, context_dim], CLIP pooled [B, pooled_dim])."""

    def __init__(
        self, config: FluxConfig, context_dim: int, pooled_dim: int, seed: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        if config.t5_encoder == "random":
            t5_config = T5Config(  # type: ignore[call-arg]  # transformers keeps keys its signature does not list
                vocab_size=BYTE_VOCAB,
                d_model=context_dim,
                d_kv=16,
                d_ff=2 * context_dim,
                num_layers=2,
                num_heads=4,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
                decoder_start_token_id=PAD_ID,
            )
            self.t5 = _seeded(seed, lambda: T5EncoderModel(t5_config))
            self.t5_tokenizer: Any = ByteTokenizer(config.t5_max_length)
        else:
            folder = _folder(config.t5_encoder, "t5_encoder")
            self.t5 = T5EncoderModel.from_pretrained(folder, dtype=dtype)
            self.t5_tokenizer = HFTokenizer(folder, config.t5_max_length)
        if config.clip_encoder == "random":
            clip_config = CLIPTextConfig(
                vocab_size=BYTE_VOCAB,
                hidden_size=pooled_dim,
                intermediate_size=2 * pooled_dim,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=config.clip_max_length,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
                bos_token_id=EOS_ID,
            )
            self.clip = _seeded(seed + 1, lambda: CLIPTextModel(clip_config))
            self.clip_tokenizer: Any = ByteTokenizer(config.clip_max_length)
        else:
            folder = _folder(config.clip_encoder, "clip_encoder")
            self.clip = CLIPTextModel.from_pretrained(folder, dtype=dtype)
            self.clip_tokenizer = HFTokenizer(folder, config.clip_max_length)
        for name, model, want in (("t5_encoder", self.t5, context_dim), ("clip_encoder", self.clip, pooled_dim)):
            width = model.config.d_model if name == "t5_encoder" else model.config.hidden_size
            if width != want:
                raise ConfigError(f"flux.{name}: its width is {width}, the model flavor expects {want}")
        self.requires_grad_(False).eval()

    @torch.no_grad()
    def forward(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.t5.parameters()).device
        t5 = self.t5(input_ids=self.t5_tokenizer(captions).to(device)).last_hidden_state
        pooled = self.clip(input_ids=self.clip_tokenizer(captions).to(device)).pooler_output
        return t5.float(), pooled.float()


class Autoencoder(nn.Module):
    """pixels [B, 3, S, S] in [-1, 1] <-> latents [B, C, S / downsample, S / downsample], normalised
    as FLUX.1 does: (mean - shift_factor) * scaling_factor. The encoder's mean is used (no sampling), so
    latents are a deterministic function of the image and can be cached."""

    def __init__(self, config: FluxConfig, latent_channels: int, seed: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL  # where the type checker finds the class

        self.vae: AutoencoderKL | None = None
        if config.autoencoder == "identity":
            channels, self.downsample, self.scale, self.shift = 3, 1, 1.0, 0.0
        else:
            if config.autoencoder == "random":
                self.vae = _seeded(
                    seed + 2,
                    lambda: AutoencoderKL(
                        in_channels=3,
                        out_channels=3,
                        latent_channels=latent_channels,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2,
                        block_out_channels=(32, 32),
                        layers_per_block=1,
                        norm_num_groups=8,
                        sample_size=config.image_size,
                    ),
                )
            else:
                self.vae = AutoencoderKL.from_pretrained(_folder(config.autoencoder, "autoencoder"), torch_dtype=dtype)
            vae_config = self.vae.config  # a FrozenDict, typed as the dict it is
            channels = vae_config["latent_channels"]
            self.downsample = 2 ** (len(vae_config["block_out_channels"]) - 1)
            self.scale = float(vae_config["scaling_factor"])
            self.shift = float(vae_config["shift_factor"] or 0.0)
        if channels != latent_channels:
            raise ConfigError(
                f"flux.autoencoder: its latents have {channels} channels, the model flavor packs "
                f"{latent_channels} (in_channels / 4)"
            )
        latent_size = config.image_size // self.downsample
        if latent_size % 2 or config.image_size % self.downsample:
            raise ConfigError(
                f"flux.image_size {config.image_size}: the latents ({config.image_size} / {self.downsample}) "
                "must have an even side for 2x2 packing"
            )
        self.latent_size = latent_size
        self.requires_grad_(False).eval()

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            return pixels.float()
        mean = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.mean
        return ((mean - self.shift) * self.scale).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            return latents.clamp(-1, 1)
        pixels = self.vae.decode((latents / self.scale + self.shift).to(self.vae.dtype)).sample
        return pixels.float().clamp(-1, 1)
