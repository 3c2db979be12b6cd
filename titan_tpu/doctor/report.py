"""The doctor's rows of every rank merged into one report: a table for the terminal, a JSON file for
people and for the planner (`python -m titan_tpu.plan --calibration`; docs/doctor.md lists the
fields)."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from titan_tpu.doctor.rows import SEVERITY, VERDICTS, Row
from titan_tpu.plan.calibration import REPORT_FORMAT

REPORT_VERSION = 1


def merge_ranks(rows_per_rank: list[list[Row]]) -> list[Row]:
    """One row per (check, name), in rank 0's order: the worst verdict any rank gave it, its reason
    naming that rank when it is not rank 0 (a slow chip on rank 5 must not hide behind rank 0's)."""
    merged: dict[tuple[str, str], Row] = {}
    for rank, rows in enumerate(rows_per_rank):
        for row in rows:
            key = (row.check, row.name)
            if key not in merged:
                merged[key] = row if rank == 0 else replace(row, reason=f"rank {rank}: {row.reason}")
            elif SEVERITY[row.verdict] > SEVERITY[merged[key].verdict]:
                merged[key] = replace(row, reason=f"rank {rank}: {row.reason}")
    return list(merged.values())


def exit_status(rows: list[Row]) -> int:
    """1 when any row is wrong; slow and unavailable lines inform, they do not fail."""
    return 1 if any(row.verdict == "wrong" for row in rows) else 0


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3g} {unit}".strip()


def render_table(rows: list[Row]) -> str:
    header = ("check", "name", "measured", "expected", "verdict", "reason")
    cells = [
        (
            r.check,
            r.name,
            (r.detail or "-") if r.measured is None else _number(r.measured, r.unit),
            _number(r.expected, r.unit),
            r.verdict,
            r.reason,
        )
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *cells]) for i in range(5)]
    lines = [
        "  ".join(str(text).ljust(width) for text, width in zip(line[:5], widths)) + "  " + line[5]
        for line in [header, *cells]
    ]
    counts = Counter(row.verdict for row in rows)
    lines.append(", ".join(f"{counts[v]} {v}" for v in VERDICTS))
    return "\n".join(lines)


@dataclass(frozen=True)
class RunFacts:
    """What the report says about the run besides its rows."""

    device_type: str
    device_name: str
    generation: str
    compute_dtype: str
    world_size: int
    mesh: dict[str, int]
    sizes: str


def measured_figures(rows: list[Row]) -> dict[str, Any]:
    """The figures the planner can use: matmul FLOP/s per dtype, and per link ("fast" inside a slice
    or host, "slow" across) each collective's bus bandwidth on its slowest axis, in bytes/s."""
    matmul = {r.name.split()[0]: r.measured * 1e12 for r in rows if r.check == "matmul" and r.measured}
    bus: dict[str, dict[str, float]] = {"fast": {}, "slow": {}}
    for row in rows:
        if row.check == "collective" and row.measured:
            kind, link = row.name.split()[0], bus[row.detail]
            link[kind] = min(link.get(kind, float("inf")), row.measured * 1e9)
    return {"matmul_flops": matmul, "bus_bytes_per_s": bus}


def report_json(rows: list[Row], facts: RunFacts) -> dict[str, Any]:
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": facts.device_type, "name": facts.device_name, "generation": facts.generation},
        "compute_dtype": facts.compute_dtype,
        "world_size": facts.world_size,
        "mesh": facts.mesh,
        "sizes": facts.sizes,
        "rows": [row.to_json() for row in rows],
        "measured": measured_figures(rows),
        "verdicts": dict(Counter(row.verdict for row in rows)),
        "exit_status": exit_status(rows),
    }


def write_report(path: Path, rows: list[Row], facts: RunFacts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_json(rows, facts), indent=1) + "\n", "utf-8")
