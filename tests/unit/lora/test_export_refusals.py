"""What the LoRA exports refuse, each in one line and before anything is written: a non-empty output
folder (never overwritten, its file kept), a PEFT export of a model without adapters, adapters of
different ranks in one PEFT folder (it holds one r), and the plain Hugging Face export of an adapted
model, which would write the base weights without the adapters."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.lora_models import ALPHA, RANK, adapt_block_linears
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.config.errors import ConfigError
from titan_tpu.lora.merge import export_merged_to_hf
from titan_tpu.lora.peft_export import export_peft_adapter
from titan_tpu.models.common.lora import LoRALinear, lora_layers
from titan_tpu.models.qwen3.args import Qwen3Args
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER as ADAPTER

ARGS = Qwen3Args(
    dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, ffn_hidden_dim=48, max_seq_len=32
)


def _model(adapted: bool = True) -> Qwen3Model:
    torch.manual_seed(0)
    model = Qwen3Model(ARGS)
    model.init_weights()
    if adapted:
        adapt_block_linears(model)
    return model


def _one_line(error: pytest.ExceptionInfo[ConfigError], *words: str) -> None:
    text = str(error.value)
    assert "\n" not in text and all(word in text for word in words), text


@pytest.mark.parametrize("export", [export_peft_adapter, export_merged_to_hf], ids=["peft", "merged"])
def test_a_non_empty_folder_is_never_overwritten(export: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError) as refused:
        export(_model(), out, ADAPTER, ARGS)
    _one_line(refused, str(out), "never overwritten")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_an_empty_folder_is_written_with_the_layers_settings(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    model = _model()
    for _, layer in lora_layers(model):
        layer.dropout = 0.25
    assert export_peft_adapter(model, tmp_path / "out", ADAPTER, ARGS) == tmp_path / "out"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (RANK, ALPHA, 0.25)


def test_a_model_without_adapters_has_no_peft_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        export_peft_adapter(_model(adapted=False), tmp_path / "out", ADAPTER, ARGS)
    _one_line(refused, "no LoRA adapters")
    assert not (tmp_path / "out").exists()


def test_adapters_of_different_ranks_are_refused(tmp_path: Path) -> None:
    model = _model()
    model.layers["0"].attention.wq = LoRALinear.wrapping(model.layers["0"].attention.wq, rank=2, alpha=8.0, dropout=0.0)
    with pytest.raises(ConfigError) as refused:
        export_peft_adapter(model, tmp_path / "out", ADAPTER, ARGS)
    _one_line(refused, "one rank, alpha and dropout")


def test_the_plain_export_of_an_adapted_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        export_model_to_hf(_model(), tmp_path / "out", ADAPTER, ARGS)
    _one_line(refused, "LoRA adapters", "layers.0.attention.wq.lora_A", "export_merged_to_hf", "export_peft_adapter")
    assert not (tmp_path / "out").exists()
    # The same model without adapters exports as before.
    assert export_model_to_hf(_model(adapted=False), tmp_path / "plain", ADAPTER, ARGS) is not None
