"""Rectified-flow training of FLUX.1 as a TrainingTask.

A batch: images -> frozen autoencoder -> latents x0 packed into 2x2-patch tokens; captions -> frozen
T5 (per-token) and CLIP (pooled) embeddings, replaced by the empty caption's with probability
`flux.caption_dropout` (so the model also learns the unconditioned flow that classifier-free
guidance needs). Per sample a flow time t (logit-normal or uniform, shifted) and noise give
x_t = (1 - t) x0 + t noise; the model predicts the velocity noise - x0 and the loss is its MSE.

Noise, t and the dropout of a sample are drawn from a generator seeded by the run's seed and the
sample's global position in the data stream, so they do not depend on the data-parallel layout (1 and
2 processes train on the same numbers) and a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config import TrainConfig
from titan_tpu.config.errors import ConfigError
from titan_tpu.models.flux.args import FluxArgs
from titan_tpu.models.flux.flops import flux_training_flops_per_sample
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.rectified_flow.config import FluxConfig
from titan_tpu.tasks.rectified_flow.data import GeneratedShapes, ImageCaptionStream, build_image_dataloader, to_pixels
from titan_tpu.tasks.rectified_flow.encoders import Autoencoder, TextEncoders
from titan_tpu.tasks.rectified_flow.flow import image_ids, interpolate, pack, sample_time, text_ids, unpack
from titan_tpu.tasks.rectified_flow.sampler import euler_sample, save_grid

logger = logging.getLogger("titan_tpu")
EVAL_TIMES = (0.1, 0.3, 0.5, 0.7, 0.9)
# Spatial downsampling of the latent autoencoders the task can load, and the patch side: what the
# planner counts image tokens with.
AUTOENCODER_DOWNSAMPLE = {"identity": 1, "random": 2}
FLUX1_AUTOENCODER_DOWNSAMPLE = 8
PATCH = 2


def sample_generator(seed: int, position: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + position) * 7 + salt)


class RectifiedFlowTask(TrainingTask):
    unit = "samples"

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        self.flux = ctx.config.section(FluxConfig)
        self.seed = ctx.config.training.seed
        self.args: FluxArgs | None = None
        self.dataloader: StatefulDataLoader | None = None
        self._batches: Iterator[dict[str, Any]] | None = None
        self._latent_cache: dict[int, torch.Tensor] = {}
        self._text_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.autoencoder: Autoencoder | None = None
        self.text_encoders: TextEncoders | None = None

    def model_args(self, args: Any) -> Any:
        if not isinstance(args, FluxArgs):
            raise ConfigError(
                f"training.task 'rectified_flow' trains FLUX models; model.name is {self.ctx.config.model.name!r}"
            )
        if args.in_channels % 4:
            raise ConfigError(f"model flavor in_channels {args.in_channels} is not 4 x latent channels (2x2 packing)")
        self.args = args
        return args

    def setup(self, model: nn.Module) -> None:
        ctx, args = self.ctx, self._args()
        # Encoders loaded from folders run in the compute dtype (T5-XXL alone is 19 GB in float32);
        # the tiny random ones stay float32.
        dtype = ctx.compute_dtype
        self.text_encoders = TextEncoders(self.flux, args.context_dim, args.pooled_dim, self.seed, dtype).to(ctx.device)
        self.autoencoder = Autoencoder(self.flux, args.in_channels // 4, self.seed, dtype).to(ctx.device)
        self.dataloader = build_image_dataloader(self.flux, ctx.local_batch_size, ctx.dp_rank, ctx.dp_world, self.seed)
        self.empty_text = self.text_encoders([""])

    def _args(self) -> FluxArgs:
        assert self.args is not None, "model_args() runs before the model is built"
        return self.args

    def _autoencoder(self) -> Autoencoder:
        assert self.autoencoder is not None, "setup() builds the encoders"
        return self.autoencoder

    def _text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.text_encoders is not None, "setup() builds the encoders"
        return self.text_encoders(captions)

    def data_state(self) -> StatefulDataLoader | None:
        return self.dataloader

    def describe_data(self) -> str:
        """The image-caption set, its size, and how many epochs training.steps is."""
        assert self.dataloader is not None, "setup() builds the data loader"
        stream = self.dataloader.dataset
        assert isinstance(stream, ImageCaptionStream), "build_image_dataloader streams an image-caption set"
        flux, training = self.flux, self.ctx.config.training
        pairs = len(stream.source)
        where = "generated shapes" if flux.dataset == "generated" else f"{flux.dataset} {flux.data_path}"
        epochs = training.steps * training.global_batch_size / pairs
        return (
            f"{where}: {pairs:,} image-caption pairs at {flux.image_size} px; {training.steps} steps x "
            f"{training.global_batch_size} images = {epochs:.2f} epochs"
        )

    def _encode_text(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.flux.cache_encodings:
            return self._text(captions)
        missing = sorted({c for c in captions if c not in self._text_cache})
        if missing:
            t5, pooled = self._text(missing)
            self._text_cache.update({c: (t5[i], pooled[i]) for i, c in enumerate(missing)})
        return (
            torch.stack([self._text_cache[c][0] for c in captions]),
            torch.stack([self._text_cache[c][1] for c in captions]),
        )

    def _encode_images(self, pixels: torch.Tensor, indices: list[int]) -> torch.Tensor:
        device = self.ctx.device
        if not self.flux.cache_encodings:
            return self._autoencoder().encode(pixels.to(device))
        missing = [i for i, index in enumerate(indices) if index not in self._latent_cache]
        if missing:
            latents = self._autoencoder().encode(pixels[missing].to(device))
            self._latent_cache.update({indices[i]: latents[j] for j, i in enumerate(missing)})
        return torch.stack([self._latent_cache[index] for index in indices])

    def next_batch(self, model: nn.Module) -> dict[str, Any]:
        if self._batches is None:
            assert self.dataloader is not None, "setup() builds the data loader"
            self._batches = iter(self.dataloader)  # after a checkpoint may have restored the position
        raw = next(self._batches)
        t5, pooled = self._encode_text(list(raw["caption"]))
        latents = self._encode_images(raw["pixels"], raw["index"].tolist())
        return {"latents": latents, "t5": t5, "pooled": pooled, "position": raw["position"].tolist()}

    def _draws(self, positions: list[int], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t [B], noise [B, *shape], keep-caption mask [B]) from each sample's own generator."""
        times, noises, keep = [], [], []
        f = self.flux
        for position in positions:
            g = sample_generator(self.seed, position)
            times.append(sample_time(1, f.timestep_sampling, f.logit_mean, f.logit_std, f.time_shift, g))
            keep.append(torch.rand(1, generator=g) >= f.caption_dropout)
            noises.append(torch.randn(shape, generator=g))
        device = self.ctx.device
        return torch.cat(times).to(device), torch.stack(noises).to(device), torch.cat(keep).to(device)

    def velocity(
        self, model: nn.Module, x: torch.Tensor, t: torch.Tensor, t5: torch.Tensor, pooled: torch.Tensor, side: int
    ) -> torch.Tensor:
        device = x.device
        guidance = None
        if self._args().guidance_embed:
            guidance = torch.full((x.shape[0],), self.flux.guidance, device=device)
        return model(x, image_ids(side, side, device), t5, text_ids(t5.shape[1], device), t, pooled, guidance)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> TaskLoss:
        latents = batch["latents"]
        x0 = pack(latents)
        t, noise, keep = self._draws(batch["position"], tuple(x0.shape[1:]))
        t5 = torch.where(keep[:, None, None], batch["t5"], self.empty_text[0])
        pooled = torch.where(keep[:, None], batch["pooled"], self.empty_text[1])
        x_t, target = interpolate(x0, noise, t)
        prediction = self.velocity(model, x_t, t, t5, pooled, latents.shape[-1])
        loss = F.mse_loss(prediction.float(), target)
        return TaskLoss(loss, items=x0.shape[0])

    def flops_per_item(self) -> float:
        """Per training sample: its image tokens and the T5 length (CLIP only feeds the pooled vector)."""
        side = self._autoencoder().latent_size
        return flux_training_flops_per_sample(self._args(), (side // 2) ** 2, self.flux.t5_max_length)

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        """Samples, with FLOPs per sample as `flops_per_item` counts them, without building the
        autoencoder: the image side from flux.image_size, the autoencoder's downsampling (8x for a
        FLUX.1 folder, 2x for the built-in random one, 1x for "identity") and 2x2 patches, the text side
        from flux.t5_max_length."""
        flux = config.section(FluxConfig)
        downsample = AUTOENCODER_DOWNSAMPLE.get(flux.autoencoder, FLUX1_AUTOENCODER_DOWNSAMPLE)
        image_tokens = (flux.image_size // downsample // PATCH) ** 2
        flops = flux_training_flops_per_sample(args, image_tokens, flux.t5_max_length)
        return Workload("samples", 1, image_tokens + flux.t5_max_length, flops, flops / 3)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        """Held-out velocity MSE at fixed times and noise on generated images, and a PNG grid of
        samples for the configured prompts (written by the writer process; every process runs the
        model, since its parameters may be sharded)."""
        was_training = model.training
        model.eval()
        try:
            metrics = {"eval_loss": self._held_out_loss(model)}
            grid = self._sample_grid(model)
            if self.ctx.is_writer:
                path = save_grid(
                    grid, len(self.flux.prompts()), self.ctx.dump_folder / "samples" / f"step-{step:06d}.png"
                )
                logger.info("samples: %s", path)
        finally:
            model.train(was_training)
        return metrics

    def _held_out_loss(self, model: nn.Module) -> float:
        source = GeneratedShapes(len(EVAL_TIMES), self.flux.image_size)
        images, captions = zip(*(source[i] for i in range(len(source))))
        pixels = torch.stack([to_pixels(image, self.flux.image_size) for image in images])
        latents = self._autoencoder().encode(pixels.to(self.ctx.device))
        x0 = pack(latents)
        g = sample_generator(self.seed, 0, salt=1)
        noise = torch.randn(tuple(x0.shape), generator=g).to(x0.device)
        t = torch.tensor(EVAL_TIMES, device=x0.device)
        x_t, target = interpolate(x0, noise, t)
        t5, pooled = self._text(list(captions))
        prediction = self.velocity(model, x_t, t, t5, pooled, latents.shape[-1])
        return F.mse_loss(prediction.float(), target).item()

    def _sample_grid(self, model: nn.Module) -> torch.Tensor:
        prompts = [p for p in self.flux.prompts() for _ in range(self.flux.samples_per_prompt)]
        t5, pooled = self._text(prompts)
        empty_t5, empty_pooled = (e.expand(len(prompts), *e.shape[1:]) for e in self.empty_text)
        side = self._autoencoder().latent_size
        channels = self._args().in_channels
        g = sample_generator(self.seed, 0, salt=2)
        noise = torch.randn(len(prompts), (side // 2) ** 2, channels, generator=g).to(self.ctx.device)

        def velocity(x: torch.Tensor, t: torch.Tensor, conditioned: bool) -> torch.Tensor:
            text_t5, text_pooled = (t5, pooled) if conditioned else (empty_t5, empty_pooled)
            return self.velocity(model, x, t, text_t5, text_pooled, side)

        tokens = euler_sample(velocity, noise, self.flux.sample_steps, self.flux.sample_cfg_scale, self.flux.time_shift)
        return self._autoencoder().decode(unpack(tokens, side, side))
