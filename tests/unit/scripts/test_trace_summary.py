"""scripts/trace_summary.py: self times from nested trace ranges.

Bugs caught: a parent's time counted again in its children (no subtraction), a child subtracted
from a range that had already ended, ranges of different threads treated as nested, a trace
without step ranges summarised as if it had some.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT))

from scripts.trace_summary import BETWEEN_OPS, main, self_times, summary  # noqa: E402


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


# One step [0, 100]: A [10, 50] holding B [20, 30]; then C [60, 90] holding B [70, 74]; a range on
# another thread that overlaps A in time; a flow event that is no range.
EVENTS = [
    _x("train_step 3", 0, 100, cat="user_annotation"),
    _x("A", 10, 40),
    _x("B", 20, 10),
    _x("C", 60, 30),
    _x("B", 70, 4),
    _x("D", 15, 20, tid=2),
    {"ph": "s", "cat": "fwdbwd", "name": "flow", "pid": 1, "tid": 1, "ts": 12},
]


def test_self_times_subtract_direct_children_per_thread() -> None:
    assert self_times(EVENTS) == {BETWEEN_OPS: 30, "A": 30, "B": 14, "C": 26, "D": 20}


def test_summary_reports_per_step_milliseconds_and_shares() -> None:
    lines = summary({"traceEvents": EVENTS}, top=3)
    assert lines[0] == "train_step 3: 0.1 ms"
    rows = {line[:60].strip(): line.split()[-2:] for line in lines[2:]}
    assert rows == {BETWEEN_OPS: ["0.03", "30.0%"], "A": ["0.03", "30.0%"], "C": ["0.03", "26.0%"]}


def test_a_trace_without_steps_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "other.json"
    trace.write_text(json.dumps({"traceEvents": [_x("A", 0, 1)]}))
    assert main([str(trace)]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
