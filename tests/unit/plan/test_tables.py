"""The README's planner tables are what scripts/plan_tables.py generates (never typed by hand), and
its --check flag notices a stale block."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))

import plan_tables  # noqa: E402


def test_readme_tables_are_generated() -> None:
    text = plan_tables.README.read_text(encoding="utf-8")
    start, end = plan_tables.readme_block(text)
    assert text[start:end] == plan_tables.render(), "run: .venv/bin/python scripts/plan_tables.py"


def test_check_flags_a_stale_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{plan_tables.BEGIN}\n| typed by hand |\n{plan_tables.END}\n", encoding="utf-8")
    monkeypatch.setattr(plan_tables, "README", stale)
    monkeypatch.setattr(plan_tables, "render", lambda: f"{plan_tables.BEGIN}\n| generated |\n{plan_tables.END}")
    assert plan_tables.main(["--check"]) == 1
    assert plan_tables.main([]) == 0
    assert plan_tables.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == f"intro\n{plan_tables.BEGIN}\n| generated |\n{plan_tables.END}\n"
