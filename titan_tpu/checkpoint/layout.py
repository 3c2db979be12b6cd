"""The checkpoint folder on disk: which steps are complete, how a save becomes visible, what is deleted.

    <dump_folder>/<checkpoint.folder>/
        step-10/                    complete: renamed into place after every rank finished
            .metadata  __0_0.distcp  __1_0.distcp  __0_checksums.json ...
            manifest.json           written last, before the rename: files, sizes, CRC-32s
        .step-20.tmp-1a2b3c4d/      a save in progress (or left by a killed run): never loaded
        .step-5.deleting-1a2b3c4d/  retention moving an old checkpoint out of sight before deleting it
        step-30.damaged-corrupted/  failed its check when a run resumed from it (checkpoint.on_damage =
                                    "fallback"): moved aside, never loaded, never deleted

A checkpoint counts as complete only when its folder has the final name AND its manifest. The rename is
atomic, so a run killed at any moment leaves either the old set of complete checkpoints or the new one.
Only the coordinating rank (rank 0) renames, writes manifests and deletes.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

from titan_tpu.checkpoint.storage import (
    CHECKSUM_SUFFIX,
    METADATA_FILE,
    file_digest,
    fsync_dir,
    write_json_durably,
)
from titan_tpu.config.errors import ConfigError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DAMAGE_NOTE = "damage.txt"  # in a folder moved aside as damaged: when, and what was found
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TEMP_RE = re.compile(r"^\.step-(\d+)\.(tmp|deleting)-[0-9a-z]+$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def temp_dir(root: Path, step: int, run_id: str) -> Path:
    return root / f".step-{step}.tmp-{run_id}"


def damaged_dir(root: Path, step: int, why: str) -> Path:
    """Where a damaged `step-N` goes: `step-N.damaged-<why>`, with -2, -3, ... when taken before."""
    folder = root / f"step-{step}.damaged-{why}"
    copy = 2
    while folder.exists():
        folder = root / f"step-{step}.damaged-{why}-{copy}"
        copy += 1
    return folder


def is_complete(folder: Path) -> bool:
    return _STEP_RE.match(folder.name) is not None and (folder / MANIFEST).is_file()


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def incomplete_step_dirs(root: Path) -> list[Path]:
    """`step-N` folders without a manifest: not ours to delete (a copy in progress?), never loaded."""
    if not root.is_dir():
        return []
    return sorted(
        entry
        for entry in root.iterdir()
        if _STEP_RE.match(entry.name) and entry.is_dir() and not (entry / MANIFEST).is_file()
    )


def choose_step(root: Path, wanted: int) -> tuple[int | None, str | None, list[int]]:
    """(step to load or None, error or None, complete steps after it) for checkpoint.load_step."""
    steps = complete_steps(root)
    if wanted == -1:
        return (steps[-1] if steps else None), None, []
    if wanted in steps:
        return wanted, None, [s for s in steps if s > wanted]
    listed = ", ".join(map(str, steps)) if steps else "none"
    why = "is incomplete" if step_dir(root, wanted).exists() else "does not exist"
    error = f"checkpoint.load_step = {wanted}: {step_dir(root, wanted)} {why}; complete checkpoints in {root}: {listed}"
    return None, error, []


def clean_stale(root: Path) -> list[Path]:
    """Remove temporary folders of saves that never finished and deletions that were interrupted.

    Call only when no save of this run is in flight (at start-up, before the first save).
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        if _TEMP_RE.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {folder}: file {MANIFEST} is missing") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {folder}: file {MANIFEST} is unreadable ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or METADATA_FILE not in files:
        raise ConfigError(f"checkpoint {folder}: file {MANIFEST} lists no {METADATA_FILE}")
    return manifest


def commit(temp: Path, final: Path, step: int, extra: dict[str, Any]) -> None:
    """Seal a finished save: fold the per-rank checksums and the metadata's into the manifest, make it
    durable, then rename the folder into place. Rank 0 only, after DCP's save returned."""
    files: dict[str, dict[str, int]] = {}
    for checksums in sorted(temp.glob(f"__*_{CHECKSUM_SUFFIX}")):
        files.update(json.loads(checksums.read_text(encoding="utf-8")))
    files[METADATA_FILE] = file_digest(temp / METADATA_FILE)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        **extra,
    }
    write_json_durably(temp / MANIFEST, manifest)
    fsync_dir(temp)
    if final.exists():
        # Checked before the save started; something else created it meanwhile. Keep both.
        raise RuntimeError(f"{final} appeared while step {step} was being saved; kept the save in {temp}")
    temp.rename(final)
    fsync_dir(final.parent)


def apply_retention(root: Path, keep_latest_k: int, committed_step: int, run_id: str) -> list[int]:
    """Delete complete checkpoints older than the k newest at or below `committed_step`.

    Checkpoints after `committed_step` (left by a run resumed from an earlier step) are another
    history; they are never touched here. With keep_latest_k = 0 nothing is deleted.
    """
    if keep_latest_k <= 0:
        return []
    candidates = [s for s in complete_steps(root) if s <= committed_step]
    doomed = candidates[:-keep_latest_k]
    for step in doomed:
        folder = step_dir(root, step)
        # Out of sight first (atomic), so a crash mid-delete leaves no half checkpoint under a real name.
        hidden = root / f".step-{step}.deleting-{run_id}"
        folder.rename(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    if doomed:
        fsync_dir(root)
    return doomed
