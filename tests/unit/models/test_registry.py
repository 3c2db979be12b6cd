"""The model registry: lookup, errors a person can act on, registration rules, model overrides."""

import dataclasses

import pytest
import torch

from titan_tpu.config import ConfigError
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.registry import get_model_spec, model_names, register_model
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.tasks.registry import task_names


def test_importing_models_registers_llama3() -> None:
    assert "llama3" in model_names()
    spec = get_model_spec("llama3")
    assert spec.name == "llama3"
    assert callable(spec.parallelize)
    with torch.device("meta"):
        model = spec.model_cls(spec.flavor("debug"))
    assert sum(p.numel() for p in model.parameters()) > 0


def test_unknown_model_lists_names_and_suggests() -> None:
    # A ConfigError, so the entry point reports it as one line with exit status 2.
    with pytest.raises(ConfigError) as info:
        get_model_spec("lama3")
    message = str(info.value)
    assert message.startswith("unknown model 'lama3'; did you mean 'llama3'? valid: ")
    assert "llama3" in message.split("valid: ")[1]


def test_unknown_model_without_a_close_name_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        get_model_spec("zzzzzz")
    assert "did you mean" not in str(info.value)
    assert "llama3" in str(info.value)


def test_duplicate_registration_is_refused_unless_identical() -> None:
    spec = get_model_spec("llama3")
    register_model(spec)  # a re-import registering the same spec is harmless
    assert get_model_spec("llama3") is spec
    with pytest.raises(ValueError, match="already registered"):
        register_model(dataclasses.replace(spec, flavors={}))


def test_flavor_error_names_the_model() -> None:
    spec = ModelSpec(name="toy", model_cls=torch.nn.Linear, flavors={"a": 1, "b": 2}, flops_per_token=lambda a, s: 0.0)
    with pytest.raises(ConfigError, match=r"^unknown flavor 'c' for model 'toy'; valid: a, b$"):
        spec.flavor("c")


def test_every_family_defaults_to_a_task_that_exists() -> None:
    """`training.task = "auto"` runs the family's default_task: a family naming a task that is not
    registered (a typo, a task renamed) would fail every run that leaves the task to it."""
    for name in model_names():
        assert get_model_spec(name).default_task in task_names(), name


def test_build_args_applies_checked_overrides_and_builds_that_model() -> None:
    spec = get_model_spec("llama3")
    assert spec.build_args("debug", {}) is spec.flavor("debug")
    args = spec.build_args("debug", {"n_layers": 2, "dim": 128, "norm_eps": 1, "head_dim": "none"})
    assert (args.n_layers, args.dim, args.norm_eps, args.head_dim) == (2, 128, 1.0, None)
    assert isinstance(args.norm_eps, float)
    assert spec.flavor("debug").n_layers == 4  # the shared flavor is untouched
    with torch.device("meta"):
        model = Llama3Model(args)
    assert len(model.layers) == 2 and model.tok_embeddings.weight.shape == (512, 128)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"n_layer": 2},
            "model.overrides.n_layer is not a field of Llama3Args; did you mean 'n_layers'? valid fields: dim, ",
        ),
        ({"dim": 2.5}, "model.overrides.dim: got 2.5, expected an integer"),
        ({"tie_embeddings": 1}, "model.overrides.tie_embeddings: got 1, expected true or false"),
        ({"vocab_size": -1}, "model.overrides.vocab_size: must be >= 1, got -1"),
        ({"n_kv_heads": 3}, "n_heads (8) must be a multiple of n_kv_heads (3)"),
        ({"head_dim": 3, "dim": 24}, "head_dim must be even"),
        ({"attention": "sdpa"}, "set from model.attention_block"),
    ],
)
def test_build_args_refuses_what_the_flavor_cannot_take(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        get_model_spec("llama3").build_args("debug", overrides)
    assert message in str(info.value)
