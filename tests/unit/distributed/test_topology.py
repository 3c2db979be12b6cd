"""The TPU mesh order from torch_tpu's own topology logic, on recorded device payloads (no TPU needed).

Each asset in tests/assets/topologies holds, per torch rank, the record the TPU runtime gives that
rank's device (the fields of `PjRtDeviceAttributes`: id, coords, core_on_chip, device_kind,
process_index, slice_index). The tests run the production call, `build_rank_layout("tpu", ...)`
-> `torch.tpu.distributed.topology_aware_mesh`, with only the runtime's all-gather of those records
replaced by the recording, and judge the result against the recorded coordinates:

- *neighbours*: a group's devices all sit in one slice and its chips fill their bounding box on the
  ICI mesh (two cores of one chip, two chips one hop apart, a line or a face of four, ...). Wrap-
  around links are not counted, so the check is never looser than the hardware;
- every tp group is neighbours; the layout holds every rank once;
- on several slices every dp_replicate group holds a device of each slice and every tp and
  dp_shard group stays inside one slice.
"""

from __future__ import annotations

import builtins
import json
import math
import sys
import types
from typing import Any

import numpy as np
import pytest

from tests.support.paths import ASSETS
from titan_tpu.config.errors import ConfigError
from titan_tpu.device import torch_tpu_function
from titan_tpu.distributed import topology

TOPOLOGIES_FOLDER = ASSETS / "topologies"
NAMES = ("dp_replicate", "dp_shard", "tp")
TOPOLOGIES = ["v5e_2x4", "v5p_2x2x2", "v6e_4x4", "v6e_4x4_two_slices", "v7x_2x2x2"]
# A launcher that numbers hosts in the order they joined the rendezvous (torchrun's c10d backend
# without a fixed node rank) gives each host a block of ranks in that order. torch_tpu's layout must
# not depend on it; row-major does. Host indices per topology, in joining order.
HOSTS_OUT_OF_ORDER = {
    "v6e_4x4": [0, 3, 1, 2],
    "v6e_4x4_two_slices": [0, 4, 1, 5, 2, 6, 3, 7],  # the two slices' hosts interleaved
}


def load(name: str) -> list[types.SimpleNamespace]:
    """The recorded devices, indexed by torch rank."""
    data = json.loads((TOPOLOGIES_FOLDER / f"{name}.json").read_text(encoding="utf-8"))
    devices = [types.SimpleNamespace(**{**d, "coords": tuple(d["coords"])}) for d in data["devices"]]
    assert [d.rank for d in devices] == list(range(len(devices))), f"{name}: devices must be listed by rank"
    return devices


def renumber_hosts(devices: list[types.SimpleNamespace], host_order: list[int]) -> list[types.SimpleNamespace]:
    """The same chips with ranks handed out host by host in `host_order`."""
    by_host = [[d for d in devices if d.process_index == host] for host in host_order]
    chips = [d for host in by_host for d in host]
    return [types.SimpleNamespace(**{**vars(d), "rank": rank}) for rank, d in enumerate(chips)]


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch):
    """Makes torch_tpu see `devices` as the job's devices, one torch rank each.

    This reaches into torch_tpu's internals, and only here: `topology_aware_mesh` asks the TPU
    runtime for every rank's device record (`tpu_distributed.global_device_attributes`, an
    all-gather that needs chips) and checks that a process group of that many ranks exists
    (`device_mesh.dist`). Those two are swapped for the recording; everything after them, from
    slice detection and validation to the placement handlers and the torus assignment, runs as in
    production. No public API takes recorded devices, and one CPU process cannot be 32 ranks.
    """
    device_mesh = pytest.importorskip("torch_tpu._internal.distributed.device_mesh")

    def use(devices: list[Any]) -> None:
        monkeypatch.setattr(device_mesh.tpu_distributed, "global_device_attributes", lambda: list(devices))
        process_group = types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: len(devices))
        monkeypatch.setattr(device_mesh, "dist", process_group)

    return use


def neighbours(group: list[types.SimpleNamespace]) -> bool:
    if len({d.slice_index for d in group}) != 1:
        return False
    chips = {d.coords for d in group}
    box = [max(c[axis] for c in chips) - min(c[axis] for c in chips) + 1 for axis in range(3)]
    return math.prod(box) == len(chips)


def groups(layout: np.ndarray, axis: int) -> list[list[int]]:
    moved = np.moveaxis(layout, axis, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


def mesh_shapes(devices: list[types.SimpleNamespace]) -> list[tuple[int, int, int]]:
    """Every (dp_replicate, dp_shard, tp) with tp in {2, 4, 8} that the devices can hold."""
    n, slices = len(devices), len({d.slice_index for d in devices})
    return [
        (replicate, n // (tp * replicate), tp)
        for tp in (2, 4, 8)
        for replicate in (1, 2, 4)
        if n % (tp * replicate) == 0 and replicate % slices == 0
    ]


def layout_problems(devices: list[types.SimpleNamespace], layout: np.ndarray) -> list[str]:
    """What is wrong with `layout` on these devices (empty when nothing is)."""
    problems = []
    if sorted(layout.ravel().tolist()) != list(range(len(devices))):
        problems.append("not a permutation of the ranks")
    for group in groups(layout, 2):
        if not neighbours([devices[r] for r in group]):
            problems.append(f"tp group {group} is not ICI neighbours")
    slices = {d.slice_index for d in devices}
    if len(slices) > 1:
        for group in groups(layout, 0):
            if {devices[r].slice_index for r in group} != slices:
                problems.append(f"dp_replicate group {group} does not span the slices")
        for group in groups(layout, 1):
            if len({devices[r].slice_index for r in group}) != 1:
                problems.append(f"dp_shard group {group} crosses slices")
    return problems


def slices_of(devices: list[types.SimpleNamespace]) -> str:
    return str(len({d.slice_index for d in devices}))


CASES = [
    *(pytest.param(name, None, id=name) for name in TOPOLOGIES),
    *(pytest.param(name, order, id=f"{name}-hosts_out_of_order") for name, order in HOSTS_OUT_OF_ORDER.items()),
]


@pytest.mark.parametrize(("name", "host_order"), CASES)
def test_torch_tpu_layout_puts_tp_on_neighbours_and_replicas_across_slices(
    name: str, host_order: list[int] | None, replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    devices = load(name)
    if host_order is not None:
        devices = renumber_hosts(devices, host_order)
    replay(devices)
    monkeypatch.setenv(topology.SLICE_COUNT_VARIABLE, slices_of(devices))
    shapes = mesh_shapes(devices)
    assert shapes, name
    for sizes in shapes:
        layout = topology.build_rank_layout("tpu", NAMES, sizes, rank=0)
        assert layout.shape == sizes and layout.dtype == np.int64
        assert layout_problems(devices, layout) == [], (name, sizes)


def test_row_major_fails_the_same_checks_when_ranks_do_not_follow_the_chips() -> None:
    """Negative control: the checks above can fail. With hosts numbered in joining order, row-major
    tp 8 on v6e 4x4 takes hosts 0 and 3, two diagonal 2x2 blocks; on two slices row-major
    dp_replicate pairs hosts of one slice and dp_shard groups straddle DCN."""
    single = renumber_hosts(load("v6e_4x4"), HOSTS_OUT_OF_ORDER["v6e_4x4"])
    problems = layout_problems(single, topology.row_major_layout((1, 2, 8)))
    assert problems and all("tp group" in p for p in problems), problems

    two = renumber_hosts(load("v6e_4x4_two_slices"), HOSTS_OUT_OF_ORDER["v6e_4x4_two_slices"])
    problems = layout_problems(two, topology.row_major_layout((2, 4, 4)))
    assert any("does not span the slices" in p for p in problems), problems
    assert any("crosses slices" in p for p in problems), problems


def test_tp_2_on_v7x_is_the_two_cores_of_one_chip(replay) -> None:
    devices = load("v7x_2x2x2")
    replay(devices)
    layout = topology.build_rank_layout("tpu", NAMES, (1, 8, 2), rank=1)
    for a, b in groups(layout, 2):
        assert devices[a].coords == devices[b].coords
        assert {devices[a].core_on_chip, devices[b].core_on_chip} == {0, 1}


def test_slices_need_dp_replicate_to_span_them(replay, monkeypatch: pytest.MonkeyPatch) -> None:
    replay(load("v6e_4x4_two_slices"))
    monkeypatch.setenv(topology.SLICE_COUNT_VARIABLE, "2")
    with pytest.raises(ConfigError) as info:
        topology.build_rank_layout("tpu", NAMES, (1, 8, 4), rank=1)
    message = str(info.value)
    assert "dp_replicate 1 x dp_shard 8 x tp 4" in message and "2 TPU slices" in message
    assert "multiple of 2" in message


def test_slices_the_launcher_did_not_declare_are_refused(replay, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chips in two slices but MEGASCALE_NUM_SLICES unset: the library must not pick a DCN axis by
    itself (it would split dp_shard when dp_replicate is 1)."""
    replay(load("v6e_4x4_two_slices"))
    monkeypatch.delenv(topology.SLICE_COUNT_VARIABLE, raising=False)
    with pytest.raises(ConfigError, match=r"mesh \(dp_replicate 1 x dp_shard 8 x tp 4\) over 1 slice.*job has 2"):
        topology.build_rank_layout("tpu", NAMES, (1, 8, 4), rank=1)


def test_device_count_mismatch_names_the_mesh(replay) -> None:
    replay(load("v5p_2x2x2"))
    with pytest.raises(ConfigError, match=r"mesh \(dp_replicate 1 x dp_shard 4 x tp 4\).*8"):
        topology.build_rank_layout("tpu", NAMES, (1, 4, 4), rank=1)


def test_two_cores_on_a_one_core_chip_kind_fails_with_the_mesh(replay) -> None:
    """A v6e shows one device per chip; a payload claiming two cores per chip cannot be placed."""
    devices = [
        types.SimpleNamespace(
            rank=2 * chip + core,
            id=2 * chip + core,
            coords=(chip % 4, chip // 4, 0),
            core_on_chip=core,
            device_kind="TPU v6 lite",
            process_index=0,
            slice_index=None,
        )
        for chip in range(8)
        for core in range(2)
    ]
    replay(devices)
    expected = r"mesh \(dp_replicate 1 x dp_shard 4 x tp 4\) over 1 slice.*one device per chip"
    with pytest.raises(ConfigError, match=expected):
        topology.build_rank_layout("tpu", NAMES, (1, 4, 4), rank=1)


@pytest.mark.parametrize("value", ["0", "two", "-2"])
def test_bad_slice_count_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"MEGASCALE_NUM_SLICES='{value}': expected a positive integer"):
        topology.tpu_slice_count({topology.SLICE_COUNT_VARIABLE: value})


def test_a_tpu_run_needs_no_jax(replay, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_tpu's mesh utilities are its own; jax is not a dependency of a TPU run."""
    replay(load("v6e_4x4"))
    real_import = builtins.__import__

    def no_jax(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "jax" or name.startswith("jax."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jax)
    for module in [m for m in sys.modules if m == "jax" or m.startswith("jax.")]:
        monkeypatch.delitem(sys.modules, module)
    assert topology.build_rank_layout("tpu", NAMES, (1, 4, 4), rank=1).shape == (1, 4, 4)


def test_missing_torch_tpu_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.tpu.distributed", None)  # the import fails
    torch_tpu_function.cache_clear()  # an earlier test may have found the real function
    with pytest.raises(ConfigError, match=r"needs the torch_tpu package.*pip install -e '\.\[tpu\]'"):
        topology.build_rank_layout("tpu", NAMES, (1, 2, 4), rank=1)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_off_tpu_the_order_is_row_major(device_type: str) -> None:
    layout = topology.build_rank_layout(device_type, NAMES, (2, 2, 2), rank=0)
    assert layout.tolist() == np.arange(8).reshape(2, 2, 2).tolist()


def test_pp_is_the_axis_that_spans_slices(replay, monkeypatch: pytest.MonkeyPatch) -> None:
    """With pipeline parallelism the mesh is (pp, dp_replicate, dp_shard, tp), outermost first, and
    the slices split pp: each pipeline's stages sit on different slices (one activation per
    micro-batch crosses DCN), while every dp_shard and tp group stays inside one slice."""
    devices = load("v6e_4x4_two_slices")
    replay(devices)
    monkeypatch.setenv(topology.SLICE_COUNT_VARIABLE, "2")
    names = ("pp", *NAMES)
    layout = topology.build_rank_layout("tpu", names, (2, 1, 4, 4), rank=0)
    slices = {d.slice_index for d in devices}
    assert sorted(layout.ravel().tolist()) == list(range(len(devices)))
    for group in groups(layout, 0):
        assert {devices[r].slice_index for r in group} == slices, group
    for axis in (2, 3):
        for group in groups(layout, axis):
            assert len({devices[r].slice_index for r in group}) == 1, (names[axis], group)
    assert all(neighbours([devices[r] for r in group]) for group in groups(layout, 3))
