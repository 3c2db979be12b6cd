"""Tensors stacked from several Hugging Face tensors (Qwen 3 MoE experts: ours [E, out, in], the files
one tensor per expert) through the checkpoint layer's import and export, in one process: the adapter
interface, the block reads a sharded rank makes, and the checks made before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import BlockRead, load_hf_weights, read_hf_blocks
from titan_tpu.config import ConfigError
from titan_tpu.models.common.stacked_layouts import StackedTensors
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER
from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3MoeModel
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.protocols.tensor_layout import BlockLayout, assemble

ARGS = QWEN3_MOE_FLAVORS["debug_moe"]
EXPERTS = "layers.1.feed_forward.experts.w2"


def cpu_model(seed: int = 0) -> Qwen3MoeModel:
    with torch.device("meta"):
        model = Qwen3MoeModel(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def hf_tensors(model: Qwen3MoeModel) -> dict[str, torch.Tensor]:
    """The model in the file layout: experts unstacked (what transformers' save_pretrained writes)."""
    return {k: v.clone().contiguous() for k, v in ADAPTER.to_hf(model.state_dict()).items()}


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor] | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors is None:
        (folder / "model.safetensors").write_bytes(b"\x00garbage, never to be read")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_layouts_of_stacked_and_whole_tensors() -> None:
    shape = (ARGS.num_experts, ARGS.dim, ARGS.moe_hidden_dim)
    names = [f"model.layers.1.mlp.experts.{k}.down_proj.weight" for k in range(ARGS.num_experts)]
    router = "layers.1.feed_forward.router.gate.weight"
    shapes = {EXPERTS: shape, router: (ARGS.num_experts, ARGS.dim)}
    layouts = ADAPTER.import_layouts(ARGS, shapes, {}).layouts
    assert layouts[EXPERTS].sources == names and layouts[EXPERTS].shape == shape
    assert layouts[router] == BlockLayout.whole("model.layers.1.mlp.gate.weight", shapes[router])
    llama = LLAMA3_STATE_DICT_ADAPTER.import_layouts(None, {"norm.weight": (256,)}, {}).layouts
    assert llama["norm.weight"] == BlockLayout.whole("model.norm.weight", (256,))
    exported = ADAPTER.export_layouts(ARGS, shapes)
    assert list(exported) == [*names, "model.layers.1.mlp.gate.weight"]

    full = torch.randn(shape)
    for k, name in enumerate(names):
        assert torch.equal(assemble(exported[name], {EXPERTS: full}), full[k])
    # A shard holding experts 2..3, rows 8..15 (EP over experts, then FSDP over dim 1): the blocks
    # are of experts 2 and 3 only, each at row 8 of its HF tensor, landing in the shard's views.
    local = full[2:4, 8:16].clone()
    blocks = list(layouts[EXPERTS].blocks((2, 8, 0), local.shape))
    assert [(b.source, b.source_offsets, b.source_sizes) for b in blocks] == [
        (names[2], (8, 0), (8, shape[2])),
        (names[3], (8, 0), (8, shape[2])),
    ]
    assert all(torch.equal(b.target_view(local), full[2 + i, 8:16]) for i, b in enumerate(blocks))


def test_adapter_that_miscounts_a_stack_is_refused() -> None:
    class Wrong(StackedTensors):
        def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
            return ["a", "b"], (0 if name == "stack" else None)

    with pytest.raises(ValueError, match=r"stack \[3, 4\] is not a stack of 2 along dim 0"):
        Wrong().import_layouts(None, {"stack": (3, 4)}, {})
    with pytest.raises(ValueError, match="maps whole to 2 tensors"):
        Wrong().import_layouts(None, {"whole": (3, 4)}, {})


def test_block_reads_land_in_place(tmp_path: Path) -> None:
    """What a rank of a sharded model does: read only the blocks its shard holds, at their offsets,
    converting the file's dtype to the shard's."""
    model = cpu_model()
    tensors = hf_tensors(model)
    folder = write_folder(tmp_path / "hf", ADAPTER.to_hf_config(ARGS), tensors)
    full = model.state_dict()[EXPERTS]
    layout = ADAPTER.import_layouts(ARGS, {EXPERTS: tuple(full.shape)}, {}).layouts[EXPERTS]
    local = torch.zeros(2, full.shape[1] // 2, full.shape[2], dtype=torch.bfloat16)
    start = (6, full.shape[1] // 2, 0)  # experts 6..7, the second half of their rows
    reads = [BlockRead(b.source, b.target_view(local), b.source_offsets) for b in layout.blocks(start, local.shape)]
    assert sorted(r.name for r in reads) == sorted(layout.sources[6:8])
    read_hf_blocks(folder, reads)
    assert torch.equal(local, full[6:8, full.shape[1] // 2 :].to(torch.bfloat16))


def test_load_and_export_round_trip_exactly(tmp_path: Path) -> None:
    model = cpu_model(seed=1)
    out = export_model_to_hf(model, tmp_path / "out", ADAPTER, ARGS, "float32", max_shard_bytes=1 << 20)
    assert out is not None
    written: dict[str, torch.Tensor] = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            written.update({k: f.get_tensor(k) for k in f.keys()})
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    expected = hf_tensors(model)
    assert sorted(written) == sorted(expected)  # per-expert names, as transformers writes them
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == ARGS.num_experts

    other = cpu_model(seed=2)
    load_hf_weights(other, out, ADAPTER, ARGS)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_wrong_expert_count_fails_before_any_weight_is_read(tmp_path: Path) -> None:
    config = {**ADAPTER.to_hf_config(ARGS), "num_experts": 16, "moe_intermediate_size": 128}
    folder = write_folder(tmp_path / "hf", config, tensors=None)  # unreadable weights
    model = cpu_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        load_hf_weights(model, folder, ADAPTER, ARGS, what="model qwen3_moe flavor debug_moe")
    message = str(err.value)
    assert "config.json does not match model qwen3_moe flavor debug_moe" in message
    assert "num_experts is 16, the flavor has 8" in message
    assert "moe_intermediate_size is 128, the flavor has 256" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # transformers 5.x's alias for the expert count is understood too.
    aliased = {k: v for k, v in config.items() if k != "num_experts"} | {"num_local_experts": 16}
    assert "num_experts is 16, the flavor has 8" in ADAPTER.check_hf_config(aliased, ARGS)


def test_missing_or_misshapen_expert_is_named(tmp_path: Path) -> None:
    model = cpu_model()
    tensors = hf_tensors(model)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.0.mlp.experts.7.down_proj.weight"] = torch.zeros(3, 3)
    folder = write_folder(tmp_path / "hf", ADAPTER.to_hf_config(ARGS), tensors)
    expected = (
        r"model.layers.2.mlp.experts.5.up_proj.weight is missing; "
        r"model.layers.0.mlp.experts.7.down_proj.weight is \[3, 3\] there, \[256, 256\] here; "
        r"conversion: names mapped one to one, experts stacked$"
    )
    with pytest.raises(ConfigError, match=expected):
        load_hf_weights(cpu_model(), folder, ADAPTER, ARGS)
