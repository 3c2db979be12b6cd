"""Every relative link in README.md and in docs/**/*.md points at a file (or folder) of the repository.

The bug this catches: a page moved or renamed (the README's topics moved to docs/, measurements to
docs/benchmarks/) while a link to its old place stays, which GitHub renders as a 404. `#anchors` are
stripped, `http(s)://` and `mailto:` links are not checked, and links inside code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.support.paths import REPO

_FENCED = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = ("http://", "https://", "mailto:")

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def broken_links(text: str, page: Path, root: Path) -> list[str]:
    """The relative link targets of `text` (the markdown of `page`) that name nothing under `root`."""
    text = _CODE_SPAN.sub("", _FENCED.sub("", text))
    broken = []
    for target in _LINK.findall(text):
        path = unquote(target.split("#", 1)[0])
        if target.startswith(_EXTERNAL) or not path:  # a web address, or an anchor on the same page
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(REPO).as_posix() for page in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page.read_text(encoding="utf-8"), page, REPO) == []


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    """Negative control: only the link to a missing file is reported, not the good, external,
    anchor-only or code-quoted ones."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# there\n", encoding="utf-8")
    page = tmp_path / "README.md"
    text = (
        "[good](docs/there.md#a-section) ![image](docs/there.md) [web](https://example.com/x.md)\n"
        "[mail](mailto:a@example.com) [anchor](#top) `[quoted](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[broken](docs/missing.md#part) [outside](../README.md)\n"
    )
    assert broken_links(text, page, tmp_path) == ["docs/missing.md#part", "../README.md"]
