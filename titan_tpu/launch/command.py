"""The torchrun command line for this host: the same shape on one machine and on every GKE host.

Every host joins one c10d rendezvous hosted by the first host of slice 0. A c10d rendezvous (not
torchrun's static one) is what restarts the whole job after a failure: when one host's agent
restarts its processes it rejoins the rendezvous, and every other agent sees a host waiting and
restarts its own processes too, so all of them resume together from the newest checkpoint.

torchrun's `--node-rank` is not passed: torchrun reads it only for the static rendezvous and
ignores it (with a warning) under c10d, which numbers the hosts itself when they join. The host's
own rank decides one thing here, which host serves the rendezvous store.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.config.errors import ConfigError
from titan_tpu.launch.environment import HostPlacement

# torchrun's own default port for a c10d rendezvous; every host of a job must use the same one.
DEFAULT_RDZV_PORT = 29400


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


def torchrun_argv(placement: HostPlacement, options: LaunchOptions, nproc_per_node: int) -> list[str]:
    """torchrun's arguments for this host, ending with the script and its arguments."""
    port = rendezvous_port(placement, options.rdzv_port)
    return [
        f"--nnodes={placement.num_hosts}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={placement.first_host}:{port}",
        # Every host derives the same id from the same variables; the store lives and dies with
        # this job's first host, so no other job can share it.
        f"--rdzv-id={placement.first_host}",
        # Said outright rather than left to torchrun's guess (does the endpoint's name resolve to
        # one of this machine's addresses?), which a pod's DNS set-up can get wrong either way.
        f"--rdzv-conf=is_host={str(placement.node_rank == 0).lower()}",
        # The address the other hosts reach this one at, from the host list they share; torchrun
        # would otherwise advertise this machine's own idea of its name.
        f"--local-addr={placement.hostname}",
        f"--max-restarts={options.max_restarts}",
        options.script,
        *options.script_args,
    ]
