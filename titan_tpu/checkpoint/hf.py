"""Hugging Face folders in and out: `config.json` + `model.safetensors` (or shards with
`model.safetensors.index.json`), mapped through the model family's state-dict adapter.

In: config.json is checked against the flavor, then the tensor names and shapes are checked against the
safetensors headers, all before any weight is read. The weights are read by DCP's HuggingFaceStorageReader:
lazily with `safe_open`, each rank reading only the slices of the (DTensor) shards it holds.

Out: one tensor at a time is gathered (`full_tensor()` for DTensors, all ranks in the same order), cast
to the export dtype and written by rank 0 into shards of bounded size, in a temporary folder that is
renamed when complete. The result loads with `transformers.AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from titan_tpu.checkpoint import layout
from titan_tpu.checkpoint.storage import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_files,
    describe_error,
    quiet_single_process,
    read_metadata_file,
)
from titan_tpu.config.errors import ConfigError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StateDictAdapter(Protocol):
    """What a model family provides (ModelSpec.state_dict_adapter) to go to and from transformers."""

    def hf_name(self, name: str) -> str: ...

    def our_name(self, hf_name: str) -> str: ...

    def to_hf_config(self, args: Any) -> dict[str, Any]: ...

    def check_hf_config(self, config: dict[str, Any], args: Any) -> list[str]: ...


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
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
        raise ConfigError(
            f"Hugging Face folder {folder}: {CONFIG_FILE} does not match {what}: {'; '.join(problems)}"
        )
    return config


def hf_tensor_index(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"Hugging Face folder {folder}: {INDEX_FILE} is unreadable ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise ConfigError(f"Hugging Face folder {folder}: neither {SINGLE_FILE} nor {INDEX_FILE} is there")
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in files:
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
                raise ConfigError(
                    f"Hugging Face folder {folder}: {INDEX_FILE} puts {key} in {name}, which lacks it"
                )
    return found


def load_hf_weights(
    model: nn.Module,
    folder: str | Path,
    adapter: StateDictAdapter | None,
    args: Any,
    what: str = "the model",
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Set `model`'s weights (plain or DTensor-sharded) from a Hugging Face folder."""
    folder = Path(folder)
    if adapter is None:
        raise ConfigError(f"{what} has no Hugging Face adapter; checkpoint.initial_load_path cannot be used")
    if not folder.is_dir():
        raise ConfigError(f"checkpoint.initial_load_path: {folder} is not a folder")
    check_hf_config(folder, adapter, args, what)
    state_dict = get_model_state_dict(model)
    hf_state = {adapter.hf_name(name): value for name, value in state_dict.items()}
    available = hf_tensor_index(folder)
    problems = [f"{key} is missing" for key in hf_state if key not in available]
    problems += [
        f"{key} is {list(available[key][1])} there, {list(value.shape)} here"
        for key, value in hf_state.items()
        if key in available and available[key][1] != tuple(value.shape)
    ]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        listed = "; ".join(problems[:3])
        raise ConfigError(f"Hugging Face folder {folder} does not fit {what}: {listed}{more}")
    try:
        with quiet_single_process():
            dcp.load(
                hf_state,
                storage_reader=HuggingFaceStorageReader(str(folder)),
                planner=SafeLoadPlanner(),
                process_group=process_group,
                no_dist=not (dist.is_available() and dist.is_initialized()),
            )
    except (Exception, CheckpointException) as e:
        raise ConfigError(f"Hugging Face folder {folder}: reading the weights failed ({describe_error(e)})") from e
    set_model_state_dict(model, {adapter.our_name(k): v for k, v in hf_state.items()})


class HFFolderWriter:
    """Writes named tensors, in a planned order, into safetensors shards of at most `max_shard_bytes`
    plus config.json (and the index when there is more than one shard); visible only when complete."""

    def __init__(
        self,
        out: Path,
        plan: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        config: dict[str, Any],
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        self.out = Path(out)
        if self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(f"export: {self.out} exists and is not empty; it is never overwritten")
        self.dtype = dtype
        self.config = config
        item = torch.empty((), dtype=dtype).element_size()
        shards: list[list[str]] = [[]]
        size = 0
        self.total_size = 0
        for name, shape in plan:
            nbytes = item * int(torch.Size(shape).numel())
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
            self.total_size += nbytes
        count = len(shards)
        self.file_of = {
            name: SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            for i, names in enumerate(shards)
            for name in names
        }
        self.remaining = {self.file_of[names[0]]: set(names) for names in shards if names}
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.temp = self.out.parent / f".{self.out.name}.tmp-{secrets.token_hex(4)}"
        self.temp.mkdir(parents=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        file = self.file_of[name]
        self.buffers.setdefault(file, {})[name] = tensor.detach().to("cpu", self.dtype).contiguous()
        self.remaining[file].discard(name)
        if not self.remaining[file]:
            save_file(self.buffers.pop(file), str(self.temp / file), metadata={"format": "pt"})

    def close(self) -> Path:
        unwritten = [name for names in self.remaining.values() for name in names]
        if unwritten:
            shutil.rmtree(self.temp, ignore_errors=True)
            raise RuntimeError(f"export: {len(unwritten)} tensors were never given, e.g. {unwritten[0]}")
        if len(self.remaining) > 1:
            weight_map = dict(sorted(self.file_of.items()))
            index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            (self.temp / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
        dtype_name = str(self.dtype).removeprefix("torch.")
        config = {**self.config, "dtype": dtype_name, "torch_dtype": dtype_name}
        (self.temp / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        if self.out.exists():
            self.out.rmdir()  # empty, checked at construction
        self.temp.rename(self.out)
        return self.out


def _export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"checkpoint.export_dtype: got {dtype!r}, expected one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def export_model_to_hf(
    model: nn.Module,
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path | None:
    """Export a live (possibly sharded) model; every rank calls it, rank 0 writes. Returns the folder
    on rank 0, None elsewhere."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):  # checked on every rank, so none is left in a collective
        raise ConfigError(f"export: {out} exists and is not empty; it is never overwritten")
    distributed = dist.is_available() and dist.is_initialized()
    writes = not distributed or dist.get_rank() == 0
    state_dict = get_model_state_dict(model)
    plan = [(adapter.hf_name(name), tuple(value.shape)) for name, value in state_dict.items()]
    writer = None
    if writes:
        config = adapter.to_hf_config(args)
        writer = HFFolderWriter(out, plan, _export_dtype(dtype), config, max_shard_bytes)
    for name, value in state_dict.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if writer is not None:
            writer.add(adapter.hf_name(name), full)
        del full
    result = writer.close() if writer is not None else None
    if distributed:
        dist.barrier()
    return result


def _checkpoint_model_tensors(step_folder: Path) -> dict[str, TensorStorageMetadata]:
    manifest = layout.read_manifest(step_folder)
    problem = check_files(step_folder, manifest["files"], sorted(manifest["files"]))
    if problem is not None:
        raise ConfigError(problem)
    metadata = read_metadata_file(step_folder / ".metadata")
    return {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }


def _read_in_groups(
    step_folder: Path, tensors: dict[str, TensorStorageMetadata], names: list[str], group_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    group: list[str] = []
    size = 0

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        state = {
            f"model.{n}": torch.empty(tuple(tensors[n].size), dtype=tensors[n].properties.dtype)
            for n in group
        }
        reader = SafeFileSystemReader(step_folder)
        with quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        for n in group:
            yield n, state.pop(f"model.{n}")

    for name in names:
        md = tensors[name]
        nbytes = int(torch.Size(md.size).numel()) * torch.empty((), dtype=md.properties.dtype).element_size()
        if group and size + nbytes > group_bytes:
            yield from flush()
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield from flush()


def export_checkpoint_to_hf(
    step_folder: str | Path,
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    expected_shapes: dict[str, tuple[int, ...]],
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Offline, one process: a complete checkpoint step folder -> Hugging Face folder, reading at most
    about one shard's worth of tensors at a time. `expected_shapes` (our names) is the flavor's."""
    step_folder = Path(step_folder)
    if not layout.is_complete(step_folder):
        raise ConfigError(f"export: {step_folder} is not a complete checkpoint step folder")
    tensors = _checkpoint_model_tensors(step_folder)
    problems = [f"missing {n}" for n in expected_shapes if n not in tensors]
    problems += [
        f"{n} is {list(tensors[n].size)}, the flavor has {list(shape)}"
        for n, shape in expected_shapes.items()
        if n in tensors and tuple(tensors[n].size) != tuple(shape)
    ]
    problems += [f"unexpected {n}" for n in tensors if n not in expected_shapes]
    if problems:
        listed = "; ".join(problems[:3])
        raise ConfigError(f"export: checkpoint {step_folder} does not fit the flavor: {listed}")
    names = list(expected_shapes)
    plan = [(adapter.hf_name(n), tuple(expected_shapes[n])) for n in names]
    config = adapter.to_hf_config(args)
    writer = HFFolderWriter(Path(out), plan, _export_dtype(dtype), config, max_shard_bytes)
    for name, tensor in _read_in_groups(step_folder, tensors, names, max_shard_bytes):
        writer.add(adapter.hf_name(name), tensor)
    return writer.close()
