"""The hf family's arguments: which transformers causal-LM class to build, with which config.

A config comes from a checkpoint folder (`hf.config`: the folder or its config.json; every
value the folder sets is kept) or from a class name (`hf.architecture`: its config class's
defaults, flavor "config", or tiny sizes, flavor "debug"); `model.overrides` then sets config fields.
Every mistake is a ValueError whose one line names the key (the registry's `args_for` makes it the
run's ConfigError).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_tpu.models.hf.config import HFConfig

if TYPE_CHECKING:  # transformers is imported where it is used
    from transformers import PreTrainedModel

# The flavors: the config as its folder or class gives it, or the debug sizes below on top of a
# class's config (a folder's model is never shrunk: its weights have its sizes).
HF_FLAVORS: dict[str, str] = {
    "config": "the sizes of hf.config's folder, or the defaults of hf.architecture's config class",
    "debug": "tiny sizes (2 layers, width 64, 4 heads) of hf.architecture's class, for tests and smoke runs",
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
    # DeepSeek-style configs whose class leaves the shared-expert count unset (Dots1's is None)
    "n_shared_experts": 1,
    # multi-head latent attention (DeepSeek V2/V3 and relatives)
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # indexed (sparse) attention's scoring heads, at most the query heads per key head (4 / 2)
    "index_num_heads": 2,
    # partial rotary as a count of dimensions (GPT-J, CodeGen)
    "rotary_dim": 8,
    # parallel token streams (MusicGen's audio codebooks): a batch's rows are the streams of its
    # samples, so the batch must be a multiple of this (the sweep's batch of 2 is)
    "num_codebooks": 2,
    # BLT: its local encoder's and decoder's view of the global transformer's width, and its tables
    # of hashed byte groups (a vocabulary)
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 512,
    # per-layer input embeddings (Gemma 3n, Gemma 4): a table of this vocabulary per layer
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 16,
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
    loss_chunk_elements: int = -1  # -1: measured (titan_tpu/models/common/loss_tunable.py)

    def __hash__(self) -> int:
        # A transformers config compares by value but cannot be hashed; its JSON stands for it (the
        # planner caches models built on meta by their arguments).
        return hash(
            (self.architecture, self.config.to_json_string(), self.folder, self.max_seq_len, self.loss_chunk_elements)
        )

    @property
    def text_config(self) -> Any:
        """The language model's config: the config itself, or its text part (Fuyu's, a Gemma 4
        assistant's), where the sizes are."""
        return self.config.get_text_config()

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def dim(self) -> int:
        """The residual stream's width (what the planner sizes the output head by)."""
        return int(self.text_config.hidden_size)

    @property
    def tie_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    # The attention shape the kernel measurement times (titan_tpu/models/common/attention_tunable.py).
    @property
    def n_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self.text_config, "num_key_value_heads", None) or self.n_heads)

    @property
    def attn_head_dim(self) -> int:
        return int(getattr(self.text_config, "head_dim", None) or self.dim // self.n_heads)


def takes_registered_attention(args: HFArgs) -> bool:
    """Whether the class calls its attention through transformers' registry and has SDPA (the
    fallback), so our kernels can run in it (titan_tpu/models/hf/attention.py). Remote code is never asked."""
    if args.trust_remote_code and args.folder:
        return False
    cls = model_class(args.architecture, "model")
    return bool(getattr(cls, "_supports_attention_backend", False) and getattr(cls, "_supports_sdpa", False))


def did_you_mean(name: str, options: list[str]) -> str:
    """ "did you mean 'x'? " for the closest option, or "" (the config layer's wording)."""
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


def model_class(architecture: str, where: str) -> type[PreTrainedModel]:
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


def hf_args(run: Any) -> HFArgs:
    """The arguments an hf run's [model] and [hf] sections ask for (ModelSpec.args_from_config)."""
    model, hf = run.model, run.section(HFConfig)
    if model.flavor not in HF_FLAVORS:
        raise ValueError(
            f"model.flavor: unknown flavor {model.flavor!r} for model 'hf'; {did_you_mean(model.flavor, list(HF_FLAVORS))}"
            f"valid: {', '.join(HF_FLAVORS)}"
        )
    if hf.config:
        if model.flavor == "debug":
            # The folder's sizes are what its weights and its users expect; shrinking them silently
            # trained another model (or failed on the weights with a size mismatch naming no key).
            raise ValueError(
                "model.flavor: 'debug' would shrink hf.config's model to tiny sizes; set model.flavor = 'config' "
                "for the folder's own sizes (or, for a tiny model of its class, hf.architecture with flavor 'debug')"
            )
        architecture, config = _folder_config(Path(hf.config), hf.trust_remote_code)
        folder = str(Path(hf.config).parent if hf.config.endswith(".json") else Path(hf.config))
    elif hf.architecture:
        cls = model_class(hf.architecture, "hf.architecture")
        if cls.config_class is None:  # a causal-LM class names its config class
            raise ValueError(f"hf.architecture: transformers' {hf.architecture} names no config class")
        architecture, config, folder = hf.architecture, cls.config_class(), ""
    else:
        raise ValueError("hf.config: model 'hf' needs hf.config (a checkpoint folder) or hf.architecture")
    if model.flavor == "debug":
        config = shrink_to_debug_sizes(config)
    overrides = dict(model.overrides)
    # Our own settings among them (the loss's chunk, which titan_tpu/autotune/ otherwise measures).
    own = {key: overrides.pop(key) for key in OWN_FIELDS if key in overrides}
    for key, value in own.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model.overrides.{key}: a positive integer, got {value!r}")
    _set_fields(config, overrides, "model.overrides")
    args = HFArgs(
        architecture=architecture, config=config, folder=folder, trust_remote_code=hf.trust_remote_code, **own
    )
    if model.attention_block > 0 and not takes_registered_attention(args):
        raise ValueError(
            f"model.attention_block: {architecture} does not take its attention function from transformers' "
            f"registry (or has no SDPA to fall back on), so it runs transformers' own; -1 or 0, got {model.attention_block}"
        )
    return args


def _folder_config(path: Path, trust_remote_code: bool) -> tuple[str, Any]:
    """The architecture and config of a checkpoint folder (or its config.json)."""
    from transformers import AutoConfig

    config_file = path if path.suffix == ".json" else path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"hf.config: {config_file} does not exist; give a Hugging Face checkpoint folder that holds a config.json"
        )
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hf.config: {config_file} is not valid JSON ({e})") from None
    if "auto_map" in raw and not trust_remote_code:
        raise ValueError(
            f"hf.config: {config_file} ships its own modeling code (auto_map), which is not run unless "
            "hf.trust_remote_code = true"
        )
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"hf.config: {config_file} names no 'architectures'; set hf.architecture instead")
    architecture = architectures[0]
    if "auto_map" not in raw:
        model_class(architecture, f"hf.config ({config_file})")
    config = AutoConfig.from_pretrained(config_file.parent, trust_remote_code=trust_remote_code)
    return architecture, config


def _has_field(config: Any, key: str) -> bool:
    if config is None or not hasattr(config, "to_dict"):
        return False
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


def shrink_to_debug_sizes(config: Any) -> Any:
    """The config at the debug sizes, set on each of its stacks of layers, with what they imply,
    made again by its class from its dict: the class's own derivations then apply to the new sizes
    (Gemma 4 makes its last layer full attention), and the config is the one its saved config.json
    loads as."""
    for stack in _stacks(config):
        _shrink_stack(stack)
    text = config.get_text_config()
    for part in {id(config): config, id(text): text}.values():
        _fit_token_ids(part, text.vocab_size)
    return type(config).from_dict(config.to_dict())


def _stacks(config: Any) -> list[Any]:
    """The configs the debug sizes go on: the text part of a composite config (Fuyu's, a Gemma 4
    assistant's keep their sizes there), or, for a model of several stacks none of which is its
    text part (BLT's patcher, local encoder and decoder, and global transformer), each of them
    and the config itself."""
    text = config.get_text_config()
    if text is not config:
        return [text]
    parts = [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]
    return [config, *(part for part in parts if _has_field(part, "num_hidden_layers"))]


def _shrink_stack(config: Any) -> None:
    layers_before = getattr(config, "num_hidden_layers", None)
    per_layer = _take_per_layer_overrides(config)
    before = config.to_dict()
    debug = {key: value for key, value in DEBUG_SIZES.items() if _has_field(config, key)}
    sizes: dict[str, int | list[int]] = dict(debug)
    for key, value in debug.items():
        current = before.get(key)
        if isinstance(current, list):
            # A size given per layer (Gemma 3n's intermediate_size): the debug size on every layer.
            sizes[key] = [value] * len(current)
        elif current == 0 and not isinstance(current, bool):
            # A size of 0 turns its part off (Gemma 4's per-layer inputs, a count of dense or shared
            # layers); it stays off, as the config's validation may require (Gemma 4 assistants').
            del sizes[key]
    _set_fields(config, sizes, "model.flavor 'debug'")
    for key in _derived_from_layer_count(config):
        # Unset again, so that the rebuild derives it from the debug layer count.
        setattr(config, key, None)
    _fit_debug_sizes(config, layers_before)
    if per_layer is not None:
        if layers_before is None:
            raise ValueError(f"{type(config).__name__} has per-layer overrides but no num_hidden_layers")
        after = config.to_dict()
        changed = {key for key in after if after[key] != before.get(key)}
        _put_back_per_layer_overrides(config, per_layer, layers_before, changed)


def _derived_from_layer_count(config: Any) -> list[str]:
    """Single-valued fields the config class leaves unset and derives from num_hidden_layers (HRM's
    num_layers_per_stack, from which it then inflates num_hidden_layers to one cache slot per
    attention call: kept, it left 16 layers per stack against a cache of 2), found by building the
    class at two layer counts. Counts of layers that split the stack are fitted instead (below)."""
    cls = type(config)
    # Asked of `type(config)`, not `cls`: the check would narrow `cls` to a bare dataclass type.
    if not dataclasses.is_dataclass(type(config)) or not _has_field(config, "num_hidden_layers"):
        return []
    unset = [f.name for f in dataclasses.fields(cls) if f.default is None and f.name not in LAYER_COUNTS]
    try:
        one, other = cls().to_dict(), cls(num_hidden_layers=3).to_dict()
    except Exception:  # noqa: BLE001 - a class whose defaults do not build has nothing to derive here
        return []
    return [key for key in unset if one.get(key) != other.get(key) and not isinstance(one.get(key), (list, dict))]


def _take_per_layer_overrides(config: Any) -> dict[int, dict[str, Any]] | None:
    """A heterogeneous config's per-layer overrides (Gemma 4's wider full-attention heads, Dots3's
    per-layer head counts), taken off the config: while they are on it, reading a per-layer field
    globally raises, and the debug sizes must read and set those fields."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    overrides = {int(i): dict(values) for i, values in (config.to_dict().get("per_layer_config") or {}).items()}
    config.per_layer_config = None
    return overrides


def _put_back_per_layer_overrides(
    config: Any, overrides: dict[int, dict[str, Any]], layers_before: int, changed: set[str]
) -> None:
    """Layer i of the smaller stack gets old layer i's overrides (the rule of the per-layer lists),
    less those of a field the debug sizes changed: its full-size value (a 512-wide head) would not
    fit the tiny model. No override left is said as such (an empty per_layer_config): a config class
    that derives overrides when it is given none (Gemma 4's 512-wide full-attention heads) would
    otherwise derive full-size ones again."""
    layers = config.num_hidden_layers
    kept: dict[int, dict[str, Any]] = {}
    for i in range(layers):
        layer = {k: v for k, v in overrides.get(i % layers_before, {}).items() if k not in changed}
        if layer:
            kept[i] = layer
    config.per_layer_config = kept


def _fit_token_ids(config: Any, vocab: int) -> None:
    """Special-token ids of the full vocabulary past the debug one (Phi-3 pads with 32000): the last
    id instead (some configs require an integer there)."""
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= vocab:
            setattr(config, key, vocab - 1)
        elif isinstance(value, list) and any(isinstance(i, int) and i >= vocab for i in value):
            setattr(config, key, [min(i, vocab - 1) for i in value])


# Counts of layers: the last num_kv_shared_layers reuse the keys and values of earlier ones (Gemma
# 3n); Dory's stack is n_input_layers, then n_recurrent_layers run in a loop, then n_output_layers.
LAYER_COUNTS = ("num_kv_shared_layers", "n_input_layers", "n_recurrent_layers", "n_output_layers")


def _fit_debug_sizes(config: Any, layers_before: Any) -> None:
    """What the debug sizes imply: latent attention's head sizes, counts of layers kept in
    proportion, every per-layer list (layer types, MLP types) cut to the new layer count, and lists
    of layer indices kept to the layers that remain."""
    if getattr(config, "qk_rope_head_dim", None):
        # Latent attention: the rotary part is the head_dim, and every head has its own keys.
        if _has_field(config, "head_dim"):
            config.head_dim = config.qk_rope_head_dim
        if _has_field(config, "num_key_value_heads"):
            config.num_key_value_heads = config.num_attention_heads
        if _has_field(config, "qk_head_dim") and getattr(config, "qk_nope_head_dim", None):
            # A query/key head is its two parts; LongCat derives this only when it is unset.
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    layers = getattr(config, "num_hidden_layers", None)
    if not (isinstance(layers, int) and isinstance(layers_before, int) and layers != layers_before):
        return
    layers = _fit_layer_counts(config, layers, layers_before)
    for key in config.to_dict():
        # The value itself, not to_dict's: a config may serialise differently from what it holds
        # (Dory writes each layer as two blocks).
        value = getattr(config, key, None)
        if not isinstance(value, list):
            continue
        if len(value) == layers_before:
            setattr(config, key, [value[i % len(value)] for i in range(layers)])
        elif key.endswith("_layers") and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            # Indices of layers (Kolibri's index_layers): those the smaller stack still has.
            setattr(config, key, [i for i in value if i < layers])


def _fit_layer_counts(config: Any, layers: int, layers_before: int) -> int:
    """Counts of layers in proportion to the smaller stack, and the stack's new depth."""
    found = {key: getattr(config, key, None) for key in LAYER_COUNTS}
    counts = {key: count for key, count in found.items() if isinstance(count, int) and not isinstance(count, bool)}
    if len(counts) > 1 and sum(counts.values()) == layers_before:
        # Counts that split the stack into parts (Dory's): each part that had layers keeps at least
        # one, and the stack is as deep as its parts (3 layers for Dory's three, not 2).
        for key, count in counts.items():
            setattr(config, key, max(round(count * layers / layers_before), 1) if count else 0)
        config.num_hidden_layers = sum(getattr(config, key) for key in counts)
        return config.num_hidden_layers
    for key, count in counts.items():
        if 0 < count < layers_before:
            # Some layers of the full stack (15 of Gemma 3n's 35): some of the smaller one, not all
            # (the validation then finds no layer that computes the shared keys) and not none.
            setattr(config, key, min(max(round(count * layers / layers_before), 1), layers - 1))
        elif count == layers_before:
            setattr(config, key, layers)
    return layers


def override_value(args: HFArgs, key: str) -> Any:
    """What an override set (registry's `override_value`)."""
    return getattr(args, key) if key in OWN_FIELDS else getattr(args.config, key)
