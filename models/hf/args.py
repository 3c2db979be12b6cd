"""The hf family's arguments: which transformers causal-LM class to build, with which config.

A config comes from a checkpoint folder (`model.hf_config`: the folder or its config.json; every
value the folder sets is kept) or from a class name (`model.hf_architecture`: its config class's
defaults, flavor "config", or tiny sizes, flavor "debug"); `model.overrides` then sets config fields.
Every mistake is a ValueError whose one line names the key (the registry's `args_for` makes it the
run's ConfigError).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# The flavors: the config as its folder or class gives it, or the debug sizes below on top of it.
HF_FLAVORS: dict[str, str] = {
    "config": "the sizes of model.hf_config's folder, or the defaults of model.hf_architecture's config class",
    "debug": "tiny sizes (2 layers, width 64, 4 heads) for tests and smoke runs",
}
# The debug sizes, each set only where the config has the field (names as transformers' configs
# spell them; `attribute_map` turns most architectures' own names into these). 512 tokens covers
# the byte-level tokenizers.
DEBUG_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    # mixture of experts
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention (DeepSeek V2/V3 and relatives)
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # partial rotary as a count of dimensions (GPT-J, CodeGen)
    "rotary_dim": 8,
}


# HFArgs fields that model.overrides may set (all other overrides are transformers config fields).
OWN_FIELDS = ("loss_chunk_elements",)


@dataclass(frozen=True)
class HFArgs:
    """A transformers config and the class that builds it; `max_seq_len` and `attention` are set by
    every run (training.seq_len, model.attention_block), `loss_chunk_elements` by measurement."""

    architecture: str
    config: Any  # transformers.PretrainedConfig
    folder: str = ""
    trust_remote_code: bool = False
    max_seq_len: int = 2048
    attention: Any = None
    loss_chunk_elements: int = -1  # -1: measured (models/common/loss_tunable.py)

    def __hash__(self) -> int:
        # A transformers config compares by value but cannot be hashed; its JSON stands for it (the
        # planner caches models built on meta by their arguments).
        return hash((self.architecture, self.config.to_json_string(), self.folder, self.max_seq_len,
                     self.loss_chunk_elements))  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def dim(self) -> int:
        """The residual stream's width (what the planner sizes the output head by)."""
        return int(self.config.hidden_size)

    @property
    def tie_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))


def did_you_mean(name: str, options: list[str]) -> str:
    """"did you mean 'x'? " for the closest option, or "" (the config layer's wording)."""
    close = difflib.get_close_matches(name, options, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def causal_lm_classes() -> dict[str, str]:
    """Every causal-LM class name of the installed transformers -> its model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    classes: dict[str, str] = {}
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (names,) if isinstance(names, str) else names:
            classes.setdefault(name, model_type)
    return classes


def model_class(architecture: str, where: str) -> type:
    """The transformers class `architecture` names, which must be a causal LM."""
    import transformers

    classes = causal_lm_classes()
    if architecture not in classes:
        if isinstance(getattr(transformers, architecture, None), type):
            raise ValueError(
                f"{where}: {architecture} is not a causal language model (it is not in transformers' "
                f"AutoModelForCausalLM mapping); pick a ...ForCausalLM class, e.g. {_example(classes)}"
            )
        raise ValueError(
            f"{where}: transformers {transformers.__version__} has no causal-LM class {architecture!r}; "
            f"{did_you_mean(architecture, sorted(classes))}e.g. {_example(classes)}"
        )
    return getattr(transformers, architecture)


def _example(classes: Mapping[str, str]) -> str:
    return ", ".join(name for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM") if name in classes)


def hf_args(model: Any) -> HFArgs:
    """The arguments the [model] section of an hf run asks for (ModelSpec.args_from_section)."""
    if model.attention_block not in (-1, 0):
        raise ValueError(
            f"model.attention_block: model 'hf' attends through transformers' own attention (SDPA where the "
            f"class has it); -1 or 0, got {model.attention_block}"
        )
    if model.flavor not in HF_FLAVORS:
        raise ValueError(
            f"model.flavor: unknown flavor {model.flavor!r} for model 'hf'; {did_you_mean(model.flavor, list(HF_FLAVORS))}"
            f"valid: {', '.join(HF_FLAVORS)}"
        )
    if model.hf_config:
        architecture, config = _folder_config(Path(model.hf_config), model.trust_remote_code)
        folder = str(Path(model.hf_config).parent if model.hf_config.endswith(".json") else Path(model.hf_config))
    elif model.hf_architecture:
        cls = model_class(model.hf_architecture, "model.hf_architecture")
        architecture, config, folder = model.hf_architecture, cls.config_class(), ""
    else:
        raise ValueError("model.hf_config: model 'hf' needs model.hf_config (a checkpoint folder) or model.hf_architecture")
    if model.flavor == "debug":
        layers_before = getattr(config, "num_hidden_layers", None)
        _set_fields(config, {k: v for k, v in DEBUG_SIZES.items() if _has_field(config, k)}, "model.flavor 'debug'")
        _fit_debug_sizes(config, layers_before)
    overrides = dict(model.overrides)
    # Our own settings among them (the loss's chunk, which kernels/ otherwise measures).
    own = {key: overrides.pop(key) for key in OWN_FIELDS if key in overrides}
    for key, value in own.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model.overrides.{key}: a positive integer, got {value!r}")
    _set_fields(config, overrides, "model.overrides")
    return HFArgs(architecture=architecture, config=config, folder=folder, trust_remote_code=model.trust_remote_code, **own)


def _folder_config(path: Path, trust_remote_code: bool) -> tuple[str, Any]:
    """The architecture and config of a checkpoint folder (or its config.json)."""
    from transformers import AutoConfig

    config_file = path if path.suffix == ".json" else path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model.hf_config: {config_file} does not exist; give a Hugging Face checkpoint folder that holds a config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model.hf_config: {config_file} is not valid JSON ({e})") from None
    if "auto_map" in raw and not trust_remote_code:
        raise ValueError(
            f"model.hf_config: {config_file} ships its own modeling code (auto_map), which is not run unless "
            "model.trust_remote_code = true"
        )
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"model.hf_config: {config_file} names no 'architectures'; set model.hf_architecture instead")
    architecture = architectures[0]
    if "auto_map" not in raw:
        model_class(architecture, f"model.hf_config ({config_file})")
    config = AutoConfig.from_pretrained(config_file.parent, trust_remote_code=trust_remote_code)
    return architecture, config


def _has_field(config: Any, key: str) -> bool:
    return key in config.to_dict() or key in getattr(config, "attribute_map", {})


def _set_fields(config: Any, values: Mapping[str, Any], where: str) -> None:
    """Set config fields, each of which the config must have, keeping the field's type."""
    fields = sorted(set(config.to_dict()) | set(getattr(config, "attribute_map", {})))
    for key, value in values.items():
        if key not in fields:
            raise ValueError(
                f"{where}.{key}: {type(config).__name__} has no field {key!r}; {did_you_mean(key, fields)}"
                "see its config.json for the fields"
            )
        current = getattr(config, key, None)
        if isinstance(current, bool) != isinstance(value, bool) and current is not None:
            raise ValueError(f"{where}.{key}: got {value!r}, the config holds {current!r}")
        setattr(config, key, value)


def _fit_debug_sizes(config: Any, layers_before: Any) -> None:
    """What the debug sizes imply: special-token ids inside the smaller vocabulary, latent attention's
    head sizes, and every per-layer list (layer types, MLP types) cut to the new layer count."""
    vocab = config.vocab_size
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        # Ids of the full vocabulary past the debug one (Phi-3 pads with 32000): the last id instead
        # (some configs require an integer there).
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= vocab:
            setattr(config, key, vocab - 1)
        elif isinstance(value, list) and any(isinstance(i, int) and i >= vocab for i in value):
            setattr(config, key, [min(i, vocab - 1) for i in value])
    if getattr(config, "qk_rope_head_dim", None):
        # Latent attention: the rotary part is the head_dim, and every head has its own keys.
        if _has_field(config, "head_dim"):
            config.head_dim = config.qk_rope_head_dim
        if _has_field(config, "num_key_value_heads"):
            config.num_key_value_heads = config.num_attention_heads
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and isinstance(layers_before, int) and layers != layers_before:
        for key, value in config.to_dict().items():
            if isinstance(value, list) and len(value) == layers_before:
                setattr(config, key, [value[i % len(value)] for i in range(layers)])


def override_value(args: HFArgs, key: str) -> Any:
    """What an override set (registry's `override_value`)."""
    return getattr(args, key) if key in OWN_FIELDS else getattr(args.config, key)

