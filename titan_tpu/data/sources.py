"""Document sources: where raw text comes from, one document at a time, resumable at any document.

A source yields `(cursor, text)` pairs. A cursor is a tuple of ints that, handed back to
`documents(cursor)`, restarts the stream *at* that document without reading what came before it (a
file index and a byte offset or row number). Cursors go into the data loader's checkpoint state.

Malformed records (bad JSON, missing or non-string text, undecodable bytes) are counted and skipped;
each source logs one warning per pass with the count and the first example. A whole pass that yields
no usable document raises a ConfigError naming the source.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import DataConfig

logger = logging.getLogger(__name__)

Cursor = tuple[int, ...]
Document = tuple[Cursor, str]

# Folders of the standard library that are not the library itself.
_EMBEDDED_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


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
            raise ConfigError(
                f"data.path: {self.description} holds no usable document{detail}{self.hint}"
            )
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


class EmbeddedSource:
    """The `.py` files of the running Python's standard library: a corpus every install ships."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
        self.description = f"the embedded corpus (Python standard library at {self.root})"
        self._files: list[Path] | None = None
        self._warned = False

    @property
    def files(self) -> list[Path]:
        if self._files is None:
            found: list[Path] = []
            for folder, subdirs, names in os.walk(self.root):
                subdirs[:] = [d for d in subdirs if d not in _EMBEDDED_SKIP and not d.startswith(".")]
                found.extend(Path(folder) / n for n in names if n.endswith(".py"))
            # Sorted by relative path so the order is the same on every host and every run.
            self._files = sorted(found, key=lambda p: p.relative_to(self.root).as_posix())
            if not self._files:
                raise ConfigError(
                    f"data.source: no .py files under {self.root} for the embedded corpus; "
                    "use data.source = 'files' with data.path"
                )
        return self._files

    def documents(self, cursor: Cursor | None = None) -> Iterator[Document]:
        start = cursor[0] if cursor else 0
        problems = Problems(self.description)
        files = self.files
        for index in range(start, len(files)):
            try:
                text = files[index].read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError) as err:
                problems.record_bad(str(files[index]), type(err).__name__)
                continue
            if text.strip():
                problems.record_good()
                yield (index,), text
        self._warned = problems.finish(whole_pass=start == 0, already_warned=self._warned)


class HuggingFaceSource:
    """A `datasets` dataset, streamed; offline unless the user switched the Hub back on."""

    def __init__(self, path: str, split: str, text_field: str) -> None:
        # Read by `datasets` / `huggingface_hub` when they are imported: a dataset that is not in
        # the local cache must fail at once, not hang on a network that is not there.
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import datasets
        except ImportError:
            raise ConfigError(
                "data.source: 'huggingface' needs the datasets package (pip install datasets); "
                "or use data.source = 'files' or 'embedded'"
            ) from None
        self.path, self.split, self.text_field = path, split, text_field
        self.description = f"Hugging Face dataset '{path}' (split '{split}')"
        try:
            self._dataset = datasets.load_dataset(path, split=split, streaming=True)
        except Exception as err:  # datasets raises many types; all mean "cannot use this input"
            lines = [line for line in str(err).splitlines() if line.strip()]
            reason = lines[0][:300] if lines else type(err).__name__
            raise ConfigError(
                f"data.path: cannot load {self.description} (offline: HF_DATASETS_OFFLINE="
                f"{os.environ['HF_DATASETS_OFFLINE']}): {type(err).__name__}: {reason}"
            ) from None
        self._warned = False

    def documents(self, cursor: Cursor | None = None) -> Iterator[Document]:
        start = cursor[0] if cursor else 0
        hint = "; allowed: a data.text_field present in every record"
        problems = Problems(self.description, hint)
        stream = self._dataset.skip(start) if start else self._dataset
        for index, record in enumerate(stream, start):
            text, reason = text_of(record, self.text_field)
            if text is None:
                problems.record_bad(f"record {index}", reason)
            elif text.strip():
                problems.record_good()
                yield (index,), text
        self._warned = problems.finish(whole_pass=start == 0, already_warned=self._warned)


def build_source(cfg: DataConfig) -> DocumentSource:
    """The document source `cfg.source` names; bad paths fail here, before any training starts."""
    if cfg.source == "embedded":
        source = EmbeddedSource()
        _ = source.files  # list them now: an install without sources fails at start-up
        return source
    if cfg.source in ("files", "huggingface") and not cfg.path:
        raise ConfigError(f"data.path: is required when data.source = '{cfg.source}'")
    if cfg.source == "files":
        from titan_tpu.data.files import FileSource

        return FileSource(cfg.path, cfg.text_field)
    if cfg.source == "huggingface":
        return HuggingFaceSource(cfg.path, cfg.hf_split, cfg.text_field)
    raise ConfigError(
        f"data.source: unknown source '{cfg.source}'; allowed: embedded, files, huggingface"
    )
