"""What a Hugging Face weights folder holds, for both directions (`hf_import`, `hf_export`):
`config.json` + `model.safetensors` (or shards with `model.safetensors.index.json`), mapped through
the model family's state-dict adapter. diffusers folders (FLUX.1's `transformer/`) name the weights
`diffusion_pytorch_model.*` instead: the adapter's `weights_stem` says which (`HFFiles`).

One of our tensors is either one Hugging Face tensor under another name, or several stacked along a
dimension: Qwen 3 MoE keeps each layer's experts as one [E, out, in] weight, the files hold E tensors
`...experts.K.gate_proj.weight`. The adapter says which (`StateDictAdapter.hf_tensors`); everything here
handles both the same way, through `HFParts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from titan_tpu.protocols.state_dict_adapter import StateDictAdapter

CONFIG_FILE = "config.json"
# What a diffusers pipeline's root holds instead of config.json; its models are in subfolders.
PIPELINE_FILE = "model_index.json"
WEIGHTS_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class HFFiles:
    """The file names of a Hugging Face weights folder. transformers writes `model.safetensors` and
    both `dtype` (5.x reads it) and `torch_dtype` (4.x reads it) in config.json; diffusers writes
    `diffusion_pytorch_model.safetensors`, and from_pretrained fails on a `dtype` key (it reaches the
    model's constructor), so a diffusers adapter names the dtype keys it wants, possibly none."""

    stem: str = "model"
    dtype_keys: tuple[str, ...] = ("dtype", "torch_dtype")

    @classmethod
    def of(cls, adapter: StateDictAdapter) -> HFFiles:
        return cls(adapter.weights_stem, tuple(adapter.config_dtype_keys))

    @property
    def single(self) -> str:
        return f"{self.stem}{WEIGHTS_SUFFIX}"

    @property
    def index(self) -> str:
        return f"{self.stem}{WEIGHTS_SUFFIX}.index.json"

    def shard(self, number: int, count: int) -> str:
        """Name of shard `number` (from 1) of `count`, as both libraries write them."""
        return f"{self.stem}-{number:05d}-of-{count:05d}{WEIGHTS_SUFFIX}"


TRANSFORMERS_FILES = HFFiles()


def tied_repeats(model: nn.Module) -> set[str]:
    """Names under which the model lists a parameter a second time (a head tied to its embedding).
    A folder holds such a tensor once, under its first name, as transformers' save_pretrained
    writes it; loading that one fills both. (Tied parameters sit outside the wrapped blocks, so
    these names are the state dict's.)"""
    seen: set[int] = set()
    repeats: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            repeats.add(name)
        seen.add(id(param))
    return repeats


@dataclass(frozen=True)
class HFParts:
    """Where one of our tensors lies in a Hugging Face folder: `names[0]` whole (dim None), or
    `torch.stack([names[0], names[1], ...], dim)`. `shape` is each HF tensor's."""

    names: list[str]
    dim: int | None
    shape: tuple[int, ...]

    @classmethod
    def of(cls, adapter: StateDictAdapter, name: str, shape: Sequence[int]) -> HFParts:
        shape = tuple(int(n) for n in shape)
        names, dim = adapter.hf_tensors(name, shape)
        names = list(names)
        if dim is None:
            if len(names) != 1:
                raise ValueError(f"adapter: {name} maps whole to {len(names)} tensors, expected 1")
            return cls(names, None, shape)
        if not 0 <= dim < len(shape) or len(names) != shape[dim]:
            raise ValueError(f"adapter: {name} {list(shape)} is not a stack of {len(names)} along dim {dim}")
        return cls(names, dim, shape[:dim] + shape[dim + 1 :])

    def split(self, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of a whole (gathered) tensor of ours."""
        if self.dim is None:
            yield self.names[0], full
        else:
            yield from zip(self.names, full.unbind(self.dim))

    def blocks(
        self, local: torch.Tensor, offsets: Sequence[int]
    ) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
        """(HF name, view of `local`, its offsets in that HF tensor) for a block `local` of our tensor
        starting at `offsets`: only the HF tensors the block covers."""
        offsets = tuple(offsets)
        if self.dim is None:
            yield self.names[0], local, offsets
            return
        dim = self.dim
        inner = offsets[:dim] + offsets[dim + 1 :]
        for i in range(local.shape[dim]):
            yield self.names[offsets[dim] + i], local.select(dim, i), inner


class ReadProgress(Protocol):
    """Told when each file is read (titan_tpu.metrics.progress.Progress is one)."""

    def advance(self, count: int = 1, nbytes: int = 0) -> None: ...

    def finish(self) -> float: ...


# Called once the reader knows which files this process reads: (file count, their bytes) -> reporter.
StartProgress = Callable[[int, int], ReadProgress]
