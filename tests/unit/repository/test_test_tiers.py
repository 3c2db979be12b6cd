"""scripts/test.sh runs the whole suite as tests/unit, tests/parity and tests/distributed (and the
engine tests, wherever they are, by their marker). Bugs caught: a test file put anywhere else, or a
folder the unit run leaves out (--ignore) and no other run takes, which the script would never run
while `bash scripts/test.sh` still reported success."""

from __future__ import annotations

import re

from tests.support.paths import REPO

TIERS = ("unit", "parity", "distributed")


def test_every_test_file_is_in_a_tier_the_script_runs() -> None:
    tests = REPO / "tests"
    outside = [
        str(path.relative_to(tests))
        for path in tests.rglob("test_*.py")
        if path.relative_to(tests).parts[0] not in TIERS
    ]
    assert outside == [], f"test files scripts/test.sh does not run: {outside}"
    script = (REPO / "scripts" / "test.sh").read_text()
    assert all(f"tests/{tier}" in script for tier in TIERS)
    # A folder one run leaves out is run by another.
    for ignored in re.findall(r"--ignore=(\S+)", script):
        assert script.count(ignored) >= 2, f"scripts/test.sh leaves {ignored} out and runs it nowhere else"
