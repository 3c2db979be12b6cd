"""Which linears lora.target_modules names (titan_tpu/lora/targets.py), on the families' real module
trees built on meta, and the one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from titan_tpu.config import ConfigError
from titan_tpu.distributed.parallelize import block_containers
from titan_tpu.lora.targets import describe_linears, matches, select_targets
from titan_tpu.models.registry import get_model_spec

PER_BLOCK = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2"]


def meta_model(family: str, flavor: str = "debug") -> nn.Module:
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], n_layers=2)
    with torch.device("meta"):
        return spec.model_cls(args)


def targets(model: nn.Module, patterns: list[str]) -> list[str]:
    return select_targets(model, block_containers(model), patterns, "the test model")


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_all_linear_is_every_block_linear_and_not_the_head(family: str) -> None:
    """Catches the head (an nn.Linear outside the blocks) adapted by 'all-linear', as PEFT's is not."""
    model = meta_model(family)
    chosen = targets(model, ["all-linear"])
    expected = [f"layers.{i}.{name}" for i in range(2) for name in [*PER_BLOCK, "feed_forward.w3"]]
    assert sorted(chosen) == sorted(expected)
    assert "output" not in chosen and isinstance(model.get_submodule("output"), nn.Linear)


def test_all_linear_on_moe_leaves_out_the_router_and_the_stacked_experts() -> None:
    """Qwen 3 MoE: attention only. The router is an nn.Linear here but not in transformers' Qwen 3 MoE,
    where PEFT's 'all-linear' does not adapt it; the experts are stacked [E, out, in] parameters."""
    model = meta_model("qwen3_moe", "debug_moe")
    chosen = targets(model, ["all-linear"])
    assert sorted(chosen) == sorted(f"layers.{i}.{name}" for i in range(2) for name in PER_BLOCK[:4])
    assert any(name.endswith("router.gate") for name, m in model.named_modules() if isinstance(m, nn.Linear))
    # Named explicitly, the router is adapted.
    assert targets(model, ["*.router.gate"]) == [
        "layers.0.feed_forward.router.gate",
        "layers.1.feed_forward.router.gate",
    ]


def test_patterns_match_whole_names_and_suffixes_after_a_dot() -> None:
    assert matches("layers.0.attention.wq", "wq") and matches("layers.0.attention.wq", "*.wq")
    assert matches("model.layers.3.self_attn.q_proj", "*q_proj") and matches("layers.0.attention.wq", "layers.0.*")
    # A suffix must start after a dot: 'q' is not 'wq', and patterns are case-sensitive.
    assert not matches("layers.0.attention.wq", "q") and not matches("layers.0.attention.wq", "WQ")
    model = meta_model("qwen3")
    assert targets(model, ["wq", "*.wv"]) == [
        "layers.0.attention.wq",
        "layers.1.attention.wq",
        "layers.0.attention.wv",
        "layers.1.attention.wv",
    ]
    assert targets(model, ["layers.1.feed_forward.*"]) == [f"layers.1.feed_forward.w{i}" for i in (1, 2, 3)]
    assert targets(model, ["output"]) == ["output"]  # named explicitly, the head may be adapted


def test_a_pattern_that_matches_nothing_is_refused_with_the_names_seen() -> None:
    model = meta_model("qwen3")
    with pytest.raises(ConfigError) as refused:
        targets(model, ["*.wq", "q_proj"])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("lora.target_modules: 'q_proj' matches no nn.Linear of the test model; its linears: ")
    assert "wq, wk, wv, wo, w1, w2, w3, output (e.g. layers.0.attention.wq)" in message
    assert describe_linears([]) == "none"


def test_a_model_without_block_linears_and_a_linear_subclass_are_refused() -> None:
    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Conv1d(2, 2, 1)])
            self.head = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match=r"^lora.enable: the test model has no nn.Linear in its repeated blocks"):
        targets(Conv(), ["all-linear"])

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), Scaled(2, 2))])

    with pytest.raises(ConfigError, match=r"layers.0.1 is a Scaled with a forward of its own"):
        targets(Model(), ["all-linear"])
    assert targets(Model(), ["layers.0.0"]) == ["layers.0.0"]


def test_a_tied_weight_is_refused() -> None:
    """A head that shares the embedding table (transformers' tied lm_head): an adapter on it would move
    the embedding too, and storing its base in the compute dtype would untie the two. Its block
    neighbours are still taken."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4)])
            self.head = nn.Linear(4, 4, bias=False)
            self.head.weight = self.embed.weight

    with pytest.raises(ConfigError, match=r"^lora.target_modules: head's weight is tied to embed.weight; "):
        targets(Tied(), ["head"])
    assert targets(Tied(), ["layers.0"]) == ["layers.0"]
