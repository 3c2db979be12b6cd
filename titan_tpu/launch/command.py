"""The torchrun command line for this host: the same shape on one machine and on every GKE host.

Every host joins one rendezvous hosted by the first host of slice 0, with `--rdzv-backend=c10d-node-rank`
(titan_tpu.launch.rendezvous): torchrun's c10d rendezvous, except that each host's rank is the one
given here. c10d is what restarts the whole job after a failure: when one host's agent restarts
its processes it rejoins the rendezvous, every other agent sees a host waiting and restarts its
own processes too, and all of them resume together from the newest checkpoint. torchrun's static
rendezvous (`--node-rank`) does not: each agent restarts on its own, into the one store static
keeps for the whole job, and the restarted processes hang on the previous attempt's keys.

The rank is decided here because c10d's own order (its hosts sorted by address) is not the TPU
runtime's: TorchTPU gives global rank r the slice-builder address of host NODE_RANK = r // processes
per host, NODE_RANK being the host's place by chip coordinates or its completion index, and a
sorted `job-0-10.job` lands before `job-0-2.job`. On a TPU host the rank is TorchTPU's NODE_RANK
(slices first, then NODE_RANK within the slice); elsewhere it is the host's place in the GKE host
list. The MASTER_ADDR / MASTER_PORT TorchTPU also writes reach no worker: torchrun sets both for
every worker to the store that node rank 0 serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.config.errors import ConfigError
from titan_tpu.launch.environment import HostPlacement

# torchrun's own default port for a c10d rendezvous; every host of a job must use the same one.
DEFAULT_RDZV_PORT = 29400
# The rendezvous backend titan_tpu.launch.rendezvous registers, and its --rdzv-conf key for the rank.
# Named here, where no torch import is needed: the launcher checks its variables before importing torch.
BACKEND = "c10d-node-rank"
NODE_RANK_KEY = "node_rank"


@dataclass(frozen=True)
class LaunchOptions:
    """The launcher's own flags, and the training script with its arguments, passed on verbatim."""

    nproc_per_node: int | None  # None: one process per accelerator device of this host
    max_restarts: int
    rdzv_port: int | None  # None: DEFAULT_RDZV_PORT across hosts, any free port on one host
    dns_timeout_s: float
    script: str
    script_args: tuple[str, ...]


def rendezvous_port(placement: HostPlacement, requested: int | None) -> int:
    if requested is None:
        # Port 0 lets the one host's store take any free port, as `torchrun --standalone` does,
        # so that two single-host runs on one machine do not collide.
        return DEFAULT_RDZV_PORT if placement.num_hosts > 1 else 0
    if requested == 0 and placement.num_hosts > 1:
        raise ConfigError(
            f"--rdzv-port 0 (any free port) works on one host only; this job has {placement.num_hosts} hosts, "
            f"which must agree on a port (default {DEFAULT_RDZV_PORT})"
        )
    return requested


def torchrun_argv(placement: HostPlacement, options: LaunchOptions, nproc_per_node: int, node_rank: int) -> list[str]:
    """torchrun's arguments for this host, ending with the script and its arguments. `node_rank`
    places this host's processes at global ranks node_rank * nproc_per_node onwards."""
    if not 0 <= node_rank < placement.num_hosts:
        raise ConfigError(
            f"node rank {node_rank} is out of range: the job has {placement.num_hosts} host(s), "
            f"so 0 to {placement.num_hosts - 1}"
        )
    port = rendezvous_port(placement, options.rdzv_port)
    return [
        f"--nnodes={placement.num_hosts}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={BACKEND}",
        f"--rdzv-endpoint={placement.first_host}:{port}",
        # Every host derives the same id from the same variables; the store lives and dies with
        # this job's first host, so no other job can share it.
        f"--rdzv-id={placement.first_host}",
        # is_host: said outright rather than left to torchrun's guess (does the endpoint's name
        # resolve to one of this machine's addresses?), which a pod's DNS set-up can get wrong
        # either way. The first host of slice 0 serves the rendezvous whatever its node rank.
        f"--rdzv-conf=is_host={str(placement.node_rank == 0).lower()},{NODE_RANK_KEY}={node_rank}",
        # The address the other hosts reach this one at, from the host list they share; torchrun
        # would otherwise advertise this machine's own idea of its name.
        f"--local-addr={placement.hostname}",
        f"--max-restarts={options.max_restarts}",
        options.script,
        *options.script_args,
    ]
