"""The hf family's tensor- and expert-parallel plans, read from transformers
(titan_tpu/models/hf/parallelize.py), on `meta`: what they split and the one-line refusals. The layouts themselves train against one process in
tests/distributed/test_hf_fsdp.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.hf.parallelize import check_plan, expert_modules, tp_plan_for
from titan_tpu.models.registry import get_model_spec


def meta_model(architecture: str, *overrides: str) -> torch.nn.Module:
    config = load_config(
        "llama3_debug", ["--model.name=hf", f"--hf.architecture={architecture}", "--model.flavor=debug", *overrides]
    )
    spec = get_model_spec("hf")
    args = dataclasses.replace(spec.args_for(config), max_seq_len=32)
    with torch.device("meta"):
        return spec.model_cls(args)


def test_plan_covers_every_layer_the_embedding_and_the_head() -> None:
    """Catches a `*` that matches one layer only, or a plan read from the config alone (the head's
    entry is the causal-LM class's)."""
    plan = tp_plan_for(meta_model("MistralForCausalLM"), tp=2)
    for layer in (0, 1):
        assert plan[f"model.layers.{layer}.self_attn.q_proj"] == "colwise"
        assert plan[f"model.layers.{layer}.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"


@pytest.mark.parametrize(("tp", "field"), [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_tp_that_does_not_divide_the_heads_is_refused(tp: int, field: str) -> None:
    """Debug sizes: 4 query heads, 2 key-value heads. Catches a rank handed part of a head."""
    with pytest.raises(ConfigError, match=rf"parallelism.tp = {tp} does not divide MistralForCausalLM's {field}"):
        tp_plan_for(meta_model("MistralForCausalLM"), tp=tp)


def test_tp_that_does_not_divide_a_split_width_is_refused() -> None:
    """An MLP width of 130 over 4 ranks (heads divide): catches uneven shards reaching the model."""
    with pytest.raises(ConfigError, match=r"does not divide the width 130 of model.layers.0.mlp.gate_proj"):
        tp_plan_for(
            meta_model(
                "MistralForCausalLM",
                "--model.overrides.intermediate_size=130",
                "--model.overrides.num_key_value_heads=4",
            ),
            tp=4,
        )


def test_architecture_without_a_plan_is_refused() -> None:
    """Bloom's config has no base_model_tp_plan (transformers adds only the head and embedding):
    catches a 'TP' run that splits nothing in its layers."""
    with pytest.raises(ConfigError, match=r"BloomForCausalLM has no tensor-parallel plan for its decoder layers"):
        tp_plan_for(meta_model("BloomForCausalLM"), tp=2)


def test_style_we_do_not_translate_is_refused() -> None:
    """A style outside the translation (transformers' fused-weight "packed_colwise") is refused by
    name, not silently replicated."""
    model = meta_model("MistralForCausalLM")
    with pytest.raises(ConfigError, match=r"style 'packed_colwise', which model 'hf' does not translate"):
        check_plan(model.hf, {"model.layers.0.self_attn.q_proj": "packed_colwise"}, tp=2)


def test_latent_attention_and_per_head_parameters_are_translated() -> None:
    """DeepSeek V3's joint latent projection (mla_kv_a_proj) and Granite SWA's per-head sinks (a
    parameter split by heads, its attention computing on local parameters) are in the plan."""
    plan = tp_plan_for(meta_model("DeepseekV3ForCausalLM"), tp=2)
    assert plan["model.layers.0.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    plan = tp_plan_for(meta_model("GraniteSWAForCausalLM"), tp=2)
    assert plan["model.layers.1.self_attn.sinks"] == "colwise"
    assert plan["model.layers.1.self_attn"] == "local_params"


def test_expert_plan_names_each_layers_experts() -> None:
    """Catches experts found in one layer only, or the router taken for the experts."""
    model = meta_model("MixtralForCausalLM")
    experts = expert_modules(model, ep=2)
    layers = model.hf.model.layers
    assert experts == [layer.mlp.experts for layer in layers]


def test_dense_architecture_refuses_expert_parallelism() -> None:
    with pytest.raises(ConfigError, match=r"parallelism.ep = 2: MistralForCausalLM has no expert-parallel plan"):
        expert_modules(meta_model("MistralForCausalLM"), ep=2)
