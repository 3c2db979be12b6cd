"""titan_tpu/lora/peft_export.py's map from an adapted weight of ours to the Hugging Face modules made
of it, on layouts a family's adapter could give: renamed, rows permuted (a RoPE layout), rows split
over several modules (a fused projection of ours), column blocks reordered. For each, the PEFT
factors it writes, merged, must equal the folder tensor the full-weight export writes from the merged
weight, exactly (rows of B and columns of A are selections, no arithmetic). Refused in one line: a
folder tensor fused with another of ours, a transposed one; and target_modules names exactly the
adapted modules.

Bugs caught: B's rows left in our order under a permutation, A sliced where B is (or neither) under a
split, a column reorder applied to B, target_modules as plain names when only some layers are
adapted (PEFT would add adapters the file does not have)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.lora.peft_export import PEFT_PREFIX, module_slices, peft_tensors, target_modules
from titan_tpu.protocols.state_dict_adapter import ImportPlan, Shapes
from titan_tpu.protocols.tensor_layout import BlockLayout, assemble

OUT, IN, RANK, SCALING = 12, 8, 3, 2.5
OURS = "layers.0.wq.weight"


class LayoutAdapter:
    """A state-dict adapter whose export is the layouts it is given (the weight's, plus a norm)."""

    weights_stem = "model"
    config_dtype_keys = ("dtype",)

    def __init__(self, layouts: dict[str, BlockLayout]) -> None:
        self.layouts = layouts

    def export_layouts(self, args: Any, shapes: Shapes) -> dict[str, BlockLayout]:
        return {**self.layouts, "model.norm.weight": BlockLayout.whole("norm.weight", (IN,))}

    def import_layouts(self, args: Any, shapes: Shapes, available: Shapes) -> ImportPlan:
        raise NotImplementedError

    def to_hf_config(self, args: Any) -> dict[str, Any]:
        return {}

    def check_hf_config(self, config: dict[str, Any], args: Any) -> list[str]:
        return []


def _whole() -> BlockLayout:
    return BlockLayout.whole(OURS, (OUT, IN))


def _head_permuted() -> BlockLayout:
    """Rows in blocks of 4 ("heads"), the blocks in the order 2, 0, 1."""
    return BlockLayout.cat([_whole().narrow(0, 4 * h, 4) for h in (2, 0, 1)], dim=0)


def _columns_reordered() -> BlockLayout:
    return BlockLayout.cat([_whole().narrow(1, 4, 4), _whole().narrow(1, 0, 4)], dim=1)


CASES = {
    "renamed": {"m.q_proj.weight": _whole()},
    "rows permuted": {"m.q_proj.weight": _head_permuted()},
    "rows split": {"m.gate_proj.weight": _whole().narrow(0, 0, 5), "m.up_proj.weight": _whole().narrow(0, 5, 7)},
    "columns reordered": {"m.o_proj.weight": _columns_reordered()},
}


@pytest.mark.parametrize("case", CASES)
def test_the_written_factors_merge_to_the_folder_tensor_of_the_merged_weight(case: str) -> None:
    torch.manual_seed(0)
    weight, lora_A, lora_B = torch.randn(OUT, IN), torch.randn(RANK, IN), torch.randn(OUT, RANK)
    layouts = CASES[case]
    adapter = LayoutAdapter(layouts)
    slices, modules = module_slices(adapter, None, {OURS: (OUT, IN), "norm.weight": (IN,)}, ["layers.0.wq"])
    assert [part.module for part in slices["layers.0.wq"]] == [name.removesuffix(".weight") for name in layouts]
    assert modules == [*(name.removesuffix(".weight") for name in layouts), "model.norm"]
    written = peft_tensors(slices, {"layers.0.wq": (lora_A, lora_B)})
    merged = weight + SCALING * lora_B @ lora_A
    for hf_name, layout in layouts.items():
        module = PEFT_PREFIX + hf_name.removesuffix(".weight")
        part_A, part_B = written[f"{module}.lora_A.weight"], written[f"{module}.lora_B.weight"]
        assert part_A.shape == (RANK, layout.shape[1]) and part_B.shape == (layout.shape[0], RANK)
        from_peft = assemble(layout, {OURS: weight}) + SCALING * part_B @ part_A
        torch.testing.assert_close(from_peft, assemble(layout, {OURS: merged}), rtol=0, atol=1e-5)


def test_a_row_permutation_left_out_of_B_is_what_the_check_sees() -> None:
    """The negative control of the check above: B in our row order does not merge to the permuted
    folder tensor."""
    torch.manual_seed(0)
    weight, lora_A, lora_B = torch.randn(OUT, IN), torch.randn(RANK, IN), torch.randn(OUT, RANK)
    layout = _head_permuted()
    wrong = assemble(layout, {OURS: weight}) + SCALING * lora_B @ lora_A
    right = assemble(layout, {OURS: weight + SCALING * lora_B @ lora_A})
    assert (wrong - right).abs().max() > 1.0


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        (BlockLayout.cat([_whole(), BlockLayout.whole("layers.0.wk.weight", (OUT, IN))], 0), "fused with"),
        (_whole().transpose(0, 1), "transposed"),
    ],
    ids=["fused", "transposed"],
)
def test_a_folder_tensor_no_adapter_can_express_is_refused(layout: BlockLayout, why: str) -> None:
    adapter = LayoutAdapter({"m.qk_proj.weight": layout})
    with pytest.raises(ConfigError, match=why) as refused:
        module_slices(adapter, None, {OURS: (OUT, IN)}, ["layers.0.wq"])
    assert "\n" not in str(refused.value) and "merged" in str(refused.value)


def test_target_modules_name_exactly_the_adapted_modules() -> None:
    modules = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")] + ["lm_head"]
    every_q = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert target_modules(every_q, modules) == ["q_proj"]
    some = [*every_q, "model.layers.1.self_attn.v_proj"]
    assert target_modules(some, modules) == ["q_proj", "model.layers.1.self_attn.v_proj"]


def test_modules_inside_a_transformers_model_keep_their_own_names() -> None:
    """The hf family's layers are transformers' own under `hf`: PEFT's names are their paths there,
    with no layout asked of the adapter (which here has none for them); ours are not inside one."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from titan_tpu.lora.peft_export import transformers_tree
    from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
    from titan_tpu.models.qwen3.model import Qwen3Model

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    with torch.device("meta"):
        ours = nn.ModuleDict({"hf": LlamaForCausalLM(config)})
        assert transformers_tree(Qwen3Model(QWEN3_FLAVORS["debug"])) is None
    tree = transformers_tree(ours)
    assert tree is not None and tree.root == "hf" and "model.layers.0.self_attn.q_proj" in tree.modules
    path = "hf.model.layers.0.self_attn.q_proj"
    slices, modules = module_slices(LayoutAdapter({}), None, {f"{path}.weight": (16, 16)}, [path], tree)
    assert [part.module for part in slices[path]] == ["model.layers.0.self_attn.q_proj"]
    assert modules == tree.modules


def test_a_diffusers_model_has_no_peft_causal_lm_folder() -> None:
    adapter = LayoutAdapter(CASES["renamed"])
    adapter.weights_stem = "diffusion_pytorch_model"
    with pytest.raises(ConfigError, match="diffusers") as refused:
        module_slices(adapter, None, {OURS: (OUT, IN)}, ["layers.0.wq"])
    assert "\n" not in str(refused.value) and "merged" in str(refused.value)
