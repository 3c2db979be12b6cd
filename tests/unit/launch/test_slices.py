"""GKE TPU slices: chips, hosts and chips per host for each accelerator type, and one-line errors
naming the valid values for a topology or accelerator GKE does not offer."""

from __future__ import annotations

import pytest

from titan_tpu.config.errors import ConfigError
from titan_tpu.launch.slices import ACCELERATORS, multi_host_alternative, slice_shape


@pytest.mark.parametrize(
    ("accelerator", "topology", "chips", "hosts", "chips_per_host", "machine"),
    [
        # Single-host slices: one pod.
        ("tpu-v5-lite-podslice", "1x1", 1, 1, 1, "ct5lp-hightpu-1t"),
        ("tpu-v6e-slice", "2x2", 4, 1, 4, "ct6e-standard-4t"),
        ("tpu-v6e-slice", "2x4", 8, 1, 8, "ct6e-standard-8t"),
        ("tpu-v4-podslice", "2x2x1", 4, 1, 4, "ct4p-hightpu-4t"),
        # Multi-host slices are 4-chip hosts on every type.
        ("tpu-v6e-slice", "4x4", 16, 4, 4, "ct6e-standard-4t"),
        ("tpu-v6e-slice", "16x16", 256, 64, 4, "ct6e-standard-4t"),
        ("tpu-v5-lite-podslice", "4x8", 32, 8, 4, "ct5lp-hightpu-4t"),
        ("tpu-v5p-slice", "2x2x2", 8, 2, 4, "ct5p-hightpu-4t"),
        ("tpu-v5p-slice", "8x16x16", 2048, 512, 4, "ct5p-hightpu-4t"),
        ("tpu-v4-podslice", "4x4x8", 128, 32, 4, "ct4p-hightpu-4t"),
        ("tpu7x", "2x2x2", 8, 2, 4, "tpu7x-standard-4t"),
        ("tpu7x", "4x4x4", 64, 16, 4, "tpu7x-standard-4t"),
    ],
)
def test_slice_shapes(
    accelerator: str, topology: str, chips: int, hosts: int, chips_per_host: int, machine: str
) -> None:
    """Catches a wrong chip product or chips-per-host: the JobSet would ask for pods that never
    schedule (too many chips per pod) or leave hosts of the slice unused."""
    shape = slice_shape(accelerator, topology)
    assert (shape.chips, shape.hosts, shape.chips_per_host, shape.machine_type) == (
        chips,
        hosts,
        chips_per_host,
        machine,
    )
    assert shape.multi_host == (hosts > 1)


def test_v6e_2x4_has_a_multi_host_form() -> None:
    """GKE builds 2x4 as one 8-chip host or two 4-chip hosts; chips_per_host picks, and the single
    host form points to the other (the one a multi-slice job needs)."""
    single = slice_shape("tpu-v6e-slice", "2x4")
    assert multi_host_alternative(single) == 4
    double = slice_shape("tpu-v6e-slice", "2x4", chips_per_host=4)
    assert (double.hosts, double.chips_per_host) == (2, 4)
    assert multi_host_alternative(slice_shape("tpu-v6e-slice", "2x2")) is None


def test_every_listed_topology_is_accepted() -> None:
    """The topologies an error message offers must themselves be valid (the rule entry aside)."""
    for acc in ACCELERATORS.values():
        for topology in acc.topologies():
            if not topology.startswith("AxBxC"):
                assert slice_shape(acc.name, topology).chips > 0


@pytest.mark.parametrize(
    ("accelerator", "topology", "message"),
    [
        (
            "tpu-v6e-slice",
            "2x2x2",
            r"topology '2x2x2' is not a 2D topology; valid 2D topologies for tpu-v6e-slice .*: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16$",
        ),
        (
            "tpu7x",
            "4x4",
            r"topology '4x4' is not a 3D topology; valid 3D topologies for tpu7x .*2x2x1, 2x2x2, 2x2x4, 2x4x4, AxBxC",
        ),
        ("tpu-v6e-slice", "3x3", r"topology '3x3' is not offered for tpu-v6e-slice; valid 2D topologies"),
        ("tpu-v5p-slice", "4x4x6", r"topology '4x4x6' is not offered for tpu-v5p-slice"),  # 6: not a multiple of 4
        ("tpu-v5p-slice", "8x4x4", r"topology '8x4x4' is not offered"),  # sides must not decrease
        ("tpu-v5p-slice", "16x16x32", r"up to 6144 chips"),  # 8192 chips: larger than v5p's largest slice
        ("tpu-v6e-slice", "4 x 4", r"topology '4 x 4' is not a 2D topology"),
        (
            "tpu-v6",
            "4x4",
            r"accelerator 'tpu-v6' is not a GKE TPU accelerator type; did you mean 'tpu-v6e-slice'\? valid: tpu-v4-podslice, tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v6e-slice, tpu7x$",
        ),
        ("v6e", "4x4", r"accelerator 'v6e' is not a GKE TPU accelerator type; .*valid: tpu-v4-podslice"),
    ],
)
def test_invalid_combinations_name_the_valid_ones(accelerator: str, topology: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        slice_shape(accelerator, topology)
    assert "\n" not in str(caught.value)


def test_chips_per_host_not_offered() -> None:
    with pytest.raises(ConfigError, match=r"chips per host 8 is not offered for tpu-v6e-slice 4x4; valid: 4$"):
        slice_shape("tpu-v6e-slice", "4x4", chips_per_host=8)
