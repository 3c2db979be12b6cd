"""Every `# type: ignore` in the package names what it silences and says why, on its own line: the
type checker (scripts/lint.sh, mypy over titan_tpu/) then answers for everything else. mypy itself
refuses an ignore without its error code and one that no longer silences anything; this test asks
for the reason, which mypy cannot."""

from __future__ import annotations

import re

from tests.support.paths import REPO

IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def unexplained(text: str) -> list[int]:
    """Line numbers of ignores without an error code or without a reason after them."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        match = IGNORE.search(line)
        if match and (not match["codes"] or not re.match(r"\s*#\s*\S", match["rest"])):
            found.append(number)
    return found


def test_every_type_ignore_in_the_package_says_why() -> None:
    problems = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "titan_tpu").rglob("*.py"))
        for number in unexplained(path.read_text(encoding="utf-8"))
    ]
    assert problems == []


def test_the_check_sees_an_ignore_without_code_or_reason() -> None:
    text = "a = 1  # type: ignore\nb = 2  # type: ignore[assignment]\nc = 3  # type: ignore[misc]  # torch's stub\n"
    assert unexplained(text) == [1, 2]
