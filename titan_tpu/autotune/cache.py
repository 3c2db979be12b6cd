"""The table of measured kernel choices, one JSON file per machine user.

Keyed by everything a timing depends on: the device's name and capability flags, the thread count,
the torch version, the dtype, the field and its shapes. A file that cannot be read as the table is
moved aside (never trusted, never silently lost) with one warning, and the run measures again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV = "TITAN_TPU_CACHE_DIR"
FILE_NAME = "kernels.json"


def cache_folder() -> Path:
    """$TITAN_TPU_CACHE_DIR, else $XDG_CACHE_HOME/titan_tpu, else ~/.cache/titan_tpu."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "titan_tpu"


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("pick"), str)
        and isinstance(entry.get("times_ms"), dict)
        and all(isinstance(v, (int, float)) or v is None for v in entry["times_ms"].values())
    )


class KernelCache:
    """get/put of {"pick": name, "times_ms": {name: ms, or None for a refused candidate}} by key."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / FILE_NAME
        self.table = self._load()

    def _load(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {}
        try:
            table = json.loads(self.path.read_text("utf-8"))
            if not isinstance(table, dict) or not all(_valid_entry(e) for e in table.values()):
                raise ValueError("not a table of kernel choices")
        except (OSError, ValueError, UnicodeDecodeError) as error:
            aside = self.path.with_name(f"{FILE_NAME}.unreadable-{int(time.time())}")
            try:
                self.path.rename(aside)
                where = f"moved to {aside}"
            except OSError:
                where = "left in place"
            logger.warning("kernels: cache %s ignored (%s), %s; measuring again", self.path, error, where)
            return {}
        return table

    def get(self, key: str) -> dict[str, Any] | None:
        return self.table.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        """Adds the entry and rewrites the file atomically (a crash leaves the old file whole); a
        cache that cannot be written costs the next run a measurement, never this run."""
        self.table[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{FILE_NAME}.{os.getpid()}.partial")
            partial.write_text(json.dumps(self.table, indent=1, sort_keys=True), "utf-8")
            os.replace(partial, self.path)
        except OSError as error:
            logger.warning("kernels: cache %s not written (%s)", self.path, error)
