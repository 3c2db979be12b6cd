"""torchrun's c10d rendezvous, with each host's rank given by the launcher instead of c10d's own order.

c10d numbers the hosts of every round by sorting their node descriptors (address, then process id),
an order it does not document and one that is wrong for a TPU slice: with GKE host names it puts
`job-0-10.job` before `job-0-2.job`, while TorchTPU hands rank r the slice-builder address of host
NODE_RANK = r // processes-per-host. The static rendezvous takes `--node-rank`, but restarts nothing
across hosts: a restarted host's new processes re-read the previous attempt's keys from the one
store that static keeps for the whole job and hang in process-group creation.

This backend keeps everything c10d does across hosts (rounds, and a restart of every host when one
host restarts) and replaces one thing in what a round returns: the rank of this host, which the
launcher knows (`--rdzv-conf=node_rank=R`). `RendezvousHandler` and its registry are torchrun's
documented extension point; the wrapped handler is c10d's own, built by its public factories.
"""

from __future__ import annotations

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from titan_tpu.launch.command import BACKEND, NODE_RANK_KEY

# The keys this backend writes into a round's store, apart from c10d's own.
KEY_PREFIX = "titan_tpu.node_rank"


class NodeRankError(RuntimeError):
    """Two hosts claimed one rank, or a rank lies outside the job: the job cannot start."""


class NodeRankRendezvous(RendezvousHandler):
    """A c10d handler whose rounds report this host's rank as `node_rank`."""

    def __init__(self, c10d: RendezvousHandler, node_rank: int, local_addr: str | None) -> None:
        self._c10d = c10d
        self._node_rank = node_rank
        self._local_addr = local_addr

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        # The workers' global rank 0 hosts a fresh store in every round (at the address below),
        # as c10d does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. A store shared with the agents
        # outlives a restart, and the restarted process group reads the dead processes' addresses.
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._c10d.next_rendezvous()
        rank, world_size = self._node_rank, info.world_size
        if not 0 <= rank < world_size:
            raise NodeRankError(f"node rank {rank} is outside the job's {world_size} hosts (0 to {world_size - 1})")
        # The round's store is fresh every round (c10d prefixes it with the round number).
        ours = PrefixStore(KEY_PREFIX, info.store)
        claims = ours.add(f"claims/{rank}", 1)
        if claims > 1:
            raise NodeRankError(
                f"node rank {rank} is claimed by {claims} hosts; every host of the job needs its own "
                f"(host {self._local_addr})"
            )
        # Global rank 0 runs on node rank 0, so that host publishes where it will serve the workers'
        # store; c10d's own bootstrap address is its rank 0's, which can be another host.
        bootstrap = RendezvousStoreInfo.build(rank, ours, local_addr=self._local_addr)
        return RendezvousInfo(info.store, rank, world_size, bootstrap)

    def is_closed(self) -> bool:
        return self._c10d.is_closed()

    def set_closed(self) -> None:
        self._c10d.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._c10d.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._c10d.get_run_id()

    def shutdown(self) -> bool:
        return self._c10d.shutdown()


def create_node_rank_handler(params: RendezvousParameters) -> RendezvousHandler:
    node_rank = params.get_as_int(NODE_RANK_KEY)
    if node_rank is None:
        raise ValueError(f"the {BACKEND} rendezvous needs --rdzv-conf={NODE_RANK_KEY}=R")
    store_backend, store = create_backend(params)
    return NodeRankRendezvous(create_handler(store, store_backend, params), node_rank, params.local_addr)


def register() -> None:
    """Makes `--rdzv-backend=c10d-node-rank` known to torchrun in this process (again: no effect)."""
    rendezvous_handler_registry.register(BACKEND, create_node_rank_handler)
