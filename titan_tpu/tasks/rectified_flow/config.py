"""The rectified-flow task's `[flux]` section: its data, encoders, flow-time distribution and sample
grid. Imports nothing but the configuration, so the loader reads it before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from titan_tpu.config.sections import opt, require

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig


@dataclass
class FluxConfig:
    dataset: Literal["generated", "folder", "webdataset"] = opt(
        "generated",
        "generated: coloured shapes at positions with captions (no download); folder: images with "
        "same-named .txt captions under flux.data_path; webdataset: .tar shards (glob in flux.data_path).",
    )
    data_path: str = opt("", "Folder of images + captions, or a glob of webdataset .tar shards.")
    generated_samples: int = opt(4096, "Size of the generated image-caption set.")
    image_size: int = opt(32, "Training images are centre-cropped and resized to this square size (pixels).")
    autoencoder: str = opt(
        "random",
        "identity (latents are the RGB pixels), random (tiny AutoencoderKL from config), or a local "
        "diffusers AutoencoderKL folder.",
    )
    t5_encoder: str = opt("random", "random (tiny T5 encoder from config) or a local T5EncoderModel folder.")
    clip_encoder: str = opt("random", "random (tiny CLIP text model from config) or a local CLIPTextModel folder.")
    t5_max_length: int = opt(32, "Text tokens per caption for T5 (FLUX.1: 512 dev, 256 schnell).")
    clip_max_length: int = opt(77, "Text tokens per caption for CLIP.")
    cache_encodings: bool = opt(
        False, "Encode each image and caption once and reuse the latents and text embeddings (memory)."
    )
    timestep_sampling: Literal["logit_normal", "uniform"] = opt(
        "logit_normal", "Distribution of the flow time t: sigmoid(N(mean, std)) or uniform."
    )
    logit_mean: float = opt(0.0, "Mean of the normal under the sigmoid (logit_normal).")
    logit_std: float = opt(1.0, "Std of the normal under the sigmoid (logit_normal).")
    time_shift: float = opt(
        1.0, "Shift the schedule towards noise: t -> s t / (1 + (s - 1) t); 1 leaves it (FLUX.1 uses ~3)."
    )
    caption_dropout: float = opt(
        0.1, "Probability of replacing a caption by the empty one (classifier-free guidance training)."
    )
    guidance: float = opt(3.5, "Guidance scale fed to guidance-embedding flavors (flux-dev) in training.")
    sample_prompts: str = opt(
        "a red circle at the top left|a blue square in the center|a green triangle at the bottom right"
        "|a yellow circle at the bottom left",
        "Prompts of the sample grid, separated by '|'.",
    )
    sample_steps: int = opt(20, "Euler steps of the sampler.")
    sample_cfg_scale: float = opt(3.0, "Classifier-free guidance scale of the sampler (1 = none).")
    samples_per_prompt: int = opt(2, "Images per prompt in the sample grid (one row per prompt).")

    def validate(self) -> None:
        if self.dataset != "generated":
            require(bool(self.data_path), "flux.data_path", f"is required when flux.dataset = '{self.dataset}'")
        require(self.generated_samples >= 1, "flux.generated_samples", "must be >= 1")
        require(
            self.image_size >= 8 and self.image_size % 8 == 0,
            "flux.image_size",
            f"must be a multiple of 8, at least 8, got {self.image_size}",
        )
        for key in ("autoencoder", "t5_encoder", "clip_encoder"):
            require(bool(getattr(self, key)), f"flux.{key}", "must not be empty")
        require(self.t5_max_length >= 1, "flux.t5_max_length", "must be >= 1")
        require(self.clip_max_length >= 2, "flux.clip_max_length", "must be >= 2")
        require(self.logit_std > 0, "flux.logit_std", f"must be > 0, got {self.logit_std}")
        require(self.time_shift > 0, "flux.time_shift", f"must be > 0, got {self.time_shift}")
        require(0 <= self.caption_dropout < 1, "flux.caption_dropout", f"must be in [0, 1), got {self.caption_dropout}")
        require(bool(self.prompts()), "flux.sample_prompts", "must hold at least one prompt")
        require(self.sample_steps >= 1, "flux.sample_steps", "must be >= 1")
        require(self.samples_per_prompt >= 1, "flux.samples_per_prompt", "must be >= 1")

    def check_with(self, config: TrainConfig) -> None:
        """[data] and [validation] are for text: images come from flux.dataset and flux.data_path, and
        the task reports no held-out loss (its evaluation is the sample grid)."""
        data = config.data
        require(
            data.source == "embedded" and not data.path,
            "data.path" if data.path else "data.source",
            f"{data.path or data.source!r} is not read by the rectified_flow task; images and captions come "
            "from flux.dataset and flux.data_path",
        )
        require(
            not config.validation.enable,
            "validation.enable",
            "the rectified_flow task measures no held-out loss (its evaluation is the sample grid, "
            "metrics.eval_freq); set validation.enable = false",
        )
        require(
            self.dataset != "generated" or not self.data_path,
            "flux.data_path",
            f"{self.data_path!r} is not read while flux.dataset = 'generated'; set flux.dataset = 'folder' or "
            "'webdataset'",
        )

    def prompts(self) -> list[str]:
        return [p.strip() for p in self.sample_prompts.split("|") if p.strip()]
