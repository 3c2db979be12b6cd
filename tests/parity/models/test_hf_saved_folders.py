"""The hf family against folders transformers saved (tests/support/hf_saved.py): published MoE
families whose checkpoint format differs from their runtime modules (per-expert tensors fused into
`experts.gate_up_proj`, `block_sparse_moe` renamed to `mlp`). Loaded through transformers' own
conversion, run on layouts (titan_tpu/models/hf/conversion.py), our model holds exactly the tensors
transformers' `from_pretrained` holds and computes its logits; our export is the folder
`save_pretrained` writes, tensor for tensor, and loads back in transformers. Catches a converter
applied in the wrong order (gate and up swapped), experts stacked out of order (expert 10 before
2), a misnamed key, a fused folder tensor checked against one of the projections chunked from it
(HRM), and a folder missing one expert, which must be refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.hf_saved import FUSED_DENSE, PUBLISHED_MOE, saved_folder
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.hf.args import HFArgs, hf_args
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.hf.state_dict_adapter import HF_FAMILY_ADAPTER as ADAPTER

TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def folder_args(folder: Path) -> HFArgs:
    return hf_args(load_config("llama3_debug", ["--model.name=hf", "--model.flavor=config", f"--hf.config={folder}"]))


def our_model(args: HFArgs) -> HFCausalLM:
    with torch.device("meta"):
        model = HFCausalLM(args)
    model.to_empty(device="cpu")
    torch.manual_seed(123)  # other weights than the folder's, so a tensor left unloaded shows
    model.init_weights()
    return model.eval()


def transformers_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", [*PUBLISHED_MOE, *FUSED_DENSE])
def test_a_saved_folder_loads_as_transformers_loads_it_and_exports_as_it_saves(model_type: str, tmp_path: Path) -> None:
    folder = saved_folder({**PUBLISHED_MOE, **FUSED_DENSE}[model_type], tmp_path / "saved")
    args = folder_args(folder)
    ours = our_model(args)
    load_hf_weights(ours, folder, ADAPTER, args)
    theirs = transformers_model(folder)
    their_state = theirs.state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, their_state[name.removeprefix("hf.")]), name
    with torch.no_grad():
        logits, expected = ours(TOKENS), theirs(TOKENS).logits
    assert (logits - expected).abs().max().item() <= 1e-5

    out = export_model_to_hf(ours, tmp_path / "export", ADAPTER, args)
    assert out is not None
    saved, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(saved)  # the checkpoint's names, one tensor per expert
    for name, value in saved.items():
        assert torch.equal(exported[name], value), name
    with torch.no_grad():
        reloaded = transformers_model(out)(TOKENS).logits
    assert (reloaded - expected).abs().max().item() <= 1e-5


def test_a_folder_missing_one_expert_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    folder = saved_folder(PUBLISHED_MOE["mixtral"], tmp_path / "saved")
    tensors = load_file(folder / "model.safetensors")
    dropped = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    del tensors[dropped]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    args = folder_args(folder)
    model = our_model(args)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        load_hf_weights(model, folder, ADAPTER, args, what="model hf flavor config")
    assert str(err.value) == (
        f"Hugging Face folder {folder} does not fit model hf flavor config: {dropped} is missing; "
        "conversion: transformers' mixtral checkpoint conversion (6 renamings; converters with Concatenate, "
        "MergeModulelist)"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was read


def test_a_misnamed_tensor_is_named_as_missing_and_as_unread(tmp_path: Path) -> None:
    folder = saved_folder(PUBLISHED_MOE["qwen3_moe"], tmp_path / "saved")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.experts.1.gate_prj.weight"] = tensors.pop(
        "model.layers.0.mlp.experts.1.gate_proj.weight"
    )
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    args = folder_args(folder)
    with pytest.raises(
        ConfigError,
        match=(
            r"model.layers.0.mlp.experts.1.gate_proj.weight is missing; "
            r"model.layers.0.mlp.experts.1.gate_prj.weight is not a tensor of this model; conversion: transformers' qwen3_moe"
        ),
    ):
        load_hf_weights(our_model(args), folder, ADAPTER, args)


def test_a_tensor_the_model_does_not_read_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder with more than the model (an older checkpoint's rotary table, a draft head) still
    loads, and says what it left unread."""
    folder = saved_folder(PUBLISHED_MOE["olmoe"], tmp_path / "saved")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    args = folder_args(folder)
    with caplog.at_level("WARNING", logger="titan_tpu.checkpoint.hf_fit"):
        load_hf_weights(our_model(args), folder, ADAPTER, args, what="model hf flavor config")
    assert (
        "holds 1 tensor that model hf flavor config does not read, e.g. model.layers.0.self_attn.rotary_emb.inv_freq"
        in caplog.text
    )
