"""CheckpointManager on one process with a tiny model: exact round trip, atomic visibility, retention,
never overwriting, corruption detection, and a metadata file that cannot run code."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from titan_tpu.checkpoint import CheckpointManager, layout
from titan_tpu.config import ConfigError
from titan_tpu.config.sections import CheckpointConfig


class Stateful:
    """Stands in for the data loader: anything with state_dict()/load_state_dict()."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "nested": {"a": [1, 2], "b": (3, None)}}

    def load_state_dict(self, state: dict) -> None:
        assert state["nested"] == {"a": [1, 2], "b": (3, None)}
        self.position = state["position"]


def build(seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, scheduler, Stateful()


def train_step(parts, data: Stateful) -> float:  # type: ignore[no-untyped-def]
    model, optimizer, scheduler = parts
    # Draws from the torch, python and numpy RNGs: the resumed losses match only if all are restored.
    x = torch.randn(5, 8) + random.random() + float(np.random.rand())
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    data.position += 1
    return loss.item()


def manager(root: Path, parts, data: Stateful, **cfg) -> CheckpointManager:  # type: ignore[no-untyped-def]
    model, optimizer, scheduler = parts
    config = CheckpointConfig(**{"enable": True, "interval": 2, "keep_latest_k": 0, **cfg})
    return CheckpointManager(config, root, model=model, optimizer=optimizer, lr_scheduler=scheduler, dataloader=data)


def run(root: Path, steps: int, **cfg) -> list[float]:  # type: ignore[no-untyped-def]
    *parts, data = build()
    mgr = manager(root, parts, data, **cfg)
    assert mgr.load() is None
    losses = []
    for step in range(1, steps + 1):
        losses.append(train_step(parts, data))
        mgr.maybe_save(step, last=step == steps)
    mgr.close()
    return losses


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_continues_bitwise(tmp_path: Path, async_mode: str) -> None:
    losses = run(tmp_path, 6, async_mode=async_mode)
    assert layout.complete_steps(tmp_path / "checkpoint") == [2, 4, 6]
    *parts, data = build(seed=123)  # other weights: everything must come from the checkpoint
    mgr = manager(tmp_path, parts, data, load_step=4)
    assert mgr.load() == 4
    assert data.position == 4
    resumed = [train_step(parts, data) for _ in range(2)]
    assert resumed == losses[4:]


def _saved_keys(folder: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def test_a_checkpoint_with_positional_param_groups_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints written before the optimizer state was flattened per parameter name keep the
    param groups as a list (`optimizer.param_groups.0.lr`). Bugs caught: such a checkpoint no
    longer loading (every earlier run's checkpoints lost to a resume), or loading into a pipeline
    stage, whose groups hold other parameters, instead of one line."""
    from titan_tpu.checkpoint import manager as manager_module
    from titan_tpu.checkpoint.state import OptimizerState, has_positional_param_groups

    def older(model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True) -> OptimizerState:
        return OptimizerState(model, optimizer, flat=False)

    with monkeypatch.context() as patch:
        patch.setattr(manager_module, "OptimizerState", older)
        losses = run(tmp_path / "old", 6)
    assert has_positional_param_groups(_saved_keys(tmp_path / "old" / "checkpoint" / "step-4"))
    run(tmp_path / "new", 2)
    assert not has_positional_param_groups(_saved_keys(tmp_path / "new" / "checkpoint" / "step-2"))

    *parts, data = build(seed=123)
    assert manager(tmp_path / "old", parts, data, load_step=4).load() == 4
    assert [train_step(parts, data) for _ in range(2)] == losses[4:]

    model, optimizer, scheduler = build()[:3]
    staged = CheckpointManager(
        CheckpointConfig(enable=True, load_step=4),
        tmp_path / "old",
        model=model,
        optimizer=optimizer,
        pipeline_stages=True,
    )
    with pytest.raises(ConfigError, match=r"keeps the optimizer's param groups by position .* parallelism.pp = 1 once"):
        staged.load()


def test_retention_keeps_newest_and_never_touches_later_history(tmp_path: Path) -> None:
    run(tmp_path, 6, keep_latest_k=2)
    root = tmp_path / "checkpoint"
    assert layout.complete_steps(root) == [4, 6]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    # Resume from 4 with k=1: saving 5 deletes 4 (older) but never 6 (another, later history).
    *parts, data = build()
    mgr = manager(tmp_path, parts, data, load_step=4, keep_latest_k=1, interval=1)
    assert mgr.load() == 4
    train_step(parts, data)
    assert mgr.save(5)
    assert layout.complete_steps(root) == [5, 6]


def test_existing_step_is_never_overwritten(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run(tmp_path, 4)
    folder = tmp_path / "checkpoint" / "step-4"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    *parts, data = build(seed=5)
    mgr = manager(tmp_path, parts, data, load_step=2)
    assert mgr.load() == 2
    train_step(parts, data)
    train_step(parts, data)
    with caplog.at_level("WARNING"):
        assert mgr.save(4) is False
    assert "not overwriting" in caplog.text
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_incomplete_saves_are_invisible_and_cleaned(tmp_path: Path) -> None:
    run(tmp_path, 2)
    root = tmp_path / "checkpoint"
    # What a run killed mid-save leaves: a temporary folder with some files; and a copy in progress.
    shutil.copytree(root / "step-2", root / ".step-4.tmp-deadbeef")
    (root / ".step-4.tmp-deadbeef" / layout.MANIFEST).unlink()
    shutil.copytree(root / "step-2", root / "step-6")
    (root / "step-6" / layout.MANIFEST).unlink()
    assert layout.complete_steps(root) == [2]
    *parts, data = build(seed=9)
    mgr = manager(tmp_path, parts, data)
    assert not (root / ".step-4.tmp-deadbeef").exists()  # cleaned at start-up
    assert (root / "step-6").exists()  # not ours to delete, but never loaded
    assert mgr.load() == 2


def test_seed_checkpoint_is_model_only(tmp_path: Path) -> None:
    *parts, data = build(seed=1)
    mgr = manager(tmp_path, parts, data, enable=False, create_seed_checkpoint=True)
    assert mgr.save(0, model_only=True)
    manifest = json.loads((tmp_path / "checkpoint" / "step-0" / layout.MANIFEST).read_text())
    assert manifest["components"] == ["model"]
    seeded = {k: v.clone() for k, v in parts[0].state_dict().items()}
    *parts2, data2 = build(seed=2)
    mgr2 = manager(tmp_path, parts2, data2)
    assert mgr2.load() == 0
    for key, value in parts2[0].state_dict().items():
        assert torch.equal(value, seeded[key])
    assert not parts2[1].state  # optimizer untouched


def _saved(tmp_path: Path) -> Path:
    run(tmp_path, 4)
    return tmp_path / "checkpoint" / "step-4"


def _load(tmp_path: Path, **cfg) -> int | None:  # type: ignore[no-untyped-def]
    *parts, data = build()
    return manager(tmp_path, parts, data, **cfg).load()


def test_truncated_file_names_folder_and_file(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    data_file = folder / "__0_0.distcp"
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size // 2)
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, on_damage="stop")
    message = str(err.value)
    assert "\n" not in message
    assert str(folder) in message and "__0_0.distcp" in message and "truncated" in message
    assert "load_step" in message and "on_damage" in message and "other complete: 2" in message
    assert folder.is_dir()  # stop moves nothing
    assert _load(tmp_path, load_step=2) == 2  # an older one still loads


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    data_file = folder / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"step-4: file __0_0\.distcp is corrupted"):
        _load(tmp_path, on_damage="stop")


def test_missing_manifest_or_metadata(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    (folder / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"step-4: file \.metadata is missing"):
        _load(tmp_path, on_damage="stop")


def test_load_step_that_does_not_exist(tmp_path: Path) -> None:
    run(tmp_path, 4)
    with pytest.raises(ConfigError, match=r"load_step = 3: .*step-3 does not exist; .*: 2, 4"):
        _load(tmp_path, load_step=3)


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    run(tmp_path, 2)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(CheckpointConfig(enable=True), tmp_path, model=model, optimizer=optimizer)
    expected = r"does not fit this model: model\.0\.bias is \[16\] in the checkpoint"
    with pytest.raises(ConfigError, match=expected):
        mgr.load()


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch PWNED",))


def test_metadata_cannot_run_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _saved(tmp_path)
    monkeypatch.chdir(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    from titan_tpu.checkpoint.storage import file_digest

    manifest["files"][".metadata"] = file_digest(folder / ".metadata")  # a forger updates the manifest too
    (folder / layout.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"\.metadata is unreadable .*refusing to load global posix\.system"):
        _load(tmp_path)
    assert not (tmp_path / "PWNED").exists()


def test_failed_async_save_is_reported_and_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from titan_tpu.checkpoint import storage

    *parts, data = build()
    mgr = manager(tmp_path, parts, data, async_mode="async")
    train_step(parts, data)
    assert mgr.save(2)
    mgr.wait()

    def broken(self, plan, planner):  # type: ignore[no-untyped-def]
        raise OSError("No space left on device")

    monkeypatch.setattr(storage.ChecksummingWriter, "write_data", broken)
    assert mgr.save(4)  # returns at once; the failure shows when the save is waited for
    with pytest.raises(RuntimeError, match=r"saving step 4 failed on rank 0: .*No space left on device"):
        mgr.wait()
    mgr.close()
    assert layout.complete_steps(tmp_path / "checkpoint") == [2]


def test_unreadable_data_is_one_line_even_when_the_manifest_agrees(tmp_path: Path) -> None:
    from titan_tpu.checkpoint.storage import file_digest

    folder = _saved(tmp_path)
    data_file = folder / "__0_0.distcp"
    with open(data_file, "r+b") as f:
        f.truncate(100)
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    manifest["files"]["__0_0.distcp"] = file_digest(data_file)
    (folder / layout.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as err:
        _load(tmp_path)
    assert str(err.value).startswith(f"checkpoint {folder}: could not be loaded: ")
    assert "\n" not in str(err.value)


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def _append(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize(
    ("damage", "target", "why"),
    [
        (_flip, "__0_0.distcp", "corrupted"),
        (_truncate, "__0_0.distcp", "truncated"),
        (_append, ".metadata", "extended"),
        (Path.unlink, "__0_0.distcp", "missing"),
        (lambda p: p.write_text("{not json"), layout.MANIFEST, "manifest"),
    ],
    ids=["flipped", "truncated", "appended", "deleted", "bad_manifest"],
)
def test_fallback_moves_the_damaged_newest_aside_under_its_reason(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage,
    target: str,
    why: str,  # type: ignore[no-untyped-def]
) -> None:
    """Each kind of damage to the newest checkpoint: it is moved to step-4.damaged-<why> with its files
    as they were and a note of what was found, one warning says so, and step 2 loads. Catches a damaged
    checkpoint loaded or deleted, and a name that does not say why."""
    folder = _saved(tmp_path)
    damage(folder / target)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with caplog.at_level("WARNING"):
        assert _load(tmp_path) == 2
    aside = tmp_path / "checkpoint" / f"step-4.damaged-{why}"
    assert (
        not folder.exists()
        and {p.name: p.read_bytes() for p in aside.iterdir() if p.name != layout.DAMAGE_NOTE} == before
    )
    assert target in (aside / layout.DAMAGE_NOTE).read_text()
    assert layout.complete_steps(tmp_path / "checkpoint") == [2]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and target in warnings[0] and aside.name in warnings[0]


def test_an_explicit_load_step_that_is_damaged_stops_and_moves_nothing(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    _flip(folder / "__0_0.distcp")
    with pytest.raises(ConfigError, match=r"step-4: file __0_0\.distcp is corrupted .*; pick another") as err:
        _load(tmp_path, load_step=4)
    assert "on_damage" not in str(err.value)  # naming the step is a request for that one
    assert folder.is_dir() and layout.complete_steps(tmp_path / "checkpoint") == [2, 4]


def test_when_every_checkpoint_is_damaged_the_run_starts_fresh_and_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _saved(tmp_path)
    _flip(folder / "__0_0.distcp")
    _truncate(folder.parent / "step-2" / "__0_0.distcp")
    with caplog.at_level("WARNING"):
        assert _load(tmp_path) is None
    root = tmp_path / "checkpoint"
    assert sorted(p.name for p in root.iterdir()) == ["step-2.damaged-truncated", "step-4.damaged-corrupted"]
    assert "no intact checkpoint left" in caplog.records[-1].getMessage()
    # A run from scratch saves beside them and its retention never touches them.
    run(tmp_path, 6, keep_latest_k=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-2.damaged-truncated", "step-4.damaged-corrupted", "step-6"]


def test_a_second_damage_of_the_same_step_gets_a_name_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "step-4.damaged-corrupted").mkdir()
    assert layout.damaged_dir(tmp_path, 4, "corrupted").name == "step-4.damaged-corrupted-2"
    assert layout.damaged_dir(tmp_path, 4, "missing").name == "step-4.damaged-missing"
