"""Llama 3 <-> Hugging Face transformers `LlamaForCausalLM`: parameter names, config.json, shape checks.

No q/k permutation: our rotary embedding uses the same half-rotation layout as transformers (Meta's
original checkpoints pair adjacent elements; transformers' conversion script permutes q/k once, and
HF checkpoints are already in the half layout), so weights map one to one. The logit parity test in
tests/parity/test_hf_roundtrip.py guards this.

Only renames happen here, so the values can be DTensor shards: each rank maps the shards it holds.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

from models.common.hf_names import DECODER_PER_LAYER, DECODER_TOP_LEVEL
from models.llama3.args import Llama3Args

T = TypeVar("T")

_TOP_LEVEL = DECODER_TOP_LEVEL
_PER_LAYER = DECODER_PER_LAYER
_TOP_LEVEL_BACK = {v: k for k, v in _TOP_LEVEL.items()}
_PER_LAYER_BACK = {v: k for k, v in _PER_LAYER.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class Llama3StateDictAdapter:
    """Maps names and configs between our Llama 3 and transformers' Llama. Stateless; one instance
    serves every flavor (the methods take the args)."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    # transformers' folder: model.safetensors; 5.x reads `dtype`, 4.x `torch_dtype` from config.json.
    weights_stem = "model"
    config_dtype_keys = ("dtype", "torch_dtype")

    def hf_name(self, name: str) -> str:
        if name in _TOP_LEVEL:
            return _TOP_LEVEL[name]
        match = _OURS_LAYER.match(name)
        if match and match.group(2) in _PER_LAYER:
            return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"
        raise KeyError(f"no Hugging Face name for Llama 3 parameter '{name}'")

    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """The checkpoint layer's interface: every Llama tensor maps whole to one HF tensor."""
        return [self.hf_name(name)], None

    def our_name(self, hf_name: str) -> str:
        if hf_name in _TOP_LEVEL_BACK:
            return _TOP_LEVEL_BACK[hf_name]
        match = _HF_LAYER.match(hf_name)
        if match and match.group(2) in _PER_LAYER_BACK:
            return f"layers.{match.group(1)}.{_PER_LAYER_BACK[match.group(2)]}"
        raise KeyError(f"Hugging Face tensor '{hf_name}' has no Llama 3 counterpart")

    def to_hf(self, state_dict: dict[str, T]) -> dict[str, T]:
        return {self.hf_name(name): value for name, value in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, T]) -> dict[str, T]:
        return {self.our_name(name): value for name, value in hf_state_dict.items()}

    def to_hf_config(self, args: Llama3Args) -> dict[str, Any]:
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
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.attn_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": rope_scaling,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": args.tie_embeddings,
            "use_cache": True,
        }

    def check_hf_config(self, config: dict[str, Any], args: Llama3Args) -> list[str]:
        """Every way `config` (a parsed config.json) disagrees with `args`; empty when they agree.

        Shapes, and the hyper-parameters that change the logits (rope, norm eps, tied head). The context
        length (max_position_embeddings) is not compared: it sizes tables, not weights.
        """
        problems: list[str] = []
        model_type = config.get("model_type")
        if model_type != self.model_type:
            problems.append(f"model_type is {model_type!r}, expected {self.model_type!r}")
        heads = config.get("num_attention_heads")
        hidden = config.get("hidden_size")
        head_dim = config.get("head_dim")
        if head_dim is None and isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
            head_dim = hidden // heads  # transformers' default when config.json has no head_dim
        found = {
            "vocab_size": config.get("vocab_size"),
            "hidden_size": hidden,
            "intermediate_size": config.get("intermediate_size"),
            "num_hidden_layers": config.get("num_hidden_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": config.get("num_key_value_heads", heads),
            "head_dim": head_dim,
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
        expected = {
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.attn_head_dim,
            "tie_word_embeddings": args.tie_embeddings,
        }
        for key, want in expected.items():
            if found[key] != want:
                problems.append(f"{key} is {found[key]!r}, the flavor has {want!r}")
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                problems.append(f"{key} is true; Llama 3 has no biases")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act is {act!r}, expected 'silu'")
        eps = config.get("rms_norm_eps")
        if not isinstance(eps, (int, float)) or not math.isclose(eps, args.norm_eps, rel_tol=1e-6):
            problems.append(f"rms_norm_eps is {eps!r}, the flavor has {args.norm_eps!r}")
        problems += self._check_rope(config, args)
        return problems

    def _check_rope(self, config: dict[str, Any], args: Llama3Args) -> list[str]:
        # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
        params = config.get("rope_parameters")
        if isinstance(params, dict):
            theta = params.get("rope_theta", config.get("rope_theta"))
            scaling = params if params.get("rope_type", "default") != "default" else None
        else:
            theta = config.get("rope_theta", 10000.0)
            scaling = config.get("rope_scaling")
        problems = []
        if not isinstance(theta, (int, float)) or not math.isclose(theta, args.rope_theta, rel_tol=1e-9):
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
            if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9):
                problems.append(f"rope scaling {key} is {got!r}, the flavor has {want!r}")
        return problems


LLAMA3_STATE_DICT_ADAPTER = Llama3StateDictAdapter()
