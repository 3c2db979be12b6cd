"""The model registry: lookup, errors a person can act on, registration rules."""

import dataclasses

import pytest
import torch

import models
from models.registry import ModelSpec, get_model_spec, model_names, register_model


def test_importing_models_registers_llama3() -> None:
    assert "llama3" in model_names()
    spec = models.get_model_spec("llama3")
    assert spec.name == "llama3"
    assert callable(spec.parallelize)
    with torch.device("meta"):
        model = spec.model_cls(spec.flavor("debug"))
    assert sum(p.numel() for p in model.parameters()) > 0


def test_unknown_model_lists_names_and_suggests() -> None:
    with pytest.raises(ValueError) as info:
        get_model_spec("lama3")
    message = str(info.value)
    assert message.startswith("unknown model 'lama3'; valid: ")
    assert "llama3" in message.split("valid: ")[1]
    assert message.endswith("did you mean 'llama3'?")


def test_unknown_model_without_a_close_name_has_no_suggestion() -> None:
    with pytest.raises(ValueError) as info:
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
    spec = ModelSpec(
        name="toy", model_cls=torch.nn.Linear, flavors={"a": 1, "b": 2}, flops_per_token=lambda a, s: 0.0
    )
    with pytest.raises(ValueError, match=r"^unknown flavor 'c' for model 'toy'; valid: a, b$"):
        spec.flavor("c")
