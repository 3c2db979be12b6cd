"""Our decoder <-> a Hugging Face transformers causal LM laid out like `LlamaForCausalLM`: the names,
config.json out and config.json checked in, written once for every family built from
`titan_tpu.models.common`. A family subclasses `DecoderHFAdapter` with its model type, its extra per-layer
names and the config keys of its feed-forward.

No q/k permutation: our rotary embedding uses the same half-rotation layout as transformers (Meta's
original checkpoints pair adjacent elements; transformers' conversion script permutes q/k once, and
HF checkpoints are already in the half layout), so weights map one to one. The logit parity tests in
tests/parity/ guard this.

Only renames happen here, so the values can be DTensor shards: each rank maps the shards it holds.
Unknown names fail loudly in both directions: a silently dropped tensor would load as garbage.
"""

from __future__ import annotations

import math
import re
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import torch

from titan_tpu.models.common.decoder_args import DecoderArgs
from titan_tpu.models.common.stacked_layouts import StackedTensors

# The family's argument class, so its hooks read its own fields with their types.
A = TypeVar("A", bound=DecoderArgs)

# Top-level names map whole; per-layer names are relative to `layers.{i}.` / `model.layers.{i}.`.
DECODER_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DECODER_PER_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
QK_NORM_PER_LAYER = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_TOP_LEVEL_BACK = {v: k for k, v in DECODER_TOP_LEVEL.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _close(value: Any, want: float, rel_tol: float) -> bool:
    return isinstance(value, (int, float)) and math.isclose(value, want, rel_tol=rel_tol)


class DecoderHFAdapter(StackedTensors, Generic[A]):
    """Stateless; one instance serves every flavor of a family (the methods take the args)."""

    # transformers' folder: model.safetensors; 5.x reads `dtype`, 4.x `torch_dtype` from config.json.
    weights_stem = "model"
    config_dtype_keys = ("dtype", "torch_dtype")
    family = "decoder"  # how messages name the family, e.g. "Llama 3"
    per_layer: Mapping[str, str] = DECODER_PER_LAYER
    # transformers' head_dim when config.json has none; None: its usual hidden_size // heads.
    hf_default_head_dim: int | None = None
    hf_hidden_act = "silu"  # the feed-forward's activation, as config.json names it

    def __init__(self) -> None:
        self._per_layer_back = {v: k for k, v in self.per_layer.items()}

    # -- the family's part ---------------------------------------------------------------------
    @abstractmethod
    def hf_model_type(self, args: A) -> str: ...

    @abstractmethod
    def hf_architecture(self, args: A) -> str: ...

    @abstractmethod
    def feed_forward_config(self, args: A) -> dict[str, Any]:
        """config.json keys of the family's feed-forward (and any other keys of its own)."""

    def compared_fields(self, config: dict[str, Any], args: A) -> dict[str, tuple[Any, Any]]:
        """config.json key -> (what `config` has, what the flavor has) for every shape it fixes; a
        family adds its feed-forward's to these."""
        heads = config.get("num_attention_heads")
        hidden = config.get("hidden_size")
        head_dim = config.get("head_dim", self.hf_default_head_dim)
        if head_dim is None and isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
            head_dim = hidden // heads
        return {
            "vocab_size": (config.get("vocab_size"), args.vocab_size),
            "hidden_size": (hidden, args.dim),
            "num_hidden_layers": (config.get("num_hidden_layers"), args.n_layers),
            "num_attention_heads": (heads, args.n_heads),
            "num_key_value_heads": (config.get("num_key_value_heads", heads), args.n_kv_heads),
            "head_dim": (head_dim, args.attn_head_dim),
            "tie_word_embeddings": (bool(config.get("tie_word_embeddings", False)), args.tie_embeddings),
        }

    def family_problems(self, config: dict[str, Any], args: A) -> list[str]:
        """Settings of `config` the family's model does not implement (biases, windows, ...)."""
        if config.get("attention_bias"):
            return [f"attention_bias is true; {self.family} has no biases"]
        return []

    # -- names ---------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        if name in DECODER_TOP_LEVEL:
            return DECODER_TOP_LEVEL[name]
        match = _OURS_LAYER.match(name)
        if match and match.group(2) in self.per_layer:
            return f"model.layers.{match.group(1)}.{self.per_layer[match.group(2)]}"
        raise KeyError(f"no Hugging Face name for {self.family} parameter '{name}'")

    def our_name(self, hf_name: str) -> str:
        if hf_name in _TOP_LEVEL_BACK:
            return _TOP_LEVEL_BACK[hf_name]
        match = _HF_LAYER.match(hf_name)
        if match and match.group(2) in self._per_layer_back:
            return f"layers.{match.group(1)}.{self._per_layer_back[match.group(2)]}"
        raise KeyError(f"Hugging Face tensor '{hf_name}' has no {self.family} counterpart")

    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """Here every tensor maps whole to one HF tensor (StackedTensors turns this into layouts)."""
        return [self.hf_name(name)], None

    # Tensors, as a family that splits or stacks them (qwen3's experts) needs in its override.
    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.hf_name(name): value for name, value in state_dict.items()}

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.our_name(name): value for name, value in hf_state_dict.items()}

    # -- config.json ---------------------------------------------------------------------------
    def to_hf_config(self, args: A) -> dict[str, Any]:
        """config.json for transformers (4.56+ and 5.x both read these keys)."""
        rope_scaling = None
        if args.rope_scaling is not None:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": args.rope_scaling.factor,
                "low_freq_factor": args.rope_scaling.low_freq_factor,
                "high_freq_factor": args.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": args.rope_scaling.original_max_position,
            }
        return {
            "architectures": [self.hf_architecture(args)],
            "model_type": self.hf_model_type(args),
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.attn_head_dim,
            "hidden_act": self.hf_hidden_act,
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": rope_scaling,
            "attention_bias": False,
            "tie_word_embeddings": args.tie_embeddings,
            "use_cache": True,
            **self.feed_forward_config(args),
        }

    def check_hf_config(self, config: dict[str, Any], args: A) -> list[str]:
        """Every way `config` (a parsed config.json) disagrees with `args`; empty when they agree.

        Shapes, and the hyper-parameters that change the logits (rope, norm eps, tied head). The
        context length (max_position_embeddings) is not compared: it sizes tables, not weights.
        """
        problems: list[str] = []
        want_type = self.hf_model_type(args)
        if config.get("model_type") != want_type:
            problems.append(f"model_type is {config.get('model_type')!r}, expected {want_type!r}")
        for key, (found, want) in self.compared_fields(config, args).items():
            if found != want:
                problems.append(f"{key} is {found!r}, the flavor has {want!r}")
        problems += self.family_problems(config, args)
        act = config.get("hidden_act", "silu")  # transformers' default
        if act != self.hf_hidden_act:
            problems.append(f"hidden_act is {act!r}, expected {self.hf_hidden_act!r}")
        eps = config.get("rms_norm_eps")
        if not _close(eps, args.norm_eps, rel_tol=1e-6):
            problems.append(f"rms_norm_eps is {eps!r}, the flavor has {args.norm_eps!r}")
        return problems + _rope_problems(config, args)


def _rope_problems(config: dict[str, Any], args: DecoderArgs) -> list[str]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta"))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling")
    problems = []
    if not _close(theta, args.rope_theta, rel_tol=1e-9):
        problems.append(f"rope_theta is {theta!r}, the flavor has {args.rope_theta!r}")
    ours = args.rope_scaling
    if ours is None:
        if scaling:
            problems.append(f"rope scaling is {scaling!r}, the flavor has none")
        return problems
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "llama3":
        problems.append(f"rope scaling is {scaling!r}, the flavor has llama3 scaling")
        return problems
    wanted = {
        "factor": ours.factor,
        "low_freq_factor": ours.low_freq_factor,
        "high_freq_factor": ours.high_freq_factor,
        "original_max_position_embeddings": ours.original_max_position,
    }
    for key, want in wanted.items():
        got = scaling.get(key)
        if not _close(got, want, rel_tol=1e-9):
            problems.append(f"rope scaling {key} is {got!r}, the flavor has {want!r}")
    return problems
