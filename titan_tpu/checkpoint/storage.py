"""What touches checkpoint bytes: a reader that never runs code from a file, a writer that records
checksums, and the check of a step folder against its manifest.

`torch.distributed.checkpoint` reads its `.metadata` with `pickle.load` and non-tensor items with
`torch.load(weights_only=False)`; both would run whatever a crafted file asks. Here the metadata is
unpickled with an allow-list of the classes DCP itself writes, and every item with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titan_tpu.config.errors import ConfigError

METADATA_FILE = ".metadata"
CHECKSUM_SUFFIX = "checksums.json"
_CHUNK = 16 << 20

# DCP warns on every single-process save/load that it assumes a single process; so do we.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """The same filter where the global one was reset (pytest resets it for every test)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


_METADATA_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's own metadata classes, torch dtypes and sizes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def read_metadata_file(path: Path) -> Metadata:
    """Unpickle a DCP `.metadata` file with the allow-list; ConfigError naming the file on failure."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path.parent}: file {path.name} is missing") from None
    except Exception as e:  # any unpickling failure means the file is not what DCP wrote
        raise ConfigError(
            f"checkpoint {path.parent}: file {path.name} is unreadable ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"checkpoint {path.parent}: file {path.name} holds no DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with the allow-listed unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def file_digest(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a file (CRC-32 catches torn and flipped bytes; it is no defence against
    someone who wants to forge a checkpoint, which the loader's allow-lists are for)."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that, once this rank's files are written and synced, records their size and
    CRC-32 in `__<rank>_checksums.json` beside them.

    DCP's coordinator writes `.metadata` only after every rank's `write_data` returned, so when a save
    completes every rank's checksum file is there too; the commit folds them into the manifest.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        results = future.wait()
        folder = Path(self.path)
        names = sorted({result.storage_data.relative_path for result in results})
        digests = {name: file_digest(folder / name) for name in names}
        target = folder / f"{plan.storage_data.prefix}{CHECKSUM_SUFFIX}"
        write_json_durably(target, digests)
        return future


def write_json_durably(path: Path, data: Any) -> None:
    """Write JSON to a temporary name, fsync, and rename over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Damage:
    """What is wrong with a checkpoint folder: `why`, one word for the name the folder is moved aside
    under (missing, truncated, extended, corrupted, unlisted, manifest), and `message`, one line that
    names the folder and the file."""

    why: str
    message: str

    def __str__(self) -> str:
        return self.message


def check_files(folder: Path, files: dict[str, dict[str, int]], names: list[str]) -> Damage | None:
    """The first problem with `names` (a subset of the manifest's files), or None when all are intact."""
    for name in names:
        expected = files[name]
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return Damage("missing", f"checkpoint {folder}: file {name} is missing")
        if size != expected["size"]:
            why, kind = ("truncated", "truncated") if size < expected["size"] else ("extended", "longer than written")
            sizes = f"{size} bytes, manifest says {expected['size']}"
            return Damage(why, f"checkpoint {folder}: file {name} is {kind} ({sizes})")
        if file_digest(path)["crc32"] != expected["crc32"]:
            return Damage(
                "corrupted", f"checkpoint {folder}: file {name} is corrupted (CRC-32 differs from the manifest)"
            )
    return None


def referenced_files(metadata: Metadata) -> set[str]:
    """Data files the metadata points into."""
    return {info.relative_path for info in metadata.storage_data.values()}


def describe_error(error: BaseException) -> str:
    """One line for an error, the rank's own exception rather than DCP's wrapper of tracebacks."""
    # DCP wraps each rank's exception in a CheckpointException whose text is a traceback dump.
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, stack summary)
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            error = inner[0]
    text = f"{type(error).__name__}: {error}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
