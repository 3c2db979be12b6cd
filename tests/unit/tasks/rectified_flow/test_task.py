"""Rectified-flow task pieces: packing, the flow and its time schedule, data sources and sharding,
frozen encoders, the Euler sampler, and a few optimizer steps of the task on the debug model."""

from __future__ import annotations

import dataclasses
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.loader import load_config
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.models.registry import get_model_spec
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.rectified_flow.config import FluxConfig
from titan_tpu.tasks.rectified_flow.data import (
    COLORS,
    POSITIONS,
    GeneratedShapes,
    ImageCaptionStream,
    ImageFolder,
    WebDatasetShards,
    build_image_dataloader,
)
from titan_tpu.tasks.rectified_flow.encoders import Autoencoder, TextEncoders
from titan_tpu.tasks.rectified_flow.flow import image_ids, interpolate, pack, sample_time, shift_time, unpack
from titan_tpu.tasks.rectified_flow.sampler import euler_sample, save_grid
from titan_tpu.tasks.rectified_flow.task import RectifiedFlowTask


def test_pack_matches_image_ids() -> None:
    """Token k is the 2x2 patch at (row, col) = image_ids[k][1:]; unpack inverts pack. Catches a
    transposed packing, which would give every token the wrong rotary position."""
    latents = torch.randn(2, 3, 6, 8)
    tokens = pack(latents)
    assert tokens.shape == (2, 12, 12)
    assert torch.equal(unpack(tokens, 6, 8), latents)
    ids = image_ids(6, 8)
    for k in (0, 5, 11):
        row, col = int(ids[k, 1]), int(ids[k, 2])
        patch = latents[:, :, 2 * row : 2 * row + 2, 2 * col : 2 * col + 2].reshape(2, -1)
        assert torch.equal(tokens[:, k], patch)


def test_flow_endpoints_and_velocity() -> None:
    x0, noise = torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    x_t, target = interpolate(x0, noise, torch.tensor([0.0, 1.0, 0.25]))
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[1], noise[1])
    later, _ = interpolate(x0, noise, torch.tensor([0.0, 1.0, 0.25 + 1e-3]))
    assert torch.allclose((later[2] - x_t[2]) / 1e-3, target[2], atol=1e-2)


def test_time_schedule() -> None:
    """Logit-normal stays inside (0, 1) and centres on 0.5; a shift > 1 moves mass towards noise."""
    g = torch.Generator().manual_seed(0)
    t = sample_time(20000, "logit_normal", 0.0, 1.0, 1.0, g)
    assert 0 < t.min() and t.max() < 1 and abs(t.mean().item() - 0.5) < 0.01
    shifted = sample_time(20000, "logit_normal", 0.0, 1.0, 3.0, torch.Generator().manual_seed(0))
    assert shifted.mean() > 0.6
    assert shift_time(torch.tensor([0.0, 1.0]), 3.0).tolist() == [0.0, 1.0]


def test_generated_captions_describe_the_image() -> None:
    """The shape's colour is where the caption says (catches captions out of step with images)."""
    source = GeneratedShapes(100, 32)
    for index in (0, 17, 42, 99):
        image, caption = source[index]
        position = next(p for p in POSITIONS if caption.endswith(p))
        color = caption.split()[1]
        x, y = (int(c * 32) for c in POSITIONS[position])
        assert tuple(np.asarray(image)[y, x]) == COLORS[color], caption


def test_stream_sharding_and_resume() -> None:
    """Two ranks together see exactly one rank's sequence; a loader restored from its state continues
    at the next sample (catches a replay or skip on resume); iterating leaves the run's global RNG
    alone."""
    source = GeneratedShapes(10, 16)

    def positions(rank: int, world: int, n: int) -> list[int]:
        stream = iter(ImageCaptionStream(source, 16, rank, world, seed=3))
        return [next(stream)["index"] for _ in range(n)]

    single = positions(0, 1, 24)  # crosses two epochs
    assert sorted(single[:10]) == list(range(10))
    assert positions(0, 2, 12) == single[0::2] and positions(1, 2, 12) == single[1::2]

    config = FluxConfig(generated_samples=10, image_size=16)
    loader = build_image_dataloader(config, 3, 0, 1, seed=5)
    global_rng = torch.get_rng_state()
    batches = iter(loader)
    next(batches)
    assert torch.equal(torch.get_rng_state(), global_rng)  # the loader draws from its own generator
    state = loader.state_dict()
    expected = next(batches)["index"].tolist()
    resumed = build_image_dataloader(config, 3, 0, 1, seed=5)
    resumed.load_state_dict(state)
    assert next(iter(resumed))["index"].tolist() == expected


def _png(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 12), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_folder_and_webdataset_sources(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.png").write_bytes(_png((255, 0, 0)))
    (folder / "a.txt").write_text("red\n")
    image, caption = ImageFolder(str(folder))[0]
    assert caption == "red" and image.getpixel((0, 0)) == (255, 0, 0)
    (folder / "b.png").write_bytes(_png((0, 0, 255)))
    with pytest.raises(ConfigError, match="no caption file"):
        ImageFolder(str(folder))

    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in (("k1.png", _png((0, 255, 0))), ("k1.txt", b"green"), ("k2.txt", b"orphan")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    shards = WebDatasetShards(str(tmp_path / "shard-*.tar"))
    assert len(shards) == 1
    image, caption = shards[0]
    assert caption == "green" and image.getpixel((3, 3)) == (0, 255, 0)
    with pytest.raises(ConfigError, match="no .tar shards"):
        WebDatasetShards(str(tmp_path / "none-*.tar"))


def test_random_encoders_are_seeded_and_shaped() -> None:
    """Every rank must build the same frozen encoders (else FSDP ranks train on different inputs)."""
    config = FluxConfig(image_size=16, t5_max_length=12)
    first, second = TextEncoders(config, 64, 32, seed=0), TextEncoders(config, 64, 32, seed=0)
    t5, pooled = first(["a red circle", "a blue square"])
    assert t5.shape == (2, 12, 64) and pooled.shape == (2, 32)
    again = second(["a red circle", "a blue square"])
    assert torch.equal(t5, again[0]) and torch.equal(pooled, again[1])
    assert (pooled[0] - pooled[1]).abs().max() > 1e-3  # captions are distinguishable
    assert not any(p.requires_grad for p in first.parameters())

    vae = Autoencoder(config, latent_channels=3, seed=0)
    latents = vae.encode(torch.rand(2, 3, 16, 16) * 2 - 1)
    assert latents.shape == (2, 3, 8, 8) and vae.latent_size == 8
    assert vae.decode(latents).shape == (2, 3, 16, 16)
    with pytest.raises(ConfigError, match="3 channels, the model flavor packs 4"):
        Autoencoder(dataclasses.replace(config, autoencoder="identity"), latent_channels=4, seed=0)
    with pytest.raises(ConfigError, match="neither 'random' nor a folder"):
        TextEncoders(dataclasses.replace(config, t5_encoder="/no/such/t5"), 64, 32, seed=0)


def test_euler_recovers_a_straight_flow_and_guides() -> None:
    """With the exact velocity of the straight path to x0, Euler lands on x0 (catches a sign or a
    time-direction error); guidance extrapolates from the unconditioned towards the conditioned flow."""
    x0, noise = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    target = {True: x0, False: torch.zeros_like(x0)}

    def velocity(x: torch.Tensor, t: torch.Tensor, conditioned: bool) -> torch.Tensor:
        return (x - target[conditioned]) / t.view(-1, 1, 1)

    assert torch.allclose(euler_sample(velocity, noise, 7, cfg_scale=1.0, time_shift=3.0), x0, atol=1e-5)
    guided = euler_sample(velocity, noise, 1, cfg_scale=2.0)
    assert torch.allclose(guided, 2 * x0, atol=1e-5)


def test_grid_is_a_png(tmp_path: Path) -> None:
    path = save_grid(torch.rand(6, 3, 16, 16) * 2 - 1, rows=2, path=tmp_path / "grid.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (3 * 66 + 2, 2 * 66 + 2)


def _task(tmp_path: Path, *overrides: str) -> tuple[RectifiedFlowTask, torch.nn.Module]:
    config = load_config("flux_debug", [f"--job.dump_folder={tmp_path}", *overrides])
    spec = get_model_spec("flux")
    ctx = TaskContext(
        config=config,
        spec=spec,
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        parallel=ParallelContext(ParallelDims.from_config(config.parallelism, 1)),
        dp_rank=0,
        dp_world=1,
        local_batch_size=4,
        grad_accum_steps=1,
        dump_folder=tmp_path,
        is_writer=True,
    )
    task = RectifiedFlowTask(ctx)
    args = task.model_args(spec.flavor(config.model.flavor))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    task.setup(model)
    return task, model


def test_task_trains_and_samples(tmp_path: Path) -> None:
    """A few steps on the generated data lower the loss, and evaluate writes a PNG grid (catches a
    target the model cannot learn, such as noise and x0 drawn from unrelated samples)."""
    task, model = _task(tmp_path, "--flux.sample_steps=3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = task.next_batch(model)
    first = task.loss(model, batch).loss.item()
    losses = []
    for _ in range(25):
        result = task.loss(model, task.next_batch(model))
        assert result.items == 4
        result.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(result.loss.item())
    assert np.mean(losses[-5:]) < 0.8 * first, (first, losses[-5:])
    assert task.flops_per_item() > 0
    metrics = task.evaluate(model, step=25)
    assert np.isfinite(metrics["eval_loss"])
    with Image.open(tmp_path / "samples" / "step-000025.png") as image:
        assert image.format == "PNG"


def test_autoencoder_from_a_diffusers_folder(tmp_path: Path) -> None:
    """A local AutoencoderKL folder loads with its own scaling and shift (FLUX.1's VAE has both);
    catches latents left unnormalised, which would train the flow on the wrong scale."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        latent_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 32),
        layers_per_block=1,
        norm_num_groups=8,
        scaling_factor=0.5,
        shift_factor=0.2,
    )
    vae.save_pretrained(tmp_path / "vae")
    loaded = Autoencoder(FluxConfig(image_size=16, autoencoder=str(tmp_path / "vae")), latent_channels=3, seed=0)
    pixels = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    assert torch.allclose(loaded.encode(pixels), (mean - 0.2) * 0.5, atol=1e-5)
