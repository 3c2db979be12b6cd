"""Where this host sits in the job, read from the variables GKE sets in a TPU pod.

GKE's TPU webhook gives every pod of an indexed Job (or a JobSet's child Job; xpk workloads are
JobSets) the variables below. A multislice JobSet adds the MEGASCALE ones, one child Job per slice:

    TPU_WORKER_HOSTNAMES           the hosts of this slice, comma-separated, in worker-id order
    TPU_WORKER_ID                  this host's index in that list
    JOB_COMPLETION_INDEX           the pod's index in its indexed Job; GKE derives TPU_WORKER_ID from it
    TPU_ACCELERATOR_TYPE           e.g. "v6e-16", "v5litepod-16", "tpu7x-16"
    TPU_CHIPS_PER_HOST_BOUNDS      the chip grid of one host, e.g. "2,2,1" (4 chips)
    MEGASCALE_NUM_SLICES           slices in the job (absent or 1: one slice)
    MEGASCALE_SLICE_ID             this slice's index
    MEGASCALE_COORDINATOR_ADDRESS  the first host of slice 0 ("host" or "host:port")

TPU_WORKER_HOSTNAMES only lists this slice's hosts, so hosts of other slices find the first host
of slice 0 through MEGASCALE_COORDINATOR_ADDRESS. With none of the variables set (a workstation,
a single VM) the host is the only one, named "localhost", and the same launch path runs. On a TPU
host the rank torchrun gets is TorchTPU's (`torch_tpu_node_rank`), which orders hosts by their chips'
coordinates when it knows them, not by the host list.

Every malformed value is one ConfigError naming the variable. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from titan_tpu.config.errors import ConfigError

HOSTNAMES = "TPU_WORKER_HOSTNAMES"
WORKER_ID = "TPU_WORKER_ID"
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"
CHIPS_PER_HOST_BOUNDS = "TPU_CHIPS_PER_HOST_BOUNDS"
NUM_SLICES = "MEGASCALE_NUM_SLICES"
SLICE_ID = "MEGASCALE_SLICE_ID"
COORDINATOR = "MEGASCALE_COORDINATOR_ADDRESS"
# Written by TorchTPU's set_tpu_launch_env on a TPU host, not by GKE: this host's rank in its slice.
TORCH_TPU_NODE_RANK = "NODE_RANK"

# Their presence is what tells a GKE / xpk pod from a plain machine.
PLACEMENT_VARIABLES = (HOSTNAMES, WORKER_ID, COMPLETION_INDEX, NUM_SLICES, SLICE_ID, COORDINATOR)
LOCAL_HOST = "localhost"


@dataclass(frozen=True)
class HostPlacement:
    """This host's place in the job: its slice, its index there, and the first host of slice 0."""

    hostnames: tuple[str, ...]  # the hosts of this slice
    worker_id: int
    num_slices: int
    slice_id: int
    first_host: str  # first host of slice 0: the rendezvous point of the whole job
    accelerator_type: str | None
    chips_per_host: int | None
    from_gke: bool

    @property
    def hosts_per_slice(self) -> int:
        return len(self.hostnames)

    @property
    def num_hosts(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def node_rank(self) -> int:
        """Slices are numbered first, then hosts within a slice."""
        return self.slice_id * self.hosts_per_slice + self.worker_id

    @property
    def hostname(self) -> str:
        return self.hostnames[self.worker_id]

    def describe(self) -> str:
        if not self.from_gke:
            return "no GKE TPU variables set: one host (localhost)"
        chips = f" x {self.chips_per_host} chips" if self.chips_per_host is not None else ""
        kind = f"{self.accelerator_type} " if self.accelerator_type else ""
        return (
            f"GKE {kind}slice {self.slice_id} of {self.num_slices} ({self.hosts_per_slice} hosts{chips}), "
            f"worker {self.worker_id} ({self.hostname}): host {self.node_rank} of {self.num_hosts}"
        )


def read_placement(environ: Mapping[str, str]) -> HostPlacement:
    """This host's placement from the environment (GKE variables, or none: one local host)."""
    if not any(name in environ for name in PLACEMENT_VARIABLES):
        return HostPlacement((LOCAL_HOST,), 0, 1, 0, LOCAL_HOST, None, None, from_gke=False)
    hostnames = _hostnames(environ)
    worker_id = _worker_id(environ, len(hostnames))
    num_slices = _integer(environ, NUM_SLICES, minimum=1) if NUM_SLICES in environ else 1
    slice_id = _integer(environ, SLICE_ID, minimum=0) if SLICE_ID in environ else 0
    if slice_id >= num_slices:
        raise ConfigError(
            f"{SLICE_ID}={slice_id} is out of range: {NUM_SLICES}={num_slices} allows 0 to {num_slices - 1}"
        )
    return HostPlacement(
        hostnames=hostnames,
        worker_id=worker_id,
        num_slices=num_slices,
        slice_id=slice_id,
        first_host=_first_host(environ, hostnames, num_slices),
        accelerator_type=environ.get(ACCELERATOR_TYPE) or None,
        chips_per_host=_chips_per_host(environ),
        from_gke=True,
    )


def _hostnames(environ: Mapping[str, str]) -> tuple[str, ...]:
    if HOSTNAMES not in environ:
        present = ", ".join(name for name in PLACEMENT_VARIABLES if name in environ)
        raise ConfigError(
            f"{HOSTNAMES} is not set but {present} is: a GKE TPU pod has the comma-separated host names "
            "of its slice there; set it, or unset the others to launch on this machine alone"
        )
    raw = environ[HOSTNAMES]
    names = tuple(name.strip() for name in raw.split(","))
    for position, name in enumerate(names):
        if not name:
            raise ConfigError(
                f"{HOSTNAMES}={raw!r} has an empty host name at position {position}; "
                "expected comma-separated host names or IP addresses, e.g. 'host-0.job,host-1.job'"
            )
    return names


def _worker_id(environ: Mapping[str, str], num_hosts: int) -> int:
    worker_id = _integer(environ, WORKER_ID, minimum=0) if WORKER_ID in environ else None
    index = _integer(environ, COMPLETION_INDEX, minimum=0) if COMPLETION_INDEX in environ else None
    if worker_id is not None and index is not None and worker_id != index:
        raise ConfigError(
            f"{WORKER_ID}={worker_id} but {COMPLETION_INDEX}={index}: GKE derives the worker id from the "
            "pod's completion index, so one of them was overridden; remove the override"
        )
    chosen = worker_id if worker_id is not None else index
    if chosen is None:
        if num_hosts > 1:
            raise ConfigError(
                f"neither {WORKER_ID} nor {COMPLETION_INDEX} is set, so this host's place among the "
                f"{num_hosts} hosts of {HOSTNAMES} is unknown; set {WORKER_ID} (0 to {num_hosts - 1})"
            )
        return 0
    name = WORKER_ID if worker_id is not None else COMPLETION_INDEX
    if chosen >= num_hosts:
        raise ConfigError(
            f"{name}={chosen} is out of range: {HOSTNAMES} lists {num_hosts} host(s), so 0 to {num_hosts - 1}"
        )
    return chosen


def _first_host(environ: Mapping[str, str], hostnames: tuple[str, ...], num_slices: int) -> str:
    """Slice 0's own list names its first host; other slices only know it from the coordinator."""
    if num_slices == 1:
        return hostnames[0]
    raw = environ.get(COORDINATOR, "").strip()
    if not raw:
        raise ConfigError(
            f"{NUM_SLICES}={num_slices} but {COORDINATOR} is not set: hosts of other slices need the "
            "address of the first host of slice 0 there ('host' or 'host:port')"
        )
    host, colon, port = raw.rpartition(":")
    if colon and port.isdigit() and host and not host.endswith(":"):  # "host:port", not a bare IPv6 address
        raw = host
    return raw.strip("[]")


def _chips_per_host(environ: Mapping[str, str]) -> int | None:
    raw = environ.get(CHIPS_PER_HOST_BOUNDS)
    if raw is None:
        return None
    try:
        bounds = [int(part) for part in raw.split(",")]
    except ValueError:
        bounds = []
    if not bounds or any(bound < 1 for bound in bounds):
        raise ConfigError(
            f"{CHIPS_PER_HOST_BOUNDS}={raw!r} is not a chip grid; expected positive integers separated by "
            "commas, e.g. '2,2,1'"
        )
    return math.prod(bounds)


def _integer(environ: Mapping[str, str], name: str, minimum: int) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; expected an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is out of range; expected an integer >= {minimum}")
    return value


def torch_tpu_node_rank(placement: HostPlacement, environ: Mapping[str, str]) -> int:
    """This host's rank in the job from the NODE_RANK TorchTPU's set_tpu_launch_env wrote: its place
    within the slice (by chip coordinates, else the completion index), after the slices before it."""
    raw = environ.get(TORCH_TPU_NODE_RANK)
    if raw is None:
        # One host without a completion index: TorchTPU takes the single-host path and writes none.
        if placement.hosts_per_slice == 1:
            return placement.node_rank
        raise ConfigError(
            f"TorchTPU's set_tpu_launch_env wrote no {TORCH_TPU_NODE_RANK} for a slice of {placement.hosts_per_slice} "
            "hosts, so this host's place among them is unknown; set it (0 to "
            f"{placement.hosts_per_slice - 1})"
        )
    rank_in_slice = _integer(environ, TORCH_TPU_NODE_RANK, minimum=0)
    if rank_in_slice >= placement.hosts_per_slice:
        raise ConfigError(
            f"{TORCH_TPU_NODE_RANK}={rank_in_slice} is out of range: {HOSTNAMES} lists "
            f"{placement.hosts_per_slice} host(s), so 0 to {placement.hosts_per_slice - 1}"
        )
    return placement.slice_id * placement.hosts_per_slice + rank_in_slice
