"""Local files as a document source: a file, a folder (recursive) or a glob of .txt/.jsonl/.parquet.

- `.txt`: the whole file is one document (UTF-8; a leading BOM is dropped). Files are not split at
  blank lines, so code and prose keep their structure; split large corpora into several files.
- `.jsonl`: one JSON object per line, text in `data.text_field`; blank lines are ignored.
- `.parquet`: column `data.text_field` (a string column), read in row batches with pyarrow.

Files are read in sorted order. A named file or a glob match with another extension is an error; in a
folder such files (a README, a license) are skipped with one warning. Hidden files are ignored.
Cursors: `.txt` (file,), `.jsonl` (file, byte offset, line index), `.parquet` (file, row).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.documents import Cursor, Document, Problems, text_of

if TYPE_CHECKING:  # pyarrow is optional (the parquet extra): imported where parquet is read
    import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

EXTENSIONS = (".txt", ".jsonl", ".parquet")
_ALLOWED = "allowed: .txt, .jsonl or .parquet files"
_PARQUET_BATCH_ROWS = 1024


def _check_extension(path: Path, origin: str) -> None:
    if path.suffix.lower() not in EXTENSIONS:
        raise ConfigError(
            f"data.path: {path}{origin} has unsupported extension '{path.suffix or '(none)'}'; {_ALLOWED}"
        )


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _folder_files(folder: Path) -> list[Path]:
    kept: list[Path] = []
    ignored: list[Path] = []
    for path in sorted(folder.rglob("*"), key=lambda p: p.relative_to(folder).as_posix()):
        if not path.is_file() or _hidden(path, folder):
            continue
        (kept if path.suffix.lower() in EXTENSIONS else ignored).append(path)
    if not kept:
        raise ConfigError(f"data.path: folder {folder} holds no .txt, .jsonl or .parquet file")
    if ignored:
        logger.warning(
            "data: ignored %d file(s) in %s with other extensions (first: %s); %s",
            len(ignored),
            folder,
            ignored[0],
            _ALLOWED,
        )
    return kept


def resolve_files(path: str) -> list[Path]:
    """The files `data.path` names, in a fixed order; a path that names nothing usable fails."""
    expanded = os.path.expanduser(path)
    if any(char in path for char in "*?["):
        matches = sorted(glob.glob(expanded, recursive=True))
        if not matches:
            raise ConfigError(f"data.path: glob '{path}' matches no file; {_ALLOWED}")
        files: list[Path] = []
        for match in map(Path, matches):
            if match.is_dir():
                files.extend(_folder_files(match))
            elif match.is_file():
                _check_extension(match, f" (matched by '{path}')")
                files.append(match)
        return list(dict.fromkeys(files))
    target = Path(expanded)
    if target.is_dir():
        return _folder_files(target)
    if target.is_file():
        _check_extension(target, "")
        return [target]
    raise ConfigError(f"data.path: {path} does not exist; {_ALLOWED}, a folder of them, or a glob")


class FileSource:
    """The files `data.path` names, read in sorted order; see the module docstring for the formats."""

    def __init__(self, path: str, text_field: str) -> None:
        self.files = resolve_files(path)
        self.text_field = text_field
        count = len(self.files)
        self.description = f"{path} ({count} file{'s' if count != 1 else ''})"
        self._warned = False
        parquet = [f for f in self.files if f.suffix.lower() == ".parquet"]
        if parquet:
            try:
                import pyarrow.parquet  # noqa: F401
            except ImportError:
                raise ConfigError(
                    f"data.path: reading {parquet[0]} needs pyarrow; install it: pip install pyarrow"
                ) from None
            self._open_parquet(parquet[0])  # a wrong column fails at start-up, not mid-run

    def documents(self, cursor: Cursor | None = None) -> Iterator[Document]:
        cursor = cursor or (0,)
        hint = f"; allowed: text in the '{self.text_field}' field (data.text_field)"
        problems = Problems(self.description, hint)
        for index in range(cursor[0], len(self.files)):
            position = cursor[1:] if index == cursor[0] else ()
            suffix = self.files[index].suffix.lower()
            if suffix == ".txt":
                yield from self._txt(index, problems)
            elif suffix == ".jsonl":
                yield from self._jsonl(index, position, problems)
            else:
                yield from self._parquet(index, position, problems)
        whole_pass = not any(cursor)
        self._warned = problems.finish(whole_pass=whole_pass, already_warned=self._warned)

    def _txt(self, index: int, problems: Problems) -> Iterator[Document]:
        path = self.files[index]
        try:
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as err:
            problems.record_bad(str(path), f"not valid UTF-8 at byte {err.start}")
            return
        except OSError as err:
            problems.record_bad(str(path), f"unreadable ({err.strerror or type(err).__name__})")
            return
        if text.strip():
            problems.record_good()
            yield (index,), text

    def _jsonl(self, index: int, position: Cursor, problems: Problems) -> Iterator[Document]:
        path = self.files[index]
        offset, line = position if position else (0, 0)
        with open(path, "rb") as handle:
            handle.seek(offset)
            for raw in handle:
                here, here_line = offset, line
                offset += len(raw)
                line += 1
                if not raw.strip():
                    continue
                where = f"{path} line {here_line + 1}"
                try:
                    record = json.loads(raw)
                except UnicodeDecodeError as err:
                    problems.record_bad(where, f"not valid UTF-8 at byte {err.start}")
                    continue
                except ValueError as err:
                    problems.record_bad(where, f"invalid JSON ({err})")
                    continue
                text, reason = text_of(record, self.text_field)
                if text is None:
                    problems.record_bad(where, reason)
                elif text.strip():
                    problems.record_good()
                    yield (index, here, here_line), text

    def _open_parquet(self, path: Path) -> pq.ParquetFile:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as err:
            raise ConfigError(f"data.path: {path} is not a readable parquet file ({err})") from None
        schema = parquet.schema_arrow
        if self.text_field not in schema.names:
            raise ConfigError(
                f"data.text_field: column '{self.text_field}' not in {path}; its columns: {', '.join(schema.names)}"
            )
        kind = schema.field(self.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(
                f"data.text_field: column '{self.text_field}' of {path} holds {kind}; allowed: a string column"
            )
        return parquet

    def _parquet(self, index: int, position: Cursor, problems: Problems) -> Iterator[Document]:
        path = self.files[index]
        parquet = self._open_parquet(path)
        start = position[0] if position else 0
        # Skip whole row groups without reading them, then the first rows of the next one.
        first_group, row = 0, 0
        while first_group < parquet.num_row_groups:
            rows = parquet.metadata.row_group(first_group).num_rows
            if row + rows > start:
                break
            row += rows
            first_group += 1
        groups = list(range(first_group, parquet.num_row_groups))
        if not groups:
            return
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[self.text_field])
        for batch in batches:
            for text in batch.column(0).to_pylist():
                here = row
                row += 1
                if here < start:
                    continue
                if text is None:
                    problems.record_bad(f"{path} row {here}", f"'{self.text_field}' is null")
                elif text.strip():
                    problems.record_good()
                    yield (index, here), text
