"""The Llama 3 Hugging Face adapter and the checks made before any weight is read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan_tpu.checkpoint.hf_export import HFFolderWriter, export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import ConfigError
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.models.registry import get_model_spec

ARGS = LLAMA3_FLAVORS["debug"]


def meta_model(args=ARGS) -> Llama3Model:  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return Llama3Model(args)


def cpu_model(args=ARGS) -> Llama3Model:  # type: ignore[no-untyped-def]
    model = meta_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_registered_on_the_spec() -> None:
    assert get_model_spec("llama3").state_dict_adapter is ADAPTER


@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_maps_both_ways(tied: bool) -> None:
    args = dataclasses.replace(ARGS, tie_embeddings=tied)
    names = list(meta_model(args).state_dict())
    hf_names = [ADAPTER.hf_name(n) for n in names]
    assert len(set(hf_names)) == len(names)
    assert all(n.startswith(("model.", "lm_head.")) for n in hf_names)
    assert ("lm_head.weight" in hf_names) is not tied
    assert [ADAPTER.our_name(n) for n in hf_names] == names
    assert "model.layers.3.mlp.gate_proj.weight" in hf_names
    with pytest.raises(KeyError):
        ADAPTER.our_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_config_round_trip_and_mismatches() -> None:
    config = ADAPTER.to_hf_config(ARGS)
    assert ADAPTER.check_hf_config(config, ARGS) == []
    # transformers 5 style rope keys are understood too.
    v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    assert ADAPTER.check_hf_config(v5, ARGS) == []
    bad = {**config, "hidden_size": 128, "num_key_value_heads": 8, "rope_theta": 10000.0}
    problems = ADAPTER.check_hf_config(bad, ARGS)
    assert "hidden_size is 128, the flavor has 256" in problems
    assert "num_key_value_heads is 8, the flavor has 4" in problems
    assert any(p.startswith("rope_theta is 10000.0") for p in problems)


def write_hf_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor] | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors is None:
        (folder / "model.safetensors").write_bytes(b"\x00garbage, never to be read")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_wrong_shapes_fail_before_any_weight_is_read(tmp_path: Path) -> None:
    config = {**ADAPTER.to_hf_config(ARGS), "hidden_size": 512, "intermediate_size": 1536}
    folder = write_hf_folder(tmp_path / "hf", config, tensors=None)  # unreadable weights
    model = cpu_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        load_hf_weights(model, folder, ADAPTER, ARGS, what="model llama3 flavor debug")
    message = str(err.value)
    assert "config.json does not match model llama3 flavor debug" in message
    assert "hidden_size is 512, the flavor has 256" in message and "intermediate_size is 1536" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_missing_tensor_and_wrong_tensor_shape(tmp_path: Path) -> None:
    model = cpu_model()
    hf_state = {ADAPTER.hf_name(k): v.clone() for k, v in model.state_dict().items()}
    del hf_state["model.layers.2.mlp.up_proj.weight"]
    hf_state["model.norm.weight"] = torch.ones(7)
    folder = write_hf_folder(tmp_path / "hf", ADAPTER.to_hf_config(ARGS), hf_state)
    expected = r"model.layers.2.mlp.up_proj.weight is missing; model.norm.weight is \[7\]"
    with pytest.raises(ConfigError, match=expected):
        load_hf_weights(model, folder, ADAPTER, ARGS)


def test_no_adapter_or_no_weights(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no Hugging Face adapter"):
        load_hf_weights(cpu_model(), tmp_path, None, ARGS, what="model x")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(ADAPTER.to_hf_config(ARGS)))
    with pytest.raises(ConfigError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf_weights(cpu_model(), folder, ADAPTER, ARGS)


def test_export_shards_and_reloads_exactly(tmp_path: Path) -> None:
    model = cpu_model()
    out = export_model_to_hf(model, tmp_path / "out", ADAPTER, ARGS, "float32", max_shard_bytes=1 << 20)
    assert out is not None
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    assert not list(tmp_path.glob(".out.tmp-*"))
    other = cpu_model()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    load_hf_weights(other, out, ADAPTER, ARGS)
    for key, value in model.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key


def test_export_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        HFFolderWriter(tmp_path / "out", [("a", (2,))], torch.float32, {})
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_bfloat16_folder_loads_into_float32_model(tmp_path: Path) -> None:
    model = cpu_model()
    out = export_model_to_hf(model, tmp_path / "bf16", ADAPTER, ARGS, "bfloat16")
    assert out is not None
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    other = cpu_model()
    load_hf_weights(other, out, ADAPTER, ARGS)
    for key, value in model.state_dict().items():
        loaded = other.state_dict()[key]
        assert loaded.dtype == torch.float32
        assert torch.equal(loaded, value.to(torch.bfloat16).float()), key
