"""scripts/convert_checkpoint.py on a LoRA run's checkpoint (its adapters only): `dcp-to-peft` writes
the PEFT folder the live model's export writes, and `dcp-to-hf` the merged folder, from a 2-step
Qwen 3 debug run on a base folder (checkpoint.initial_load_path). Refused in one line (exit 2):
dcp-to-peft on a checkpoint without adapters, a non-empty output folder, a LoRA conversion without
the run's --config, and the merged export of a run without a base folder.

Bugs caught: adapters read under the wrong layer or left out, the scaling or the base of the merge
wrong (compared with the live model's exports, tensor for tensor), a conversion that writes the base
alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.paths import REPO
from titan_tpu.checkpoint import hf_export
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.storage import METADATA_FILE, check_files
from titan_tpu.config import load_config
from titan_tpu.lora.merge import export_merged_to_hf
from titan_tpu.lora.peft_export import CONFIG_FILE, WEIGHTS_FILE, export_peft_adapter
from titan_tpu.models.common.lora import lora_layers
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.training.trainer import Trainer

_spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py")
assert _spec is not None and _spec.loader is not None
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)

ARGS = QWEN3_FLAVORS["debug"]
LORA = ["--lora.enable=true", "--lora.rank=4", "--lora.alpha=8", "--training.steps=2"]


def _run_options(root: Path, base: Path | None) -> list[str]:
    """The run's config as the converter is given it: the train config and its overrides."""
    options = ["--config", "qwen3_debug", f"--job.dump_folder={root / 'run'}", *LORA]
    return options + ([f"--checkpoint.initial_load_path={base}"] if base else [])


def _train(root: Path, base: Path | None) -> tuple[Trainer, list[str]]:
    options = _run_options(root, base)
    run = [
        "--checkpoint.enable=true",
        "--training.seq_len=32",
        "--training.global_batch_size=2",
        "--training.dtype=float32",
        "--optimizer.lr=0.01",
        "--lr_scheduler.warmup_steps=0",
    ]
    trainer = Trainer(load_config(options[1], options[2:] + run))
    trainer.train()
    return trainer, options


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A base folder, a 2-step LoRA run on it with a checkpoint, and the trained model's own exports."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base_model = Qwen3Model(ARGS)
    base_model.init_weights()
    base = export_model_to_hf(base_model, root / "base", ADAPTER, ARGS)
    trainer, options = _train(root, base)
    try:
        assert all(layer.lora_B.abs().max() > 0 for _, layer in lora_layers(trainer.model))  # trained
        live_peft = export_peft_adapter(trainer.model, root / "live_peft", ADAPTER, ARGS, base_model=str(base))
        live_merged = export_merged_to_hf(trainer.model, root / "live_merged", ADAPTER, ARGS)
    finally:
        trainer.close()
    return {"root": root, "base": base, "options": options, "peft": live_peft, "merged": live_merged}


def _same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_dcp_to_peft_writes_what_the_live_export_writes(lora_run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "peft"
    assert convert.main(["dcp-to-peft", str(out), *lora_run["options"]]) == 0
    _same_tensors(load_file(out / WEIGHTS_FILE), load_file(lora_run["peft"] / WEIGHTS_FILE))
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config == json.loads((lora_run["peft"] / CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(lora_run["base"]) and config["r"] == 4


def test_dcp_to_hf_writes_the_merged_model(
    lora_run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also: each of the checkpoint's files is checked (CRC-32, a read of the whole file) once, though
    the folder is looked into before the conversion is chosen."""
    checked: list[str] = []

    def counting(folder: Path, files: dict[str, dict[str, int]], names: list[str]) -> Any:
        checked.extend(names)
        return check_files(folder, files, names)

    monkeypatch.setattr(hf_export, "check_files", counting)
    out = tmp_path / "merged"
    assert convert.main(["dcp-to-hf", str(out), *lora_run["options"]]) == 0
    data_files = [name for name in checked if name != METADATA_FILE]
    assert data_files and sorted(data_files) == sorted(set(data_files)), checked
    merged = load_file(out / "model.safetensors")
    _same_tensors(merged, load_file(lora_run["merged"] / "model.safetensors"))
    base = load_file(lora_run["base"] / "model.safetensors")
    wq = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[wq] - base[wq]).abs().max() > 1e-4  # the adapters are in it


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> None:
    assert convert.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(word in err for word in words), err


def test_what_the_lora_conversions_refuse(
    lora_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options, root = lora_run["options"], lora_run["root"]
    # A checkpoint of a whole model (the base converted to step-0) has no adapters.
    whole = tmp_path / "whole"
    assert (
        convert.main(
            ["hf-to-dcp", str(lora_run["base"]), "--checkpoint", str(whole), "--model", "qwen3", "--flavor", "debug"]
        )
        == 0
    )
    capsys.readouterr()
    no_config = ["--checkpoint", str(whole), "--model", "qwen3", "--flavor", "debug"]
    _refused(["dcp-to-peft", str(tmp_path / "a"), *no_config], capsys, "holds no LoRA adapters")
    # Adapters without the run's config: no alpha, no base.
    lora_checkpoint = ["--checkpoint", str(root / "run" / "checkpoint"), "--model", "qwen3", "--flavor", "debug"]
    _refused(["dcp-to-peft", str(tmp_path / "b"), *lora_checkpoint], capsys, "--config")
    _refused(["dcp-to-hf", str(tmp_path / "c"), *lora_checkpoint], capsys, "--config")
    # Never over a non-empty folder.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("")
    _refused(["dcp-to-peft", str(tmp_path / "d"), *options], capsys, "never overwritten")
    _refused(["dcp-to-hf", str(tmp_path / "d"), *options], capsys, "never overwritten")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["keep"]


def test_a_run_without_a_base_folder_has_adapters_but_no_merged_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, options = _train(tmp_path, base=None)
    trainer.close()
    _refused(
        ["dcp-to-hf", str(tmp_path / "merged"), *options], capsys, "no checkpoint.initial_load_path", "dcp-to-peft"
    )
    assert not (tmp_path / "merged").exists()
    assert convert.main(["dcp-to-peft", str(tmp_path / "peft"), *options]) == 0
    assert json.loads((tmp_path / "peft" / CONFIG_FILE).read_text())["base_model_name_or_path"] is None
