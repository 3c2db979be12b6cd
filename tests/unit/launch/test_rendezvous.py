"""The launcher's rendezvous backend on one store in this process: c10d's round (faked) says one rank,
the backend reports the launcher's, and node rank 0 publishes where the workers' store will be."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters, RendezvousStoreInfo

from titan_tpu.launch.rendezvous import NodeRankError, NodeRankRendezvous, create_node_rank_handler


class FakeC10d:
    """One host's c10d handler after a round of `world_size` hosts in which it got `rank`; c10d's
    bootstrap address is its own rank 0's."""

    def __init__(self, store: HashStore, rank: int, world_size: int = 2) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.calls: list[str] = []

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(self.store, self.rank, self.world_size, RendezvousStoreInfo("c10d-rank-0", 1))

    def num_nodes_waiting(self) -> int:
        self.calls.append("num_nodes_waiting")
        return 1

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append(name) or True


def round_store() -> HashStore:
    store = HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    return store


def test_each_host_gets_the_launchers_rank_not_c10ds() -> None:
    store = round_store()
    # c10d sorted the hosts the other way round: "job-0-10" before "job-0-2".
    first = NodeRankRendezvous(FakeC10d(store, rank=1), node_rank=0, local_addr="job-0-2")  # type: ignore[arg-type]
    second = NodeRankRendezvous(FakeC10d(store, rank=0), node_rank=1, local_addr="job-0-10")  # type: ignore[arg-type]
    infos = [first.next_rendezvous(), second.next_rendezvous()]
    assert [(info.rank, info.world_size) for info in infos] == [(0, 2), (1, 2)]
    # Both hosts' workers meet at node rank 0's host, where global rank 0 runs, on one port.
    addresses = {(info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) for info in infos}
    assert len(addresses) == 1 and next(iter(addresses))[0] == "job-0-2"
    assert next(iter(addresses))[1] != 1  # not c10d's
    assert infos[0].store is store  # the agents keep c10d's round store (ranks of workers, exit barrier)


def test_workers_do_not_share_the_agents_store() -> None:
    handler = NodeRankRendezvous(FakeC10d(round_store(), rank=0), node_rank=0, local_addr="a")  # type: ignore[arg-type]
    assert handler.use_agent_store is False


def test_everything_but_the_rank_is_c10ds() -> None:
    c10d = FakeC10d(round_store(), rank=0)
    handler = NodeRankRendezvous(c10d, node_rank=0, local_addr="a")  # type: ignore[arg-type]
    assert handler.num_nodes_waiting() == 1  # a waiting host restarts this one's processes
    handler.is_closed(), handler.set_closed(), handler.get_run_id(), handler.shutdown()
    assert c10d.calls == ["num_nodes_waiting", "is_closed", "set_closed", "get_run_id", "shutdown"]
    assert handler.get_backend() == "c10d-node-rank"


def test_two_hosts_with_one_rank_fail_the_round() -> None:
    store = round_store()
    NodeRankRendezvous(FakeC10d(store, rank=0), node_rank=0, local_addr="a").next_rendezvous()  # type: ignore[arg-type]
    twin = NodeRankRendezvous(FakeC10d(store, rank=1), node_rank=0, local_addr="b")  # type: ignore[arg-type]
    with pytest.raises(NodeRankError, match="node rank 0 is claimed by 2 hosts; .* \\(host b\\)"):
        twin.next_rendezvous()


def test_rank_outside_the_round_fails() -> None:
    handler = NodeRankRendezvous(FakeC10d(round_store(), rank=0), node_rank=2, local_addr="a")  # type: ignore[arg-type]
    with pytest.raises(NodeRankError, match="node rank 2 is outside the job's 2 hosts"):
        handler.next_rendezvous()


def test_the_backend_needs_a_node_rank() -> None:
    params = RendezvousParameters("c10d-node-rank", "localhost:0", "job", 1, 1, is_host=True)
    with pytest.raises(ValueError, match="needs --rdzv-conf=node_rank=R"):
        create_node_rank_handler(params)
