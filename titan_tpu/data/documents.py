"""The contract every document source keeps, and the bookkeeping of malformed records they share.

A source yields `(cursor, text)` pairs. A cursor is a tuple of ints that, handed back to
`documents(cursor)`, restarts the stream *at* that document without reading what came before it (a
file index and a byte offset or row number). Cursors go into the data loader's checkpoint state.

Malformed records (bad JSON, missing or non-string text, undecodable bytes) are counted and skipped;
each source logs one warning per pass with the count and the first example. A whole pass that yields
no usable document raises a ConfigError naming the source.

The sources themselves live in `sources.py` (embedded corpus, Hugging Face datasets) and `files.py`
(local files); `loader.build_source` picks one from the config. This module imports neither, so the
sources depend on it and never on each other.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

from titan_tpu.config.errors import ConfigError

logger = logging.getLogger(__name__)

Cursor = tuple[int, ...]
Document = tuple[Cursor, str]


class DocumentSource(Protocol):
    description: str  # names the source in messages, e.g. the path

    def documents(self, cursor: Cursor | None = None) -> Iterator[Document]: ...


class Problems:
    """Counts malformed records over one pass and reports them once, not once per record."""

    # With this many malformed records and not one usable document yet, the input is wrong as a
    # whole (a wrong data.text_field, a binary file): stop instead of scanning terabytes first.
    GIVE_UP_AFTER = 1000

    def __init__(self, description: str, hint: str = "") -> None:
        self.description = description
        self.hint = hint
        self.bad = 0
        self.good = 0
        self.first: str | None = None

    def record_bad(self, location: str, reason: str) -> None:
        self.bad += 1
        if self.first is None:
            self.first = f"{location}: {reason}"
        if self.good == 0 and self.bad >= self.GIVE_UP_AFTER:
            raise ConfigError(
                f"data.path: the first {self.bad} records of {self.description} are all unusable "
                f"(first: {self.first}){self.hint}"
            )

    def record_good(self) -> None:
        self.good += 1

    def finish(self, whole_pass: bool, already_warned: bool) -> bool:
        """End of a pass: raise if nothing was usable, warn about skipped records. Returns warned."""
        if whole_pass and self.good == 0:
            detail = f" ({self.bad} malformed, first: {self.first})" if self.bad else ""
            raise ConfigError(f"data.path: {self.description} holds no usable document{detail}{self.hint}")
        if self.bad and not already_warned:
            logger.warning(
                "data: skipped %d malformed record(s) in %s; first: %s",
                self.bad,
                self.description,
                self.first,
            )
            return True
        return already_warned


def text_of(record: Any, text_field: str) -> tuple[str | None, str]:
    """The text of a JSON / datasets record, or None and the reason it has none."""
    if not isinstance(record, dict):
        return None, f"record is a {type(record).__name__}, not an object"
    if text_field not in record:
        keys = ", ".join(list(map(str, record))[:8]) or "none"
        return None, f"no '{text_field}' field (data.text_field; its keys: {keys})"
    text = record[text_field]
    if not isinstance(text, str):
        return None, f"field '{text_field}' is {type(text).__name__}, not a string"
    return text, ""
