"""Fine-tuning records from .jsonl and .parquet files (titan_tpu/data/sft_records.py).

Bugs caught: blank lines counted as records (cursors that drift), a resume that repeats or skips a
record, a malformed line skipped instead of stopping the run with its file and line, .txt files read
as records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError
from titan_tpu.data.sft_records import HuggingFaceRecords, read_records, record_files


def _write(tmp_path: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "p0", "completion": "c0"})
        + "\n\n"
        + json.dumps({"prompt": "p1", "completion": "c1"})
        + "\n"
    )
    pq.write_table(pa.table({"prompt": ["p2", "p3"], "completion": ["c2", "c3"]}), tmp_path / "b.parquet")
    return record_files(str(tmp_path))


def test_records_come_in_order_with_cursors_and_resume_exactly(tmp_path: Path) -> None:
    files = _write(tmp_path)
    seen = list(read_records(files))
    assert [r["prompt"] for _, _, r in seen] == ["p0", "p1", "p2", "p3"]
    assert [c for c, _, _ in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert seen[1][1] == f"{files[0]}:3" and seen[3][1] == f"{files[1]}: row 1"
    for k, (cursor, _, _) in enumerate(seen):
        assert [r["prompt"] for _, _, r in read_records(files, cursor)] == [f"p{i}" for i in range(k, 4)]


def test_a_malformed_line_stops_with_its_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=rf"^{bad}:2: not valid JSON"):
        list(read_records(record_files(str(bad))))
    bad.write_text('["a list"]\n')
    with pytest.raises(ConfigError, match=rf"^{bad}:1: a record must be a JSON object, got list"):
        list(read_records(record_files(str(bad))))


def test_text_files_are_not_records(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="fine-tuning reads .jsonl or .parquet records, not .txt"):
        record_files(str(tmp_path / "notes.txt"))


def test_an_offline_dataset_folder_gives_its_rows_in_order_and_resumes(tmp_path: Path) -> None:
    """Both folders `save_to_disk` writes (one Dataset, a DatasetDict of splits) are read offline;
    catches a split ignored, rows out of order, a resume cursor that skips or repeats a row."""
    datasets = pytest.importorskip("datasets")
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(5)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    one = HuggingFaceRecords(str(tmp_path / "one"), "train")
    assert [record for _, _, record in one.records()] == rows
    assert [cursor for cursor, _, _ in one.records((0, 3))] == [(0, 3), (0, 4)]
    assert [record for _, _, record in HuggingFaceRecords(str(tmp_path / "dict"), "test").records()] == rows[:1]
    with pytest.raises(ConfigError, match="cannot load Hugging Face dataset"):
        HuggingFaceRecords(str(tmp_path / "dict"), "validation")
