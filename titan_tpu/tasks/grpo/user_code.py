"""Your own reward modules: where `module:function` is looked for, and how a failure inside your code
is reported.

A module is imported from the Python path first, as `import` would; failing that, from the folder of
the config file (a reward file kept beside the config) and then the current folder (the one the run
was started in), neither of which Python puts on its path when `train.py` is run from elsewhere. The
folder it is found in then goes on the Python path, so that the module's own imports of the files
beside it work as they do in a script. A module in none of them is one line naming the folders;
an exception raised by your code keeps its traceback (your file and line), after the one line.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType, TracebackType

from titan_tpu.config import ConfigError, TrainConfig

# Where importlib's frames come from: its package, and the frozen copy of its bootstrap.
_IMPORTLIB = (str(Path(importlib.__file__).parent), "<frozen ")


def search_folders(config: TrainConfig) -> list[Path]:
    """After the Python path: the config file's folder (when it was loaded from a file), then the
    current folder."""
    folders = [] if config.source_file is None else [config.source_file.parent]
    here = Path.cwd().resolve()
    return folders if here in folders else [*folders, here]


def traceback_text(error: BaseException, start: TracebackType | None) -> str:
    """Python's own report of `error` from the frame `start` on (the frames above it are ours), less
    importlib's frames: what is left is your code and what it called."""
    report = traceback.TracebackException(type(error), error, start)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if not frame.filename.startswith(_IMPORTLIB)]
    )
    return "".join(report.format()).rstrip("\n")


def _missing(error: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the module itself (or a package above it) is what was not found, rather than something
    the module imports."""
    parts = module_name.split(".")
    return error.name in {".".join(parts[: i + 1]) for i in range(len(parts))}


def _import(module_name: str, where: str) -> ModuleType | None:
    """The module from the Python path as it is now; None when it is not there."""
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # anything your module raises while it is imported, SyntaxError included
        if isinstance(error, ModuleNotFoundError) and _missing(error, module_name):
            return None
        # The frames from your module's on: the first one is this function's call.
        own_frames = error.__traceback__.tb_next if error.__traceback__ is not None else None
        raise ConfigError(
            f"{where}: importing {module_name!r} raised {type(error).__name__}: {error}\n"
            + traceback_text(error, own_frames)
        ) from None


def import_user_module(module_name: str, folders: Sequence[Path], where: str) -> ModuleType:
    """`module_name` from the Python path, else from the first of `folders` that holds it."""
    module = _import(module_name, where)
    if module is not None:
        return module
    top = module_name.split(".")[0]
    for folder in folders:
        if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
            importlib.invalidate_caches()  # the finders may have listed the folder before the file was there
            module = _import(module_name, where)
            if module is not None:
                return module
    searched = "".join(f" or in {folder}" for folder in folders)
    raise ConfigError(
        f"{where}: no module {module_name!r} on the Python path{searched}; put {top}.py next to the config or "
        "in the folder you run from, or add its folder to PYTHONPATH"
    )
