"""Two document sources: the embedded corpus every Python install ships, and a Hugging Face dataset.

Local files are the third (`files.py`); all three keep the contract in `documents.py`, and
`loader.build_source` picks one from `[data] source`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.documents import Cursor, Document, Problems, text_of

# Folders of the standard library that are not the library itself.
_EMBEDDED_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

# The environment variables that switch the Hub off, and the module constants the libraries copy
# them into when first imported (read again on every request, so setting them takes effect).
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_OFFLINE_CONSTANTS = (
    ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
    ("datasets.config", "HF_HUB_OFFLINE"),
    ("datasets.config", "HF_DATASETS_OFFLINE"),
)


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


@contextlib.contextmanager
def hub_offline() -> Iterator[bool]:
    """The Hugging Face Hub switched off for the block only; yields whether it is off.

    A dataset missing from the local cache must fail at once, not hang on a network that is not
    there. A user who set HF_HUB_OFFLINE or HF_DATASETS_OFFLINE chose for themselves: nothing is
    changed then. Otherwise the variables (seen by a library first imported inside the block) and
    the constants of the libraries already imported are set, and all of them restored afterwards,
    so the rest of the process (a transformers download elsewhere) keeps its own setting.
    """
    chosen = [name for name in _OFFLINE_VARIABLES if name in os.environ]
    if chosen:
        yield os.environ[chosen[0]].strip().upper() in {"1", "ON", "YES", "TRUE"}
        return
    constants = []
    for module_name, attribute in _OFFLINE_CONSTANTS:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            if hasattr(module, attribute):
                constants.append((module, attribute, getattr(module, attribute)))
    try:
        for name in _OFFLINE_VARIABLES:
            os.environ[name] = "1"
        for module, attribute, _ in constants:
            setattr(module, attribute, True)
        yield True
    finally:
        for name in _OFFLINE_VARIABLES:
            os.environ.pop(name, None)
        for module, attribute, previous in constants:
            setattr(module, attribute, previous)


class HuggingFaceSource:
    """A `datasets` dataset, streamed from the local cache or a local folder (see `hub_offline`)."""

    def __init__(self, path: str, split: str, text_field: str) -> None:
        try:
            import datasets
        except ImportError:
            raise ConfigError(
                "data.source: 'huggingface' needs the datasets package (pip install datasets); "
                "or use data.source = 'files' or 'embedded'"
            ) from None
        self.path, self.split, self.text_field = path, split, text_field
        self.description = f"Hugging Face dataset '{path}' (split '{split}')"
        with hub_offline() as offline:
            try:
                self._dataset = datasets.load_dataset(path, split=split, streaming=True)
            except Exception as err:  # datasets raises many types; all mean "cannot use this input"
                lines = [line for line in str(err).splitlines() if line.strip()]
                reason = lines[0][:300] if lines else type(err).__name__
                hub = " (the Hub is off; HF_HUB_OFFLINE=0 lets datasets download)" if offline else ""
                raise ConfigError(
                    f"data.path: cannot load {self.description}{hub}: {type(err).__name__}: {reason}"
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
