"""What a Hugging Face weights folder holds, for both directions (`hf_import`, `hf_export`):
`config.json` + `model.safetensors` (or shards with `model.safetensors.index.json`), mapped through
the model family's state-dict adapter. diffusers folders (FLUX.1's `transformer/`) name the weights
`diffusion_pytorch_model.*` instead: the adapter's `weights_stem` says which (`HFFiles`).

How one of our tensors is made of the folder's tensors, and each folder tensor of ours, is the
adapter's answer (`StateDictAdapter.import_layouts`, `export_layouts`): a `BlockLayout` of blocks, which
both directions read and write the same way whether a tensor is renamed, stacked from one tensor per
expert (Qwen 3 MoE keeps each layer's experts as one [E, out, in] weight), or converted as
transformers converts its checkpoints (the hf family).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from titan_tpu.protocols.state_dict_adapter import StateDictAdapter
from titan_tpu.protocols.tensor_layout import BlockLayout, assemble

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
    A folder holds such a tensor once, as transformers' save_pretrained writes it: under the name
    the model's `_tied_weights_keys` ties the others to, else under its first name; loading that one
    fills both. (Tied parameters sit outside the wrapped blocks, so these names are the state dict's.)"""
    tied_to_another: set[str] = set()
    for path, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None)
        if isinstance(declared, dict):  # transformers 5.x: {tied name: the name it is tied to}
            tied_to_another.update(f"{path}.{name}" if path else name for name in declared)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    repeats: set[str] = set()
    for group in names.values():
        kept = next((name for name in group if name not in tied_to_another), group[0])
        repeats.update(name for name in group if name != kept)
    return repeats


class FolderAssembly:
    """Folder tensors from ours given one at a time (an export gathers one tensor at a time): each
    folder tensor is handed out once all of ours it is made of have come, and each of ours is
    dropped once no folder tensor still needs it."""

    def __init__(self, layouts: Mapping[str, BlockLayout]) -> None:
        self.layouts = dict(layouts)
        self.order = {name: i for i, name in enumerate(self.layouts)}
        self.waiting = {name: set(layout.sources) for name, layout in self.layouts.items()}
        self.readers: dict[str, set[str]] = {}
        for name, sources in self.waiting.items():
            for source in sources:
                self.readers.setdefault(source, set()).add(name)
        self.held: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(folder name, tensor) of every folder tensor that `tensor` completes."""
        self.held[name] = tensor
        for folder_name in sorted(self.readers.get(name, ()), key=self.order.__getitem__):
            waiting = self.waiting[folder_name]
            waiting.discard(name)
            if not waiting:
                layout = self.layouts[folder_name]
                yield folder_name, assemble(layout, self.held)
                for source in layout.sources:
                    self.readers[source].discard(folder_name)
                    if not self.readers[source]:
                        del self.held[source]
        if not self.readers.get(name):
            self.held.pop(name, None)


class ReadProgress(Protocol):
    """Told when each file is read (titan_tpu.metrics.progress.Progress is one)."""

    def advance(self, count: int = 1, nbytes: int = 0) -> None: ...

    def finish(self) -> float: ...


# Called once the reader knows which files this process reads: (file count, their bytes) -> reporter.
StartProgress = Callable[[int, int], ReadProgress]
