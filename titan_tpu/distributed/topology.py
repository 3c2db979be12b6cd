"""The mesh's rank order: laid onto the TPU interconnect by torch_tpu, plain row-major elsewhere.

On TPU the order comes from `torch.tpu.distributed.topology_aware_mesh`, which all-gathers every
rank's chip (coordinates, core, slice) from the TPU runtime and arranges the ranks so that the
innermost logical axes land on the fastest physical links. Its `mesh_shape` is "ordered by
increasing network intensity": the outermost axis talks least, the last axis most. That is exactly
our axis order ([pp,] dp_replicate, dp_shard[, ep], tp), so the sizes are passed as they are.

Several slices (a multi-slice job, linked over the data-centre network, DCN) are split along the
first axis alone, dp_replicate (or pp, the outermost with pipeline parallelism: one activation per
micro-batch then crosses DCN, and no gradient reduction does): `dcn_mesh_shape` is always given,
(slices, 1, ..., 1), so the library never picks another axis by itself (with dp_replicate = 1 it
would split dp_shard, putting FSDP traffic on DCN). The slice count is the launcher's MEGASCALE_NUM_SLICES, the variable libtpu itself reads for
multi-slice jobs; when it disagrees with the slices the chips report, the library refuses.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from titan_tpu.config.errors import ConfigError
from titan_tpu.device.tpu_api import TPU_INSTALL_HINT, torch_tpu_function

logger = logging.getLogger(__name__)

SLICE_COUNT_VARIABLE = "MEGASCALE_NUM_SLICES"


def tpu_slice_count(environ: Mapping[str, str] | None = None) -> int:
    """How many TPU slices the job spans, as the launcher declared it (1 when it did not)."""
    environ = os.environ if environ is None else environ
    value = environ.get(SLICE_COUNT_VARIABLE, "1")
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(
            f"{SLICE_COUNT_VARIABLE}={value!r}: expected a positive integer, the number of TPU "
            "slices of a multi-slice job (unset or 1 for one slice)"
        )
    return count


def describe_mesh(names: Sequence[str], sizes: Sequence[int]) -> str:
    """ "dp_replicate 2 x dp_shard 8 x tp 2"."""
    return " x ".join(f"{name} {size}" for name, size in zip(names, sizes))


def dcn_mesh_shape(names: Sequence[str], sizes: Sequence[int], slices: int) -> tuple[int, ...]:
    """The inter-slice split: every slice on the first axis (dp_replicate, or pp), none elsewhere."""
    if sizes[0] % slices != 0:
        raise ConfigError(
            f"mesh ({describe_mesh(names, sizes)}) cannot span {slices} TPU slices: only "
            f"{names[0]} crosses slices (over DCN), so {names[0]} must be a multiple of {slices}"
        )
    return (slices,) + (1,) * (len(sizes) - 1)


def tpu_rank_layout(names: Sequence[str], sizes: Sequence[int], slices: int) -> np.ndarray:
    """Global ranks in the logical mesh `sizes` (outermost first), placed by torch_tpu on the ICI
    torus of each slice, with dp_replicate spread over the `slices`. A collective: every rank
    calls it, and every rank gets the same array."""
    sizes = tuple(int(s) for s in sizes)
    dcn = dcn_mesh_shape(names, sizes, slices)
    try:
        topology_aware_mesh = torch_tpu_function("torch.tpu.distributed.topology_aware_mesh")
    except ImportError as error:
        raise ConfigError(
            f"laying the mesh onto TPU chips needs the torch_tpu package ({error}); {TPU_INSTALL_HINT}"
        ) from None
    try:
        # Splitting a physical axis between two logical ones is what makes, e.g., tp 2 x dp_shard 8
        # possible on a 4x4 slice; the library still keeps each logical axis on neighbouring chips.
        layout = topology_aware_mesh(sizes, dcn_mesh_shape=dcn, allow_split_physical_axes=True)
    except (ValueError, AssertionError, NotImplementedError) as error:
        # The library's reason names the device counts and shapes it saw; ours names the request.
        where = f"{slices} slices ({SLICE_COUNT_VARIABLE}={slices})"
        if slices == 1:
            where = f"1 slice ({SLICE_COUNT_VARIABLE} unset or 1)"
        raise ConfigError(
            f"mesh ({describe_mesh(names, sizes)}) over {where} cannot be laid onto the TPU interconnect: {error}"
        ) from None
    return layout.numpy().astype(np.int64)


def row_major_layout(sizes: Sequence[int]) -> np.ndarray:
    return np.arange(math.prod(sizes), dtype=np.int64).reshape(tuple(sizes))


def build_rank_layout(
    device_type: str,
    names: Sequence[str],
    sizes: Sequence[int],
    rank: int,
) -> np.ndarray:
    """The mesh rank order for this job: topology-aware on TPU, row-major elsewhere. A collective
    on TPU: every rank calls it. `rank` picks the one rank that logs the layout (torch_tpu finds
    each rank's chip itself)."""
    if device_type != "tpu":
        return row_major_layout(sizes)
    slices = tpu_slice_count()
    layout = tpu_rank_layout(names, sizes, slices)
    if rank == 0:
        logger.info(
            "TPU mesh (%s) laid onto the interconnect by torch_tpu over %d slice(s); tp groups: %s",
            describe_mesh(names, sizes),
            slices,
            layout.reshape(-1, layout.shape[-1])[:2].tolist(),
        )
    return layout
