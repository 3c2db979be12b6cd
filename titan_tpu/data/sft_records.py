"""Fine-tuning records from local files: one JSON object per line of a .jsonl, one row of a .parquet.

Unlike pretraining text, where a malformed record is skipped and counted (`documents.py`), a
fine-tuning record that cannot be read stops the run with one line naming its file and line: a
dataset of conversations is small and curated, and a silently skipped example is a silently
different fine-tune. Each record comes with its cursor (file index, record index in the file), from
which the stream restarts exactly, and with where it is (`file:line`, or `file: row n`) for errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.files import resolve_files

RecordCursor = tuple[int, int]  # (file index, record index within the file)
_PARQUET_BATCH_ROWS = 1024


def record_files(path: str) -> list[Path]:
    """The .jsonl and .parquet files `data.path` names (a file, a folder or a glob)."""
    files = resolve_files(path)
    for file in files:
        if file.suffix.lower() == ".txt":
            raise ConfigError(f"data.path: {file}: fine-tuning reads .jsonl or .parquet records, not .txt")
    return files


def _jsonl(path: Path, skip: int) -> Iterator[tuple[int, str, dict[str, Any]]]:
    index = 0
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            if index >= skip:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
                if not isinstance(record, dict):
                    raise ConfigError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
                yield index, where, record
            index += 1


def _parquet(path: Path, skip: int) -> Iterator[tuple[int, str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data.path: reading {path} needs pyarrow; install it: pip install pyarrow") from None
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        if index + batch.num_rows <= skip:
            index += batch.num_rows
            continue
        for record in batch.to_pylist():
            if index >= skip:
                yield index, f"{path}: row {index}", record
            index += 1


def read_records(files: list[Path], start: RecordCursor = (0, 0)) -> Iterator[tuple[RecordCursor, str, dict[str, Any]]]:
    """(cursor, where, record) for every record from `start` on, files in order. The cursor is the
    record's own; resuming at it yields that record again (resume after the last one consumed: its
    cursor with the record index + 1)."""
    first_file, first_record = start
    for file_index in range(first_file, len(files)):
        path = files[file_index]
        skip = first_record if file_index == first_file else 0
        reader = _jsonl if path.suffix.lower() == ".jsonl" else _parquet
        for index, where, record in reader(path, skip):
            yield (file_index, index), where, record


def _named(error: ConfigError, key: str) -> ConfigError:
    """The file helpers name `data.path`; a held-out source's path is another key's value."""
    return ConfigError(key + str(error).removeprefix("data.path")) if str(error).startswith("data.path:") else error


class FileRecords:
    """The records of `data.path`'s .jsonl and .parquet files, in file order. `key`: the config key the
    path came from (validation.path, rl.eval_path), which messages name."""

    def __init__(self, path: str, key: str = "data.path") -> None:
        try:
            self.files = record_files(path)
        except ConfigError as error:
            raise _named(error, key) from None
        self.description = f"{key} {path!r} ({len(self.files)} file{'s' * (len(self.files) != 1)})"

    def records(self, start: RecordCursor = (0, 0)) -> Iterator[tuple[RecordCursor, str, dict[str, Any]]]:
        return read_records(self.files, start)


class HuggingFaceRecords:
    """The rows of an offline Hugging Face dataset: a folder written by `save_to_disk`, or a name or
    folder `datasets.load_dataset` finds in the local cache (the Hub stays off, `sources.hub_offline`)."""

    def __init__(self, path: str, split: str, key: str = "data.path") -> None:
        from titan_tpu.data.sources import hub_offline

        try:
            import datasets
        except ImportError:
            raise ConfigError("data.source: 'huggingface' needs the datasets package (pip install datasets)") from None
        self.description = f"Hugging Face dataset '{path}' (split '{split}')"
        folder = Path(path).expanduser()
        with hub_offline():
            try:
                if (folder / "dataset_dict.json").is_file():  # save_to_disk of a DatasetDict: its splits
                    self._rows = datasets.load_from_disk(str(folder))[split]
                elif (folder / "dataset_info.json").is_file():  # save_to_disk of one Dataset
                    self._rows = datasets.load_from_disk(str(folder))
                else:
                    self._rows = datasets.load_dataset(path, split=split)
            except Exception as err:  # datasets raises many types; all mean "cannot use this input"
                reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
                raise ConfigError(
                    f"{key}: cannot load {self.description}: {type(err).__name__}: {reason[:300]}"
                ) from None

    def records(self, start: RecordCursor = (0, 0)) -> Iterator[tuple[RecordCursor, str, dict[str, Any]]]:
        for index in range(start[1], len(self._rows)):
            yield (0, index), f"{self.description}: row {index}", self._rows[index]
