"""FLUX.1 through the checkpoint layer's Hugging Face path, both ways, against diffusers'
FluxTransformer2DModel (fp32, debug size): a `save_pretrained` folder loads as the trainer's initial
weights (`checkpoint.initial_load_path`), a trained checkpoint exports with scripts/convert_checkpoint.py
to a folder `from_pretrained` reads, and folders that do not fit are refused with one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file

from tests.support import flux_reference
from tests.support.flux_reference import random_diffusers_model, run_diffusers, run_ours
from tests.support.paths import REPO
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.flux.args import FLUX_FLAVORS, FluxArgs
from titan_tpu.models.flux.model import FluxModel
from titan_tpu.models.flux.state_dict_adapter import FLUX_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.training.trainer import Trainer

ROOT = REPO
_spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
assert _spec is not None and _spec.loader is not None
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)

ARGS = FLUX_FLAVORS["debug"]
HEIGHT, WIDTH, TEXT_LEN, BATCH = 4, 4, 5, 2
TOLERANCE = 1e-5


def inputs(seed: int = 0) -> dict[str, torch.Tensor | None]:
    return flux_reference.inputs(ARGS, HEIGHT, WIDTH, TEXT_LEN, BATCH, seed)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def flux_trainer(folder: Path, dump: Path, *extra: str) -> Trainer:
    config = load_config(
        "flux_debug",
        [
            f"--job.dump_folder={dump}",
            f"--checkpoint.initial_load_path={folder}",
            "--training.steps=1",
            "--training.dtype=float32",
            "--training.global_batch_size=2",
            "--metrics.eval_freq=0",
            *extra,
        ],
    )
    return Trainer(config)


def test_diffusers_folder_trains_and_exports_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """diffusers -> trainer -> 1 step -> checkpoint -> convert_checkpoint dcp-to-hf -> diffusers.
    Catches the loader looking for transformers' file names (it refuses the folder), a tensor mapped
    to the wrong diffusers name (outputs differ), an export diffusers cannot read (a `dtype` key in
    config.json fails its constructor; transformers' file names are not found), and an export of
    anything but the trained weights."""
    reference = random_diffusers_model(ARGS)
    reference.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "diffusion_pytorch_model.safetensors").is_file()
    x = inputs()
    expected = run_diffusers(reference, x)

    dump = tmp_path / "run"
    trainer = flux_trainer(tmp_path / "hf", dump, "--checkpoint.enable=true")
    try:
        trainer.model.eval()
        loaded_diff = max_diff(run_ours(trainer.model, x), expected)
        trainer.model.train()
        records = trainer.train()
        trainer.model.eval()
        trained = run_ours(trainer.model, x)
    finally:
        trainer.close()
    assert len(records) == 1 and torch.isfinite(torch.tensor(records[0].loss))

    out = tmp_path / "export"
    code = convert.main(["dcp-to-hf", str(out), "--config", "flux_debug", f"--job.dump_folder={dump}"])
    assert code == 0, capsys.readouterr().err
    assert (out / "diffusion_pytorch_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel"
    assert {key for key in ("dtype", "torch_dtype") if key in config} == set(ADAPTER.config_dtype_keys)
    reloaded = FluxTransformer2DModel.from_pretrained(out).eval()
    exported_diff = max_diff(run_diffusers(reloaded, x), trained)
    moved = max_diff(trained, expected)
    scale = expected.abs().max().item()
    print(
        f"max|out| {scale:.3f}; loaded vs diffusers {loaded_diff:.2e}; "
        f"exported vs trained {exported_diff:.2e}; one step moved the output by {moved:.2e}"
    )
    assert loaded_diff <= TOLERANCE * max(1.0, scale)
    assert exported_diff <= TOLERANCE * max(1.0, scale)
    # The step changed the weights by far more than the tolerance, so the export check above is
    # about the trained weights, not the ones that were loaded.
    assert moved > 100 * TOLERANCE


def test_other_depth_is_refused_before_the_model_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a folder with 3 double blocks (the flavor has 2) fails with one line naming
    the key and both values, and no model is constructed (a 405B flavor would be materialised first
    otherwise)."""
    deeper = FluxArgs(**{**ARGS.__dict__, "depth_double": 3})
    random_diffusers_model(deeper).save_pretrained(tmp_path / "hf")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before the folder was checked")

    monkeypatch.setattr(FluxModel, "__init__", refuse)
    with pytest.raises(ConfigError) as error:
        flux_trainer(tmp_path / "hf", tmp_path / "run")
    message = str(error.value)
    print(message)
    assert "\n" not in message
    assert "num_layers is 3, the flavor has 2" in message and "config.json does not match" in message


def cpu_model(seed: int) -> FluxModel:
    with torch.device("meta"):
        model = FluxModel(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model.eval()


def test_sharded_folders_both_ways(tmp_path: Path) -> None:
    """diffusers' sharded layout (`diffusion_pytorch_model.safetensors.index.json` + shards) is read,
    and written so that diffusers reads it. Catches shard or index names only transformers uses."""
    reference = random_diffusers_model(ARGS, seed=1)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    ours = cpu_model(seed=2)
    load_hf_weights(ours, tmp_path / "hf", ADAPTER, ARGS)
    x = inputs(seed=1)
    expected = run_diffusers(reference, x)
    assert max_diff(run_ours(ours, x), expected) <= TOLERANCE * max(1.0, expected.abs().max().item())

    out = export_model_to_hf(ours, tmp_path / "export", ADAPTER, ARGS, "float32", max_shard_bytes=100_000)
    assert out is not None
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and all(name.startswith("diffusion_pytorch_model-") for name in shards), shards
    reloaded = FluxTransformer2DModel.from_pretrained(out).eval()
    assert max_diff(run_diffusers(reloaded, x), expected) <= TOLERANCE * max(1.0, expected.abs().max().item())


def test_folders_that_cannot_be_read_as_one_model(tmp_path: Path) -> None:
    """A pipeline root gets a pointer to its transformer/ subfolder; weights beside the model's own
    (diffusers' fp16 variant files) are refused rather than silently mixed in by the reader."""
    pipeline = tmp_path / "pipeline"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ConfigError, match=r"is a diffusers pipeline .*transformer"):
        load_hf_weights(cpu_model(seed=0), pipeline, ADAPTER, ARGS)

    folder = tmp_path / "hf"
    random_diffusers_model(ARGS).save_pretrained(folder)
    (folder / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"never read")
    with pytest.raises(ConfigError, match="diffusion_pytorch_model.fp16.safetensors is not among the weights"):
        load_hf_weights(cpu_model(seed=0), folder, ADAPTER, ARGS)


def test_convert_script_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """hf-to-dcp then dcp-to-hf with --model flux gives back every tensor bit for bit under its
    diffusers name (catches a direction of the script that still assumes transformers' files)."""
    random_diffusers_model(ARGS, seed=3).save_pretrained(tmp_path / "hf")
    flags = ["--checkpoint", str(tmp_path / "ckpt"), "--model", "flux", "--flavor", "debug"]
    assert convert.main(["hf-to-dcp", str(tmp_path / "hf"), *flags]) == 0, capsys.readouterr().err
    assert convert.main(["dcp-to-hf", str(tmp_path / "out"), *flags]) == 0, capsys.readouterr().err
    original = load_file(str(tmp_path / "hf" / "diffusion_pytorch_model.safetensors"))
    converted = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    assert original.keys() == converted.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, converted[name]), name
