"""ICI-aware rank order on recorded TPU topologies (jax is the oracle; no TPU needed).

What "ICI neighbours" means here, checked for every tp group of the laid-out mesh:
- two devices are *adjacent* when they are the two cores of one chip, or their chips are in the same
  slice and one hop apart (coordinates differ by 1 along exactly one axis; wrap-around links are not
  counted, so the check is never looser than the hardware);
- a tp group of 2 is one adjacent pair;
- a tp group of 4 occupies chips that fill their bounding box, which is a line or a 2x2 face (at most
  two non-trivial axes), and every member is adjacent to at least one other member. On v7x that is two
  neighbouring chips with both cores each; elsewhere four chips in a line or a square.
Every dp_replicate group of a multi-slice topology holds devices of every slice, and every tp and
dp_shard group stays inside one slice.
"""

from __future__ import annotations

import builtins
import math
from pathlib import Path

import numpy as np
import pytest

from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed import topology
from titan_tpu.distributed.topology import ChipRecord, RecordedTopology, TpuEnvironmentProvider, rank_layout

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "topologies"
NAMES = ("dp_replicate", "dp_shard", "tp")
TOPOLOGIES = ["v5p_2x2x2", "v6e_4x4", "v7x_2x2x2", "v6e_4x4_two_slices"]


def load(name: str) -> RecordedTopology:
    return RecordedTopology.load(ASSETS / f"{name}.json")


def adjacent(a: ChipRecord, b: ChipRecord) -> bool:
    if a.slice_index != b.slice_index:
        return False
    distance = sum(abs(x - y) for x, y in zip(a.coords, b.coords))
    return (distance == 0 and a.core_on_chip != b.core_on_chip) or distance == 1


def is_neighbour_set(group: list[ChipRecord]) -> bool:
    if len({r.slice_index for r in group}) != 1:
        return False
    if len(group) == 2:
        return adjacent(*group)
    chips = {r.coords for r in group}
    extent = [max(c[i] for c in chips) - min(c[i] for c in chips) + 1 for i in range(3)]
    compact = math.prod(extent) == len(chips) and sum(e > 1 for e in extent) <= 2
    connected = all(any(adjacent(r, o) for o in group if o is not r) for r in group)
    return compact and connected


def layouts(topo: RecordedTopology) -> list[tuple[int, int, int]]:
    """Every (dp_replicate, dp_shard, tp) with tp in {2, 4} that the topology can hold."""
    n, slices = len(topo.records), len({r.slice_index for r in topo.records})
    shapes = []
    for tp in (2, 4):
        for replicate in (1, 2, 4):
            if n % (tp * replicate) == 0 and replicate % slices == 0:
                shapes.append((replicate, n // (tp * replicate), tp))
    return shapes


def groups(layout: np.ndarray, axis: int) -> list[list[int]]:
    moved = np.moveaxis(layout, axis, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_tp_groups_are_ici_neighbours_and_replicas_span_slices(name: str) -> None:
    topo = load(name)
    records = topo.records
    shapes = layouts(topo)
    assert shapes, name
    n_slices = len({r.slice_index for r in records})
    for sizes in shapes:
        layout = rank_layout(records, NAMES, sizes)
        assert sorted(layout.ravel().tolist()) == list(range(len(records))), (name, sizes)
        for group in groups(layout, 2):
            members = [records[r] for r in group]
            assert is_neighbour_set(members), (name, sizes, members)
        for group in groups(layout, 1):
            assert len({records[r].slice_index for r in group}) == 1, (name, sizes)
        if n_slices > 1:
            for group in groups(layout, 0):
                assert {records[r].slice_index for r in group} == set(range(n_slices)), (name, sizes)


def test_v7x_tp2_is_the_two_cores_of_one_chip() -> None:
    records = load("v7x_2x2x2").records
    layout = rank_layout(records, NAMES, (1, 8, 2))
    for a, b in groups(layout, 2):
        assert records[a].coords == records[b].coords
        assert {records[a].core_on_chip, records[b].core_on_chip} == {0, 1}


def test_the_neighbour_check_rejects_a_scattered_group() -> None:
    """The check is not vacuous: on v6e 4x4 (hosts of 2x2 chips, ranks numbered host by host), a
    layout taking one rank from each host for tp puts chips (0,0), (2,0), (0,2), (2,2) in one group."""
    records = load("v6e_4x4").records
    scattered = np.arange(16).reshape(1, 4, 4).transpose(0, 2, 1)
    assert not is_neighbour_set([records[r] for r in groups(scattered, 2)[0]])


def test_slices_need_dp_replicate_to_span_them() -> None:
    records = load("v6e_4x4_two_slices").records
    with pytest.raises(ConfigError) as info:
        rank_layout(records, NAMES, (1, 8, 4))
    message = str(info.value)
    assert "dp_replicate 1 x dp_shard 8 x tp 4" in message and "2 slices of 4x4x1 chips" in message


def test_device_count_mismatch_names_both_shapes() -> None:
    records = load("v5p_2x2x2").records
    with pytest.raises(ConfigError, match=r"dp_replicate 1 x dp_shard 4 x tp 4.*2x2x2 chips"):
        rank_layout(records, NAMES, (1, 4, 4))


def test_megacore_kind_with_two_cores_fails_with_shapes() -> None:
    """A v6e reports one device per chip; records claiming two cores cannot be laid out by jax."""
    records = [
        ChipRecord(rank=2 * i + core, coords=(i % 4, i // 4, 0), core_on_chip=core, slice_index=0,
                   process_index=0, device_kind="TPU v6 lite")
        for i in range(8) for core in range(2)
    ]
    with pytest.raises(ConfigError, match=r"mesh \(dp_replicate 1 x dp_shard 4 x tp 4\) cannot be laid onto"):
        rank_layout(records, NAMES, (1, 4, 4))


def test_missing_jax_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_jax(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "jax" or name.startswith("jax."):
            raise ImportError("No module named 'jax'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jax)
    with pytest.raises(ConfigError, match=r"pip install 'titan_tpu\[tpu\]'"):
        topology.build_rank_layout("tpu", NAMES, (1, 2, 4), rank=0, local_rank=0)


def test_non_tpu_is_row_major() -> None:
    layout = topology.build_rank_layout("cpu", NAMES, (2, 2, 2), rank=0, local_rank=0)
    assert layout.tolist() == np.arange(8).reshape(2, 2, 2).tolist()


def test_environment_provider_reproduces_recorded_v5p() -> None:
    """TPU VM variables of a v5p-16 (two hosts of 2x2x1 chips along z) give the recorded records."""
    recorded = load("v5p_2x2x2").records
    for record in recorded:
        env = {
            "TPU_ACCELERATOR_TYPE": "v5p-16",
            "TPU_WORKER_ID": str(record.process_index),
            "TPU_HOST_BOUNDS": "1,1,2",
            "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        }
        derived = TpuEnvironmentProvider(env).local_record(record.rank, record.rank % 4)
        assert derived == record


def test_environment_provider_v7x_cores() -> None:
    recorded = load("v7x_2x2x2").records
    for record in recorded:
        env = {
            "TPU_ACCELERATOR_TYPE": "tpu7x-16",
            "TPU_WORKER_ID": str(record.process_index),
            "TPU_HOST_BOUNDS": "1,1,2",
            "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        }
        assert TpuEnvironmentProvider(env).local_record(record.rank, record.rank % 8) == record


def test_environment_provider_unknown_is_none() -> None:
    assert TpuEnvironmentProvider({}).local_record(0, 0) is None
