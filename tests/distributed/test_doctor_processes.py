"""The doctor in 4 processes on this CPU (gloo), dp_shard 2 x tp 2, in one launch: every collective
over every mesh axis gets a row, the per-rank rows merge into one report, the ten training steps
agree with the CPU float32 reference; and an all-reduce slowed on purpose is reported `slow` while
its siblings are not (the negative control of the collectives' verdict).

Bugs caught: an axis or a collective left out, per-rank timings not reduced to one figure (ranks
disagreeing), a slow collective that no verdict can flag, and a run that exits non-zero for slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

from tests.distributed.doctor_worker import SLOWED  # noqa: E402
from tests.support.launch import torchrun  # noqa: E402

pytestmark = pytest.mark.slow
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
AXES = ("dp_shard (2)", "tp (2)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    out = tmp_path_factory.mktemp("doctor4")
    torchrun(4, HERE / "doctor_worker.py", str(out), timeout=300)
    return out, {name: json.loads((out / f"{name}.json").read_text()) for name in ("plain", "slowed")}


def collectives(report: dict) -> dict[str, dict]:
    return {row["name"]: row for row in report["rows"] if row["check"] == "collective"}


def test_every_collective_over_every_axis(runs: tuple[Path, dict[str, dict]]) -> None:
    out, reports = runs
    plain = reports["plain"]
    assert plain["world_size"] == 4 and plain["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    rows = collectives(plain)
    assert set(rows) == {f"{kind} over {axis}" for kind in KINDS for axis in AXES}
    for row in rows.values():
        assert row["measured"] > 0 and row["detail"] == "fast" and row["verdict"] == "ok", row
    assert set(plain["measured"]["bus_bytes_per_s"]["fast"]) == set(KINDS)
    training = next(row for row in plain["rows"] if row["check"] == "training")
    assert training["verdict"] == "ok", training
    assert all((out / f"status.plain.rank{rank}").read_text() == "0" for rank in range(4))


def test_a_slowed_collective_is_reported_slow(runs: tuple[Path, dict[str, dict]]) -> None:
    out, reports = runs
    for name, row in collectives(reports["slowed"]).items():
        assert row["verdict"] == ("slow" if name.startswith(SLOWED) else "ok"), row
    # Slow informs, it does not fail the run.
    assert reports["slowed"]["exit_status"] == 0
    assert all((out / f"status.slowed.rank{rank}").read_text() == "0" for rank in range(4))
