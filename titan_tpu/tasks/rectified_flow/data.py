"""Image-caption data for rectified-flow training: a generated set (no download), local folders of
images with caption files, and webdataset-style .tar shards; served per data-parallel rank by
torchdata's `StatefulDataLoader`.

Sharding follows the language-model loader: rank r of W takes global samples r, r+W, r+2W, ... of one
infinite sequence (epochs of the source in a seeded permutation each), so the union of a step's samples
does not depend on W. The state is the global count of samples consumed, the same on every rank, so a
resume (also with another W) continues at the next sample: nothing is replayed or skipped.
"""

from __future__ import annotations

import glob
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.loader import stateful_loader
from titan_tpu.tasks.rectified_flow.config import FluxConfig

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "white": (240, 240, 240),
}
SHAPES = ("circle", "square", "triangle")
# Name -> centre as a fraction of the image side (x, y).
POSITIONS = {
    "at the top left": (0.28, 0.28),
    "at the top right": (0.72, 0.28),
    "at the bottom left": (0.28, 0.72),
    "at the bottom right": (0.72, 0.72),
    "in the center": (0.5, 0.5),
}


class ImageCaptionSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[Image.Image, str]: ...


def draw_shape(shape: str, color: str, position: str, size: int) -> Image.Image:
    """One RGB image of `size` pixels: a coloured shape about a third of the side wide on grey."""
    cx, cy = (c * size for c in POSITIONS[position])
    radius = size * 0.17
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        mask = dx**2 + dy**2 <= radius**2
    elif shape == "square":
        mask = (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    else:  # upward triangle: inside the base and both slanted edges
        mask = (dy <= radius) & (dy >= -radius + 2 * np.abs(dx))
    pixels = np.full((size, size, 3), 90, dtype=np.uint8)
    pixels[mask] = COLORS[color]
    return Image.fromarray(pixels, "RGB")


class GeneratedShapes:
    """Every (colour, shape, position) combination, repeated to `count` samples; the caption says
    all three, so a text-conditioned model can learn to place and colour what it is asked for."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.combinations = [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Image.Image, str]:
        color, shape, position = self.combinations[index % len(self.combinations)]
        return draw_shape(shape, color, position, self.size), f"a {color} {shape} {position}"


class ImageFolder:
    """Images under a folder (recursively), each with a caption in a .txt file of the same stem."""

    def __init__(self, folder: str) -> None:
        root = Path(folder)
        if not root.is_dir():
            raise ConfigError(f"flux.data_path: {folder} is not a folder")
        self.images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.images:
            raise ConfigError(f"flux.data_path: no images ({', '.join(IMAGE_SUFFIXES)}) under {folder}")
        missing = [p for p in self.images if not p.with_suffix(".txt").is_file()]
        if missing:
            raise ConfigError(f"flux.data_path: {len(missing)} images have no caption file, e.g. {missing[0]}.txt")

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Image.Image, str]:
        path = self.images[index]
        caption = path.with_suffix(".txt").read_text(encoding="utf-8").strip()
        return Image.open(path).convert("RGB"), caption


class WebDatasetShards:
    """webdataset-style .tar shards: members `KEY.<image suffix>` and `KEY.txt` form one sample.
    The index (shard, member names) is read once; members are read when asked for."""

    def __init__(self, pattern: str) -> None:
        shards = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).is_file() else [])
        if not shards:
            raise ConfigError(f"flux.data_path: no .tar shards match {pattern}")
        self.samples: list[tuple[str, str, str]] = []
        for shard in shards:
            try:
                with tarfile.open(shard) as tar:
                    names = {m.name for m in tar.getmembers() if m.isfile()}
            except (tarfile.TarError, OSError) as e:
                raise ConfigError(f"flux.data_path: {shard} is not a readable tar file ({e})") from None
            for name in sorted(names):
                key, suffix = name.rsplit(".", 1) if "." in name else (name, "")
                if f".{suffix.lower()}" in IMAGE_SUFFIXES and f"{key}.txt" in names:
                    self.samples.append((shard, name, f"{key}.txt"))
        if not self.samples:
            raise ConfigError(f"flux.data_path: the shards matching {pattern} hold no image + .txt pairs")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, str]:
        shard, image_name, caption_name = self.samples[index]
        with tarfile.open(shard) as tar:
            image_bytes = _member_bytes(tar, shard, image_name)
            caption = _member_bytes(tar, shard, caption_name).decode("utf-8").strip()
        return Image.open(io.BytesIO(image_bytes)).convert("RGB"), caption


def _member_bytes(tar: tarfile.TarFile, shard: str, name: str) -> bytes:
    member = tar.extractfile(name)
    if member is None:  # a directory or a link of that name
        raise ConfigError(f"flux.data_path: {name} in {shard} is not a regular file")
    return member.read()


def build_source(config: FluxConfig) -> ImageCaptionSource:
    if config.dataset == "generated":
        return GeneratedShapes(config.generated_samples, config.image_size)
    if config.dataset == "folder":
        return ImageFolder(config.data_path)
    return WebDatasetShards(config.data_path)


def to_pixels(image: Image.Image, size: int) -> torch.Tensor:
    """Centre crop to a square, resize to `size`, -> [3, size, size] in [-1, 1]."""
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    image = image.crop((left, top, left + side, top + side))
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class ImageCaptionStream(IterableDataset):
    """Infinite `{"pixels", "caption", "index", "position"}` samples of one data-parallel rank (Stateful)."""

    def __init__(self, source: ImageCaptionSource, size: int, dp_rank: int, dp_world: int, seed: int) -> None:
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_world})")
        self.source, self.size = source, size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.consumed = 0  # global samples before this rank's next one, over all ranks

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.source))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        count = len(self.source)
        epoch, order = -1, np.empty(0, dtype=np.int64)
        while True:
            position = self.consumed + self.dp_rank
            if position // count != epoch:
                epoch = position // count
                order = self._order(epoch)
            index = int(order[position % count])
            image, caption = self.source[index]
            self.consumed += self.dp_world
            # position: where the sample sits in the global stream, whatever the layout (seeds its noise).
            yield {"pixels": to_pixels(image, self.size), "caption": caption, "index": index, "position": position}

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed"])


def build_image_dataloader(
    config: FluxConfig, local_batch_size: int, dp_rank: int, dp_world: int, seed: int
) -> StatefulDataLoader:
    stream = ImageCaptionStream(build_source(config), config.image_size, dp_rank, dp_world, seed)
    # Decoding small images is cheap enough to do in the loading process.
    return stateful_loader(stream, local_batch_size, seed)
