"""Document sources: embedded stdlib, local txt/jsonl/parquet files, Hugging Face datasets (faked)."""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from pathlib import Path

import pytest

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import DataConfig
from titan_tpu.data import build_source
from titan_tpu.data.files import FileSource
from titan_tpu.data.sources import EmbeddedSource, HuggingFaceSource


def files_cfg(path: Path | str, **kw) -> DataConfig:
    return DataConfig(source="files", path=str(path), **kw)


def texts(source, cursor=None) -> list[str]:
    return [text for _, text in source.documents(cursor)]


def write_parquet(path: Path, column: list, name: str = "text", row_group_size: int = 3) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({name: column, "id": list(range(len(column)))})
    pq.write_table(table, path, row_group_size=row_group_size)


def test_embedded_source_is_sorted_stdlib_without_tests() -> None:
    source = build_source(DataConfig(source="embedded"))
    assert isinstance(source, EmbeddedSource)
    rel = [p.relative_to(source.root).as_posix() for p in source.files]
    assert rel == sorted(rel) and len(rel) > 100
    assert "os.py" in rel and "json/__init__.py" in rel
    assert not any(part in {"test", "tests", "site-packages", "__pycache__"} for r in rel for part in r.split("/"))
    docs = source.documents()
    first_cursor, first_text = next(docs)
    assert first_text == source.files[first_cursor[0]].read_text("utf-8")
    # Resuming at a cursor yields that very document first, and the same ones after it.
    stream = [doc for _, doc in zip(range(5), source.documents())]
    cursor = stream[2][0]
    assert [doc for _, doc in zip(range(3), source.documents(cursor))] == stream[2:]


def test_txt_jsonl_parquet_folder_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("\ufeffwhole file\n\nis one document\n", encoding="utf-8")
    (tmp_path / "b" / "c.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "meta": 1}) for t in ["j0", "j1", "j2"]) + "\n\n"
    )
    write_parquet(tmp_path / "b" / "d.parquet", [f"p{i}" for i in range(8)])
    (tmp_path / ".hidden.txt").write_text("never read")
    source = build_source(files_cfg(tmp_path))
    expected = ["whole file\n\nis one document\n", "j0", "j1", "j2"] + [f"p{i}" for i in range(8)]
    assert texts(source) == expected


def test_every_cursor_resumes_at_its_document(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("txt doc")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": f"j{i}"}) + "\n" for i in range(5)))
    write_parquet(tmp_path / "c.parquet", [f"p{i}" for i in range(10)], name="body")
    (tmp_path / "d.txt").write_text("last")
    source = build_source(files_cfg(tmp_path, text_field="body"))
    docs = list(source.documents())
    assert len(docs) == 1 + 5 + 10 + 1
    for index, (cursor, _) in enumerate(docs):
        assert texts(source, cursor) == [t for _, t in docs[index:]], cursor


def test_glob_and_single_file(tmp_path: Path) -> None:
    for name in ("x1.txt", "x2.txt", "y.txt"):
        (tmp_path / name).write_text(name)
    assert texts(build_source(files_cfg(tmp_path / "x*.txt"))) == ["x1.txt", "x2.txt"]
    assert texts(build_source(files_cfg(tmp_path / "y.txt"))) == ["y.txt"]


def test_bad_paths_fail_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "emptydir").mkdir()
    cases = [
        (tmp_path / "missing.jsonl", "does not exist"),
        (tmp_path / "*.jsonl", "matches no file"),
        (tmp_path / "data.csv", r"unsupported extension '\.csv'.*\.txt, \.jsonl or \.parquet"),
        (tmp_path / "*.csv", r"unsupported extension"),
        (tmp_path / "emptydir", r"holds no \.txt, \.jsonl or \.parquet file"),
    ]
    with pytest.raises(ConfigError, match=r"data.path: is required when data.source = 'files'"):
        build_source(files_cfg(""))
    for path, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as err:
            build_source(files_cfg(path))
        assert str(err.value).startswith("data.path: ") and "\n" not in str(err.value)


def test_folder_skips_other_extensions_with_one_warning(tmp_path: Path, caplog) -> None:
    (tmp_path / "README.md").write_text("# readme")
    (tmp_path / "LICENSE").write_text("license")
    (tmp_path / "a.txt").write_text("doc")
    with caplog.at_level(logging.WARNING, logger="titan_tpu.data"):
        source = build_source(files_cfg(tmp_path))
    assert texts(source) == ["doc"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ignored 2 file(s)" in warnings[0].getMessage()


def test_malformed_records_are_counted_and_warned_once(tmp_path: Path, caplog) -> None:
    lines = [
        json.dumps({"text": "good 0"}),
        "{broken json",
        json.dumps({"content": "wrong key"}),
        json.dumps({"text": 42}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"text": "good 1"}),
    ]
    (tmp_path / "a.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "\xff\xfe"}\n')
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe not utf-8")
    source = build_source(files_cfg(tmp_path))
    with caplog.at_level(logging.WARNING, logger="titan_tpu.data"):
        assert texts(source) == ["good 0", "good 1"]
        assert texts(source) == ["good 0", "good 1"]  # a second pass (epoch) does not warn again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 6 malformed record(s)" in warnings[0]
    assert f"{tmp_path / 'a.jsonl'} line 2: invalid JSON" in warnings[0]


def test_source_without_usable_document_names_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"content": f"c{i}"}) + "\n" for i in range(3)))
    with pytest.raises(ConfigError) as err:
        texts(build_source(files_cfg(bad)))
    message = str(err.value)
    assert str(bad) in message and "no usable document" in message
    assert "no 'text' field" in message and "its keys: content" in message and "\n" not in message


def test_parquet_schema_errors_at_build(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", ["x", "y"], name="body")
    with pytest.raises(ConfigError, match=r"column 'text' not in .*its columns: body, id"):
        build_source(files_cfg(tmp_path / "a.parquet"))
    with pytest.raises(ConfigError, match=r"column 'id' .* holds int64; allowed: a string column"):
        build_source(files_cfg(tmp_path / "a.parquet", text_field="id"))
    write_parquet(tmp_path / "n.parquet", ["ok", None, "ok2"])
    assert texts(build_source(files_cfg(tmp_path / "n.parquet"))) == ["ok", "ok2"]


def test_parquet_without_pyarrow_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    write_parquet(tmp_path / "a.parquet", ["x"])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"needs pyarrow; install it: pip install pyarrow"):
        build_source(files_cfg(tmp_path / "a.parquet"))


def test_huggingface_needs_datasets(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"needs the datasets package \(pip install datasets\)"):
        build_source(DataConfig(source="huggingface", path="org/corpus"))


class _FakeStream:
    def __init__(self, records: list) -> None:
        self.records = records

    def __iter__(self):
        return iter(self.records)

    def skip(self, n: int) -> _FakeStream:
        return _FakeStream(self.records[n:])


def _fake_datasets(monkeypatch, load_dataset) -> None:
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_environment() -> tuple[str | None, ...]:
    return tuple(os.environ.get(name) for name in OFFLINE_VARIABLES)


def test_huggingface_streams_offline_and_resumes(monkeypatch) -> None:
    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    calls = []
    records = [{"text": "a"}, {"text": None}, {"text": "b"}, {"text": "c"}]

    def load_dataset(path, split, streaming):
        calls.append((path, split, streaming, *offline_environment()))
        return _FakeStream(records)

    _fake_datasets(monkeypatch, load_dataset)
    source = build_source(DataConfig(source="huggingface", path="org/corpus", hf_split="validation"))
    assert isinstance(source, HuggingFaceSource)
    # Offline while loading, and the process's environment as it was afterwards (HF_HUB_OFFLINE
    # left set would switch off every later Hub download in the process, e.g. a tokenizer's).
    assert calls == [("org/corpus", "validation", True, "1", "1")]
    assert offline_environment() == (None, None)
    docs = list(source.documents())
    assert docs == [((0,), "a"), ((2,), "b"), ((3,), "c")]
    assert texts(source, (2,)) == ["b", "c"]


def test_huggingface_keeps_the_users_own_offline_choice(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    seen = []

    def load_dataset(path, split, streaming):
        seen.append(offline_environment())
        return _FakeStream([{"text": "a"}])

    _fake_datasets(monkeypatch, load_dataset)
    build_source(DataConfig(source="huggingface", path="org/corpus"))
    assert seen == [("0", None)] and offline_environment() == ("0", None)


def test_real_datasets_offline_only_while_loading(tmp_path: Path, monkeypatch) -> None:
    """With the real `datasets` already imported (its offline flag read at import, as when
    transformers came first), a Hub name still fails at once, offline, and nothing stays changed."""
    datasets = pytest.importorskip("datasets")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in "xyz"))

    source = build_source(DataConfig(source="huggingface", path=str(folder), hf_split="train"))
    assert texts(source) == ["x", "y", "z"] and texts(source, (1,)) == ["y", "z"]
    # Not in the cache: without the Hub switched off this retries the network for ~20 s.
    with pytest.raises(ConfigError, match=r"OfflineModeIsEnabled"):
        build_source(DataConfig(source="huggingface", path="titan-tpu-test/not-cached"))
    assert offline_environment() == (None, None)
    assert hub_constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False


def test_huggingface_load_error_becomes_one_line(monkeypatch) -> None:
    def load_dataset(path, split, streaming):
        raise FileNotFoundError(f"Couldn't find a dataset script at {path}\nor any data file in the same directory.")

    _fake_datasets(monkeypatch, load_dataset)
    with pytest.raises(ConfigError) as err:
        build_source(DataConfig(source="huggingface", path="org/missing"))
    message = str(err.value)
    assert message.startswith("data.path: cannot load Hugging Face dataset 'org/missing'")
    assert "FileNotFoundError: Couldn't find a dataset script" in message and "\n" not in message


def test_wrong_text_field_gives_up_early(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"content": "x"}) + "\n" for _ in range(5000)))
    source = build_source(files_cfg(path))
    docs = source.documents()
    with pytest.raises(ConfigError, match=r"first 1000 records .* are all unusable .*no 'text' field"):
        next(docs)


def test_folder_without_usable_document_names_the_folder_and_its_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("  \n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ConfigError) as err:
        texts(FileSource(str(tmp_path), "text"))
    assert str(err.value).startswith(f"data.path: {tmp_path} (2 files) holds no usable document")
