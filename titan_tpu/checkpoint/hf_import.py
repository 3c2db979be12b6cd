"""Hugging Face folders in: a model's weights (and the checks before them) from a transformers or
diffusers folder, laid out as `titan_tpu.checkpoint.hf_format` describes.

config.json is checked against the flavor, then the adapter's layouts (how each of our tensors is
made of the folder's) against the safetensors headers (titan_tpu/checkpoint/hf_fit.py), all before any
weight is read. The weights are read by DCP's HuggingFaceStorageReader: lazily with `safe_open`, each
rank reading only the blocks of the (DTensor) shards it holds. A rank's shard of a stacked or fused
tensor covers a box of it (expert parallelism shards experts along dim 0, FSDP may cut that range or
another dim further): the rank reads only the folder tensors that box overlaps, and of each only the
overlapping block, straight into a view of its shard.

Out: `titan_tpu.checkpoint.hf_export`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.futures import Future

from titan_tpu.checkpoint.hf_fit import plan_import
from titan_tpu.checkpoint.hf_format import (
    CONFIG_FILE,
    PIPELINE_FILE,
    TRANSFORMERS_FILES,
    WEIGHTS_SUFFIX,
    HFFiles,
    StartProgress,
    tied_repeats,
)
from titan_tpu.checkpoint.storage import SafeLoadPlanner, describe_error, quiet_single_process
from titan_tpu.config.errors import ConfigError
from titan_tpu.protocols.state_dict_adapter import StateDictAdapter


class _ReportingReader(HuggingFaceStorageReader):
    """DCP's safetensors reader, one file at a time, reporting each file as it is read: a large
    folder takes minutes, and a silent wait looks like a hang."""

    def __init__(self, path: str, start_progress: StartProgress) -> None:
        super().__init__(path)
        self.start_progress = start_progress

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        sizes = {name: os.path.getsize(name) for name in per_file}
        progress = self.start_progress(len(per_file), sum(sizes.values()))
        for name, items in per_file.items():
            super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            progress.advance(1, sizes[name])
        progress.finish()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def local_block(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(this rank's block of `value`, its offsets in the global tensor); None when the rank holds
    none of it (a DTensor on a mesh this rank is not part of). Plain tensors are their own block."""
    if not isinstance(value, DTensor):
        return value, (0,) * value.dim()
    if value.device_mesh.get_coordinate() is None:
        return None
    chunks = value.__create_chunk_list__()  # what DCP uses to place a shard
    if len(chunks) != 1:
        raise ValueError(f"a DTensor with {len(chunks)} local chunks is not supported")
    return value.to_local(), tuple(chunks[0].offsets)


@dataclass(frozen=True)
class BlockRead:
    """Fill `tensor` with the block of the folder's tensor `name` that starts at `offsets` (the
    block's shape is `tensor`'s; `tensor` may be a strided view, e.g. of a rank's shard)."""

    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]


class _BlockLoadPlanner(SafeLoadPlanner):
    """Loads blocks of the stored tensors, several per tensor where a layout asks for several
    (DefaultLoadPlanner only knows whole tensors and DTensors)."""

    def __init__(self, reads: list[BlockRead]) -> None:
        super().__init__()
        self.targets: dict[str, list[BlockRead]] = {}
        for read in reads:
            self.targets.setdefault(read.name, []).append(read)

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise RuntimeError("create_local_plan before set_up_planner: no checkpoint metadata")
        requests = []
        for name, reads in self.targets.items():
            md = self.metadata.state_dict_metadata[name]
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{name} is not a tensor in the Hugging Face folder")
            chunks = [ChunkStorageMetadata(torch.Size(r.offsets), r.tensor.size()) for r in reads]
            requests += create_read_items_for_chunk_list(name, md, chunks)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.index is not None  # create_read_items_for_chunk_list numbers the chunks
        return self.targets[index.fqn][index.index].tensor


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if (Path(folder) / PIPELINE_FILE).is_file():
            raise ConfigError(
                f"Hugging Face folder {folder} is a diffusers pipeline ({PIPELINE_FILE}, no {CONFIG_FILE}); "
                f"point at the model's subfolder, e.g. {Path(folder) / 'transformer'}"
            ) from None
        raise ConfigError(f"Hugging Face folder {folder}: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"Hugging Face folder {folder}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"Hugging Face folder {folder}: {CONFIG_FILE} is not a JSON object")
    return config


def check_hf_config(folder: Path, adapter: StateDictAdapter, args: Any, what: str) -> dict[str, Any]:
    """ConfigError listing every disagreement between the folder's config.json and `args`."""
    config = read_hf_config(folder)
    problems = adapter.check_hf_config(config, args)
    if problems:
        raise ConfigError(f"Hugging Face folder {folder}: {CONFIG_FILE} does not match {what}: {'; '.join(problems)}")
    return config


def hf_tensor_index(folder: Path, files: HFFiles = TRANSFORMERS_FILES) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    folder = Path(folder)
    index_path = folder / files.index
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"Hugging Face folder {folder}: {files.index} is unreadable ({e})") from None
        names = sorted(set(weight_map.values()))
    elif (folder / files.single).is_file():
        weight_map, names = None, [files.single]
    else:
        raise ConfigError(f"Hugging Face folder {folder}: neither {files.single} nor {files.index} is there")
    # The reader (DCP's HuggingFaceStorageReader) takes every *.safetensors in the folder, so weights
    # beside ours (diffusers' fp16 variants, another library's copy) would be mixed in unseen.
    others = sorted(p.name for p in folder.glob(f"*{WEIGHTS_SUFFIX}") if p.name not in names)
    if others:
        raise ConfigError(
            f"Hugging Face folder {folder}: {others[0]} is not among the weights "
            f"{'listed in ' + files.index if weight_map is not None else files.single}; "
            "the folder may hold only those (move other *.safetensors elsewhere)"
        )
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in names:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    found[key] = (name, tuple(f.get_slice(key).get_shape()))
        except FileNotFoundError:
            raise ConfigError(f"Hugging Face folder {folder}: file {name} is missing") from None
        except Exception as e:  # safetensors raises its own error type for a torn header
            raise ConfigError(f"Hugging Face folder {folder}: file {name} is unreadable ({e})") from None
    if weight_map is not None:
        for key, name in weight_map.items():
            if found.get(key, (None,))[0] != name:
                raise ConfigError(f"Hugging Face folder {folder}: {files.index} puts {key} in {name}, which lacks it")
    return found


def load_hf_weights(
    model: nn.Module,
    folder: str | Path,
    adapter: StateDictAdapter | None,
    args: Any,
    what: str = "the model",
    process_group: dist.ProcessGroup | None = None,
    progress: StartProgress | None = None,
    frozen_only: bool = False,
) -> None:
    """Set `model`'s weights (plain or DTensor-sharded) from a Hugging Face folder; `progress`, when
    given, hears of each file this process reads. `frozen_only`: only the frozen parameters (and
    buffers) come from the folder, the trained ones are left as they are (a LoRA run's base is the
    folder's, its adapters are not in it)."""
    folder = Path(folder)
    if adapter is None:
        raise ConfigError(f"{what} has no Hugging Face adapter; checkpoint.initial_load_path cannot be used")
    if not folder.is_dir():
        raise ConfigError(f"checkpoint.initial_load_path: {folder} is not a folder")
    check_hf_config(folder, adapter, args, what)
    state_dict = get_model_state_dict(model)
    # The same dict as tensors: a model's state dict holds tensors only; torch's type also covers optimizer states.
    tensors = cast(dict[str, torch.Tensor], state_dict)
    not_read = tied_repeats(model)
    if frozen_only:
        not_read |= set(get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)))
    shapes = {name: tuple(value.shape) for name, value in tensors.items() if name not in not_read}
    available = {name: shape for name, (_, shape) in hf_tensor_index(folder, HFFiles.of(adapter)).items()}
    layouts = plan_import(folder, adapter, args, shapes, available, what)
    # Each rank asks for the blocks of the folder's tensors its shards hold, into views of those
    # shards, so the reads land in place.
    reads: list[BlockRead] = []
    with torch.no_grad():
        for name, layout in layouts.items():
            block = local_block(tensors[name])
            if block is not None:
                local, offsets = block
                reads += [
                    BlockRead(part.source, part.target_view(local), part.source_offsets)
                    for part in layout.blocks(offsets, local.shape)
                ]
    read_hf_blocks(folder, reads, process_group, progress)
    set_model_state_dict(model, state_dict)


def read_hf_blocks(
    folder: Path,
    reads: list[BlockRead],
    process_group: dist.ProcessGroup | None = None,
    progress: StartProgress | None = None,
) -> None:
    """Carry out `reads` (`BlockRead`). Collective when a process group is initialised."""
    reader = HuggingFaceStorageReader(str(folder)) if progress is None else _ReportingReader(str(folder), progress)
    try:
        with quiet_single_process():
            dcp.load(
                {read.name: read.tensor for read in reads},
                storage_reader=reader,
                planner=_BlockLoadPlanner(reads),
                process_group=process_group,
                no_dist=not (dist.is_available() and dist.is_initialized()),
            )
    except (Exception, CheckpointException) as e:
        raise ConfigError(f"Hugging Face folder {folder}: reading the weights failed ({describe_error(e)})") from e
