"""scripts/scaling_traffic.py: one micro-batch's measured collective bytes -> a step's seconds, on the
planner's link model. Rows are built from the planner's own traffic (no dry run), so the conversion
must give the planner's seconds back.

Bugs caught: the dry run's one micro-batch taken for the whole step (grad accumulation not
repeated), and a group's bandwidth chosen by its size instead of the devices it is laid across (an
HSDP all-reduce of two replicas on different slices priced at the fast links).
"""

from __future__ import annotations

import dataclasses

import pytest

from scripts import scaling_traffic
from scripts.scaling_traffic import step_seconds
from titan_tpu.config import load_config
from titan_tpu.dryrun.report import CollectiveRow
from titan_tpu.plan.chips import parse_chips
from titan_tpu.plan.planner import Plan, make_plan
from titan_tpu.plan.roofline import fsdp_seconds, fsdp_traffic, hsdp_seconds


def _plan(chips: str, *overrides: str) -> Plan:
    return make_plan(load_config("llama3_debug", list(overrides)), parse_chips(chips))


def test_fsdp_bytes_of_one_micro_batch_give_the_planners_fsdp_seconds_of_the_step() -> None:
    plan = _plan("v6e-4", "--training.global_batch_size=8", "--training.local_batch_size=1")
    shape, precision, cluster = plan.shape, plan.detail.layout.precision, plan.cluster
    assert shape.grad_accum == 2
    rows = []
    for unit in fsdp_traffic(plan.detail.local, shape, precision).values():  # the step's: per micro-batch
        rows.append(CollectiveRow("all_gather", "dp_shard", unit.degree, 0, unit.gathered_bytes // shape.grad_accum))
        rows.append(CollectiveRow("reduce_scatter", "dp_shard", unit.degree, 0, unit.reduced_bytes // shape.grad_accum))
    planned = fsdp_seconds(plan.detail.local, shape, precision, cluster)
    measured = step_seconds(rows, shape, cluster)
    assert measured["fsdp_s"] == pytest.approx(planned, rel=1e-12) and planned > 0
    assert measured["tp_s"] == measured["ep_s"] == measured["cp_s"] == measured["hsdp_s"] == 0
    # Negative control: the micro-batch read as the whole step is half the planner's.
    once = step_seconds(rows, dataclasses.replace(shape, grad_accum=1), cluster)["fsdp_s"]
    assert once == pytest.approx(planned / 2, rel=1e-12)


def test_an_all_reduce_across_slices_runs_at_the_slow_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas on two v6e-256 slices: a group of 2 laid across all 512 devices, over DCN."""
    plan = _plan("v6e-512", "--parallelism.dp_replicate=2", "--training.global_batch_size=512")
    shape, precision, cluster = plan.shape, plan.detail.layout.precision, plan.cluster
    assert cluster.slices == 2 and shape.dp_replicate == 2
    trained = sum(p.local_numel for p in plan.detail.local.trained) * precision.reduce_bytes
    rows = [CollectiveRow("all_reduce", "dp_replicate", 2, 1, trained)]
    planned = hsdp_seconds(plan.detail.local, shape, precision, cluster)
    assert step_seconds(rows, shape, cluster)["hsdp_s"] == pytest.approx(planned, rel=1e-12)
    # Negative control: the span taken as the group's size (2 devices, inside a slice) is far too fast.
    monkeypatch.setattr(scaling_traffic, "axis_placement", lambda axis, shape: ("hsdp_s", 2))
    assert step_seconds(rows, shape, cluster)["hsdp_s"] < planned / 10
