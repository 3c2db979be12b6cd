"""Every shipped TOML in titan_tpu/train_configs/ loads, validates, and builds on `meta` into the model its
name promises: the parameter count is checked against the published figure, within the rounding of
that figure. A TOML with a wrong flavor, a broken key or no entry here fails."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest
import torch

from titan_tpu.config import ConfigError, load_config
from titan_tpu.config.loader import CONFIG_DIR
from titan_tpu.models.registry import get_model_spec
from titan_tpu.training.registered_names import check_registered_names

# Config file -> total parameters as published, written as published ("8.03B"): the check allows
# half a unit in the last digit, the rounding of the figure itself. Sources: Meta's Llama 3.1 / 3.2
# and Qwen's Qwen3 model cards (the same figures as tests/unit/models/llama3/test_model.py and
# test_qwen3_model.py). Our own flavors (debug, 100M) have no published figure; theirs is the exact
# count of the shape defined in titan_tpu/models/*/args.py, so any change to that shape is noticed here.
EXPECTED_PARAMS: dict[str, str] = {
    "llama3_debug.toml": "3410176",  # own flavor
    "llama3_100m.toml": "100682496",  # own flavor
    "llama3_1b.toml": "1.24B",
    "llama3_3b.toml": "3.21B",
    "llama3_8b.toml": "8.03B",
    "llama3_70b.toml": "70.6B",
    "llama3_405b.toml": "405.9B",
    "qwen3_debug.toml": "3410432",  # own flavor
    "qwen3_0.6b.toml": "0.6B",
    "qwen3_1.7b.toml": "1.7B",
    "qwen3_4b.toml": "4.0B",
    "qwen3_8b.toml": "8.2B",
    "qwen3_14b.toml": "14.8B",
    "qwen3_32b.toml": "32.8B",
    "qwen3_moe_debug.toml": "7350784",  # own flavor
    "qwen3_moe_30b_a3b.toml": "30.5B",
    "qwen3_moe_235b_a22b.toml": "235B",
    "grpo_calculator_debug.toml": "3410432",  # own flavor
    "grpo_qwen3_debug.toml": "3410432",  # own flavor
    "sft_qwen3_debug.toml": "3410432",  # own flavor
    "sft_qwen3_8b.toml": "8.2B",
    "dpo_qwen3_debug.toml": "1836416",  # own flavor (debug, 2 layers)
    "dpo_qwen3_8b.toml": "8.2B",
    "sft_qwen3_8b_lora.toml": "8.2B",  # the base; its adapters add 43.6M (tests/unit/plan/test_lora_memory.py)
    "sft_llama3_8b.toml": "8.03B",
    "grpo_qwen3_8b.toml": "8.2B",
    "grpo_qwen3_8b_lora.toml": "8.2B",  # the base, as above
    "grpo_qwen3_8b_dapo.toml": "8.2B",
    "grpo_qwen3_moe_30b_a3b.toml": "30.5B",
    "flux_debug.toml": "1796748",  # own flavor
    "flux_schnell.toml": "12B",  # Black Forest Labs: "12 billion parameter rectified flow transformer"
    "flux_dev.toml": "12B",
    "hf_mistral_debug.toml": "139584",  # own flavor (titan_tpu/models/hf/args.py's debug sizes)
    "hf_mistral_7b.toml": "7.24B",  # Mistral AI's Mistral 7B v0.1 model card: "7.24B params"
    "sft_own_data.toml": "3410432",  # own flavor
    "grpo_own_data.toml": "3410432",  # own flavor
    "dpo_own_data.toml": "3410432",  # own flavor
}
# Templates whose model is the user's folder, given on the command line: refused without it (below),
# run with one by tests/unit/repository/test_readme_own_data.py.
NEEDS_A_FOLDER = {"hf_own_folder.toml": r"hf\.config: model\.name = 'hf' needs exactly one of hf\.config"}
SHIPPED = sorted(p.name for p in CONFIG_DIR.glob("*.toml") if p.name not in NEEDS_A_FOLDER)


def matches_published(count: int, published: str) -> bool:
    """True when `count` rounds to the published figure ("8.03B" -> 8.03e9 +- 0.005e9; "3410176" exact)."""
    scale = 10**9 if published.endswith("B") else 1
    figure = Decimal(published.removesuffix("B"))
    half_unit = Decimal(1).scaleb(figure.as_tuple().exponent) / 2 if scale > 1 else Decimal(0)
    return abs(Decimal(count) - figure * scale) <= half_unit * scale


def built_param_count(path: Path) -> int:
    """Load and validate the TOML, check its names, then build its model on `meta` as the trainer would."""
    config = load_config(str(path), [])
    check_registered_names(config)
    spec = get_model_spec(config.model.name)
    args = spec.args_for(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return sum(p.numel() for p in model.parameters())


def test_every_shipped_config_has_an_expected_size() -> None:
    assert SHIPPED == sorted(EXPECTED_PARAMS), "add the new config's published size to EXPECTED_PARAMS"


@pytest.mark.parametrize("name", sorted(NEEDS_A_FOLDER))
def test_a_template_for_your_folder_is_refused_without_one(name: str) -> None:
    assert (CONFIG_DIR / name).is_file()
    with pytest.raises(ConfigError, match=NEEDS_A_FOLDER[name]):
        built_param_count(CONFIG_DIR / name)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_builds_its_published_size(name: str) -> None:
    count = built_param_count(CONFIG_DIR / name)
    assert matches_published(count, EXPECTED_PARAMS[name]), f"{name}: {count:,} vs {EXPECTED_PARAMS[name]}"
    # bfloat16 written into a config would fail on hardware without it; auto picks per device.
    assert load_config(str(CONFIG_DIR / name), []).training.dtype == "auto"


def test_rounding_rule() -> None:
    assert matches_published(8_030_261_248, "8.03B") and matches_published(8_034_999_999, "8.03B")
    assert not matches_published(8_035_000_001, "8.03B")
    assert matches_published(234_600_000_000, "235B") and not matches_published(234_400_000_000, "235B")
    assert matches_published(3_410_176, "3410176") and not matches_published(3_410_177, "3410176")


def test_a_config_with_the_wrong_flavor_is_caught(tmp_path: Path) -> None:
    wrong = tmp_path / "llama3_8b.toml"
    wrong.write_text((CONFIG_DIR / "llama3_8b.toml").read_text().replace('flavor = "8B"', 'flavor = "3B"'))
    assert not matches_published(built_param_count(wrong), EXPECTED_PARAMS["llama3_8b.toml"])
    moe = tmp_path / "qwen3_moe_30b_a3b.toml"
    text = (CONFIG_DIR / "qwen3_moe_30b_a3b.toml").read_text()
    fewer_experts = 'flavor = "30B-A3B"\noverrides = { top_k = 4, num_experts = 64 }'
    moe.write_text(text.replace('flavor = "30B-A3B"', fewer_experts))
    assert not matches_published(built_param_count(moe), EXPECTED_PARAMS["qwen3_moe_30b_a3b.toml"])


def test_a_config_with_a_broken_key_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "qwen3_8b.toml"
    broken.write_text((CONFIG_DIR / "qwen3_8b.toml").read_text().replace("\nsteps =", "\nstep ="))
    expected = r"training\.step: unknown key in \[training\]; did you mean 'steps'"
    with pytest.raises(ConfigError, match=expected):
        built_param_count(broken)
    unknown_flavor = tmp_path / "qwen3_9b.toml"
    unknown_flavor.write_text((CONFIG_DIR / "qwen3_8b.toml").read_text().replace('"8B"', '"9B"'))
    with pytest.raises(ConfigError, match=r"model\.flavor: unknown flavor '9B' for model 'qwen3'"):
        built_param_count(unknown_flavor)
