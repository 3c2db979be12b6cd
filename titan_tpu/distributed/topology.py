"""Where each rank's chip sits on the TPU interconnect, and the mesh rank order that follows from it.

Each rank contributes one `ChipRecord` (coords, core_on_chip, slice_index, process_index,
device_kind); the records are gathered across ranks, wrapped as duck-typed "devices" and handed to
`jax.experimental.mesh_utils.create_device_mesh` (one slice) or `create_hybrid_device_mesh` (several
slices, dp_replicate spanning them over DCN). jax returns the devices arranged in the logical mesh
shape with the innermost (busiest) axes on the fastest links; the ranks read off that array are the
DeviceMesh layout. jax is only the topology oracle: it never touches a device here.

What jax reads from a device (jax/_src/mesh_utils.py): `.device_kind` (handler lookup), `.platform`
("tpu" selects the torus logic), `.coords` and `.core_on_chip` (physical mesh), `.slice_index` (hybrid
meshes), `.process_index` and `.id` (fallbacks). It expects the devices in jax.devices() order: by
slice, then z, y, x, then core, which is how `_sorted_for_jax` orders the records.

Where a rank's record comes from is a `TopologyProvider`: tests feed recorded topologies
(`RecordedTopology`), TPU hosts read their environment (`TpuEnvironmentProvider`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from titan_tpu.config.errors import ConfigError

logger = logging.getLogger(__name__)

JAX_INSTALL_HINT = "pip install 'titan_tpu[tpu]'  (installs jax, used only to order the TPU mesh)"


@dataclass(frozen=True)
class ChipRecord:
    """One rank's device, in the vocabulary of jax's TPU device objects."""

    rank: int
    coords: tuple[int, int, int]
    core_on_chip: int
    slice_index: int
    process_index: int
    device_kind: str
    platform: str = "tpu"

    @property
    def id(self) -> int:
        # jax only reads `.id` on GPUs (sorting); the rank is a stable stand-in.
        return self.rank

    @property
    def chip(self) -> tuple[int, int, int, int]:
        """(slice, x, y, z): the physical chip, shared by the cores of one chip."""
        return (self.slice_index, *self.coords)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChipRecord:
        return cls(
            rank=int(data["rank"]),
            coords=tuple(int(c) for c in data["coords"]),  # type: ignore[arg-type]
            core_on_chip=int(data.get("core_on_chip", 0)),
            slice_index=int(data.get("slice_index", 0)),
            process_index=int(data.get("process_index", 0)),
            device_kind=str(data["device_kind"]),
            platform=str(data.get("platform", "tpu")),
        )

    def __repr__(self) -> str:  # jax puts devices into its error messages
        return f"Chip(rank={self.rank}, slice={self.slice_index}, coords={self.coords}, core={self.core_on_chip})"


class TopologyProvider(Protocol):
    """Gives the record of the device a rank drives, or None when the position is unknown."""

    def local_record(self, rank: int, local_rank: int) -> ChipRecord | None: ...


@dataclass(frozen=True)
class RecordedTopology:
    """A topology captured earlier (a JSON list of records), replayed rank by rank in tests."""

    name: str
    records: tuple[ChipRecord, ...]

    @classmethod
    def load(cls, path: str | Path) -> RecordedTopology:
        path = Path(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(data.get("name", path.stem), tuple(ChipRecord.from_dict(r) for r in data["records"]))

    def local_record(self, rank: int, local_rank: int) -> ChipRecord | None:
        return self.records[rank]

    def to_json(self) -> str:
        lines = [json.dumps({k: v for k, v in asdict(r).items() if k != "platform"}) for r in self.records]
        return '{"name": "%s", "records": [\n  %s\n]}\n' % (self.name, ",\n  ".join(lines))


# TPU_ACCELERATOR_TYPE prefix -> (jax device_kind, devices per chip). v7x shows both cores as devices.
_ACCELERATOR_KINDS: dict[str, tuple[str, int]] = {
    "v4": ("TPU v4", 1),
    "v5litepod": ("TPU v5 lite", 1),
    "v5e": ("TPU v5 lite", 1),
    "v5p": ("TPU v5p", 1),
    "v6e": ("TPU v6 lite", 1),
    "tpu7x": ("TPU7x", 2),
    "v7x": ("TPU7x", 2),
}


def _bounds(value: str) -> tuple[int, int, int]:
    parts = [int(p) for p in value.split(",")]
    return (parts + [1, 1, 1])[:3]  # type: ignore[return-value]


class TpuEnvironmentProvider:
    """Derives the record from the variables TPU VMs and GKE TPU pods set: TPU_ACCELERATOR_TYPE
    (e.g. v5p-16), TPU_WORKER_ID (host index), TPU_HOST_BOUNDS and TPU_CHIPS_PER_HOST_BOUNDS
    ("x,y,z" hosts per slice and chips per host), MEGASCALE_SLICE_ID (multi-slice jobs).

    A host's chips form a TPU_CHIPS_PER_HOST_BOUNDS block at (host coords x chips per host); hosts and
    chips are numbered x fastest. Local rank i drives chip i // cores_per_chip, core i % cores_per_chip.
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)

    def local_record(self, rank: int, local_rank: int) -> ChipRecord | None:
        env = self.environ
        accelerator = env.get("TPU_ACCELERATOR_TYPE", "")
        kind = next((v for k, v in _ACCELERATOR_KINDS.items() if accelerator.startswith(k)), None)
        if kind is None or "TPU_CHIPS_PER_HOST_BOUNDS" not in env:
            return None
        device_kind, cores_per_chip = kind
        chips = _bounds(env["TPU_CHIPS_PER_HOST_BOUNDS"])
        hosts = _bounds(env.get("TPU_HOST_BOUNDS", "1,1,1"))
        worker = int(env.get("TPU_WORKER_ID", "0"))
        chip = local_rank // cores_per_chip
        host_xyz = (worker % hosts[0], worker // hosts[0] % hosts[1], worker // (hosts[0] * hosts[1]))
        chip_xyz = (chip % chips[0], chip // chips[0] % chips[1], chip // (chips[0] * chips[1]))
        coords = tuple(h * c + o for h, c, o in zip(host_xyz, chips, chip_xyz))
        return ChipRecord(
            rank=rank,
            coords=coords,  # type: ignore[arg-type]
            core_on_chip=local_rank % cores_per_chip,
            slice_index=int(env.get("MEGASCALE_SLICE_ID", "0")),
            process_index=worker,
            device_kind=device_kind,
        )


def gather_records(provider: TopologyProvider, rank: int, local_rank: int) -> list[ChipRecord] | None:
    """Every rank's record, indexed by rank (a collective: all ranks call it). None when any rank
    does not know its position; the caller then falls back to row-major."""
    import torch.distributed as dist

    mine = provider.local_record(rank, local_rank)
    gathered: list[ChipRecord | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if any(r is None for r in gathered):
        return None
    return [r for r in gathered if r is not None]


def _import_mesh_utils() -> Any:
    try:
        from jax.experimental import mesh_utils
    except ImportError as error:
        raise ConfigError(
            f"laying the mesh onto the TPU interconnect needs jax ({error}); {JAX_INSTALL_HINT}"
        ) from None
    return mesh_utils


def _sorted_for_jax(records: Sequence[ChipRecord]) -> list[ChipRecord]:
    return sorted(records, key=lambda r: (r.slice_index, r.coords[2], r.coords[1], r.coords[0], r.core_on_chip))


def describe_topology(records: Sequence[ChipRecord]) -> str:
    """"2 slices of 4x4x1 chips x 1 core (TPU v6 lite)"."""
    slices = sorted({r.slice_index for r in records})
    first = [r for r in records if r.slice_index == slices[0]]
    dims = [max(r.coords[i] for r in first) - min(r.coords[i] for r in first) + 1 for i in range(3)]
    cores = len({r.core_on_chip for r in first})
    where = f"{len(slices)} slices of " if len(slices) > 1 else ""
    return f"{where}{'x'.join(map(str, dims))} chips x {cores} core(s) ({records[0].device_kind})"


def rank_layout(records: Sequence[ChipRecord], names: Sequence[str], sizes: Sequence[int]) -> np.ndarray:
    """Global ranks arranged in the logical mesh `sizes` (outermost first, the first axis being
    dp_replicate), ordered by jax so that inner axes sit on the fastest links. Several slices need
    dp_replicate to be a multiple of the slice count: that axis alone crosses DCN."""
    mesh_utils = _import_mesh_utils()
    sizes = tuple(int(s) for s in sizes)
    logical = " x ".join(f"{n} {s}" for n, s in zip(names, sizes))
    physical = describe_topology(records)
    if math.prod(sizes) != len(records):
        raise ConfigError(
            f"mesh ({logical}) = {math.prod(sizes)} devices cannot be laid onto {physical}: "
            f"{len(records)} devices"
        )
    devices = _sorted_for_jax(records)
    n_slices = len({r.slice_index for r in records})
    try:
        if n_slices == 1:
            array = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        else:
            if sizes[0] % n_slices != 0:
                raise ConfigError(
                    f"mesh ({logical}) cannot be laid onto {physical}: only {names[0]} crosses "
                    f"slices, so it must be a multiple of {n_slices}"
                )
            dcn = (n_slices,) + (1,) * (len(sizes) - 1)
            ici = (sizes[0] // n_slices, *sizes[1:])
            array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    except ConfigError:
        raise
    except (ValueError, NotImplementedError, AssertionError) as error:
        raise ConfigError(f"mesh ({logical}) cannot be laid onto {physical}: {error}") from None
    return np.vectorize(lambda d: d.rank, otypes=[np.int64])(array)


def row_major_layout(sizes: Sequence[int]) -> np.ndarray:
    return np.arange(math.prod(sizes)).reshape(tuple(sizes))


def build_rank_layout(
    device_type: str,
    names: Sequence[str],
    sizes: Sequence[int],
    rank: int,
    local_rank: int,
    provider: TopologyProvider | None = None,
) -> np.ndarray:
    """The mesh rank order for this job: ICI-aware on TPU (or whenever a provider is given), plain
    row-major elsewhere. A collective on TPU: every rank calls it."""
    if device_type != "tpu" and provider is None:
        return row_major_layout(sizes)
    _import_mesh_utils()  # fail early, on every rank, with the install hint
    records = gather_records(provider or TpuEnvironmentProvider(), rank, local_rank)
    if records is None:
        logger.warning("TPU chip positions are unknown on some rank; using a row-major mesh order")
        return row_major_layout(sizes)
    return rank_layout(records, names, sizes)
