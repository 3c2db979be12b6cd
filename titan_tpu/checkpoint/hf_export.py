"""Our weights out to a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained`
(or, for FLUX.1, diffusers' `FluxTransformer2DModel.from_pretrained`) loads: `config.json` from the
flavor plus `model.safetensors` (or shards with the index; diffusers' file names where the adapter's
`weights_stem` says so, `titan_tpu.checkpoint.hf_format.HFFiles`), names and layout from the model
family's adapter (`StateDictAdapter.export_layouts`: stacked tensors such as Qwen 3 MoE experts are
written one HF tensor per slice, the hf family's as transformers' save_pretrained writes them). In:
`titan_tpu.checkpoint.hf_import`.

From a live model: one tensor at a time is gathered (`full_tensor()` for DTensors, all ranks in the same
order), the folder tensors it completes are assembled (`hf_format.FolderAssembly`), cast to the export
dtype and written by rank 0 into shards of bounded size. From a checkpoint folder (offline, one
process): about one shard's worth of tensors is read at a time. Either way the folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from titan_tpu.checkpoint import layout
from titan_tpu.checkpoint.hf_format import (
    CONFIG_FILE,
    TRANSFORMERS_FILES,
    FolderAssembly,
    HFFiles,
    StartProgress,
    tied_repeats,
)
from titan_tpu.checkpoint.storage import (
    METADATA_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_files,
    quiet_single_process,
    read_metadata_file,
)
from titan_tpu.config.errors import ConfigError
from titan_tpu.device.dtype import dtype_from_name
from titan_tpu.protocols.state_dict_adapter import StateDictAdapter

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


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
        files: HFFiles = TRANSFORMERS_FILES,
        extra_files: Mapping[str, Path] | None = None,
    ) -> None:
        self.out = Path(out)
        self.files = files
        self.extra_files = dict(extra_files or {})  # name in the folder -> file copied there (tokenizer)
        refuse_non_empty(self.out)
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
            name: files.single if count == 1 else files.shard(i + 1, count)
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
            (self.temp / self.files.index).write_text(json.dumps(index, indent=2), encoding="utf-8")
        dtype_name = str(self.dtype).removeprefix("torch.")
        config = {**self.config, **{key: dtype_name for key in self.files.dtype_keys}}
        (self.temp / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        for name, source in self.extra_files.items():
            shutil.copyfile(source, self.temp / name)
        if self.out.exists():
            self.out.rmdir()  # empty, checked at construction
        self.temp.rename(self.out)
        return self.out


def refuse_non_empty(out: Path) -> None:
    """An export's folder is written whole or not at all: an existing one with anything in it is refused."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export: {out} exists and is not empty; it is never overwritten")


def export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """checkpoint.export_dtype's name (or a dtype) as the dtype the folder's tensors are written in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return dtype_from_name(dtype, "checkpoint.export_dtype")


# Parameter names of a low-rank adapter beside the weight it adapts (titan_tpu/models/common/lora.py).
LORA_FACTORS = ("lora_A", "lora_B")


def is_lora_factor(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_FACTORS


def exportable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict (DTensors where sharded) without the names a tied tensor repeats under."""
    repeats = tied_repeats(model)
    # A model's state dict holds tensors only; torch's type also covers optimizer states.
    model_state = cast(dict[str, torch.Tensor], get_model_state_dict(model))
    return {name: value for name, value in model_state.items() if name not in repeats}


def gathered(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective for a DTensor, so every rank calls it for the same tensors in
    the same order."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def export_model_to_hf(
    model: nn.Module,
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, Path] | None = None,
) -> Path | None:
    """Export a live (possibly sharded) model; every rank calls it, rank 0 writes. Returns the folder
    on rank 0, None elsewhere. `extra_files` (the tokenizer's, `chat_tokenizer.tokenizer_export_files`)
    are copied in beside the weights. A model with LoRA adapters is refused: its base weights alone
    are not the trained model, and a Hugging Face folder has no place for the factors."""
    state_dict = exportable_state(model)
    factors = [name for name in state_dict if is_lora_factor(name)]
    if factors:
        raise ConfigError(
            f"export: the model has LoRA adapters ({factors[0]}, ...); write it merged "
            "(titan_tpu.lora.merge.export_merged_to_hf) or its adapters as a PEFT folder "
            "(titan_tpu.lora.peft_export.export_peft_adapter)"
        )
    shapes = {name: tuple(value.shape) for name, value in state_dict.items()}
    tensors = ((name, gathered(value)) for name, value in state_dict.items())
    return export_tensors_to_hf(tensors, shapes, out, adapter, args, dtype, max_shard_bytes, extra_files)


def export_tensors_to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]],
    shapes: Mapping[str, tuple[int, ...]],
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, Path] | None = None,
) -> Path | None:
    """Our whole tensors (`shapes`, in the order `tensors` yields them) as a Hugging Face folder.
    Every rank calls it and iterates `tensors`, which may gather (`gathered`); rank 0 writes. Returns
    the folder on rank 0, None elsewhere."""
    out = Path(out)
    refuse_non_empty(out)  # checked on every rank, so none is left in a collective
    distributed = dist.is_available() and dist.is_initialized()
    writes = not distributed or dist.get_rank() == 0
    layouts = adapter.export_layouts(args, shapes)
    plan = [(hf_name, layout.shape) for hf_name, layout in layouts.items()]
    assembly = FolderAssembly(layouts)
    writer = None
    if writes:
        config = adapter.to_hf_config(args)
        writer = HFFolderWriter(
            out, plan, export_dtype(dtype), config, max_shard_bytes, HFFiles.of(adapter), extra_files
        )
    for name, full in tensors:
        if writer is not None:
            for hf_name, tensor in assembly.add(name, full):
                writer.add(hf_name, tensor)
        del full
    result = writer.close() if writer is not None else None
    if distributed:
        dist.barrier()
    return result


def checkpoint_model_tensors(step_folder: Path, data_files: bool = True) -> dict[str, TensorStorageMetadata]:
    """The model's tensors a complete step folder holds, by our names. Its files are checked against
    the manifest first: every one, or with `data_files=False` only the metadata (the data files' CRC-32
    reads the whole checkpoint: enough to tell what the folder holds before a conversion that checks
    them itself)."""
    manifest = layout.read_manifest(step_folder)
    checked = sorted(manifest["files"]) if data_files else [METADATA_FILE]
    problem = check_files(step_folder, manifest["files"], checked)
    if problem is not None:
        raise ConfigError(str(problem))
    metadata = read_metadata_file(step_folder / METADATA_FILE)
    return {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }


def _nbytes(md: TensorStorageMetadata) -> int:
    return int(torch.Size(md.size).numel()) * torch.empty((), dtype=md.properties.dtype).element_size()


def _read_in_groups(
    step_folder: Path, tensors: dict[str, TensorStorageMetadata], names: list[str], group_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    group: list[str] = []
    size = 0

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        state = {f"model.{n}": torch.empty(tuple(tensors[n].size), dtype=tensors[n].properties.dtype) for n in group}
        reader = SafeFileSystemReader(step_folder)
        with quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        for n in group:
            yield n, state.pop(f"model.{n}")

    for name in names:
        nbytes = _nbytes(tensors[name])
        if group and size + nbytes > group_bytes:
            yield from flush()
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield from flush()


def read_checkpoint_model_tensors(
    step_folder: Path, tensors: dict[str, TensorStorageMetadata]
) -> dict[str, torch.Tensor]:
    """The step folder's model tensors `tensors` names (some of `checkpoint_model_tensors`' answer),
    whole, in one read: for a few small ones (a LoRA run's adapters)."""
    names = list(tensors)
    return dict(_read_in_groups(step_folder, tensors, names, group_bytes=sum(map(_nbytes, tensors.values()))))


def export_checkpoint_to_hf(
    step_folder: str | Path,
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    expected_shapes: dict[str, tuple[int, ...]],
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: StartProgress | None = None,
    extra_files: Mapping[str, Path] | None = None,
) -> Path:
    """Offline, one process: a complete checkpoint step folder -> Hugging Face folder, reading at most
    about one shard's worth of tensors at a time. `expected_shapes` (our names) is the flavor's;
    `progress`, when given, hears of each Hugging Face tensor written (and its bytes)."""
    step_folder = Path(step_folder)
    if not layout.is_complete(step_folder):
        raise ConfigError(f"export: {step_folder} is not a complete checkpoint step folder")
    tensors = checkpoint_model_tensors(step_folder)
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
    layouts = adapter.export_layouts(args, {n: tuple(expected_shapes[n]) for n in names})
    plan = [(hf_name, layout.shape) for hf_name, layout in layouts.items()]
    assembly = FolderAssembly(layouts)
    config = adapter.to_hf_config(args)
    files = HFFiles.of(adapter)
    writer = HFFolderWriter(Path(out), plan, export_dtype(dtype), config, max_shard_bytes, files, extra_files)
    reporter = progress(len(plan), writer.total_size) if progress is not None else None
    for name, tensor in _read_in_groups(step_folder, tensors, names, max_shard_bytes):
        for hf_name, part in assembly.add(name, tensor):
            writer.add(hf_name, part)
            if reporter is not None:
                reporter.advance(1, part.numel() * writer.dtype.itemsize)
    folder = writer.close()
    if reporter is not None:
        reporter.finish()
    return folder
