"""Where the repository and the tests' assets are, for tests at any depth of the tree."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "tests" / "assets"
