"""Qwen 3 (dense and MoE) <-> Hugging Face transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM.

Names, ours -> theirs (per layer i, prefix `model.layers.{i}.`):

    attention_norm.weight            input_layernorm.weight
    attention.w{q,k,v,o}.weight      self_attn.{q,k,v,o}_proj.weight
    attention.{q,k}_norm.weight      self_attn.{q,k}_norm.weight
    ffn_norm.weight                  post_attention_layernorm.weight
    feed_forward.w{1,3,2}.weight     mlp.{gate,up,down}_proj.weight                  (dense)
    feed_forward.router.gate.weight  mlp.gate.weight                                 (MoE)
    feed_forward.experts.w{1,3,2}    mlp.experts.{K}.{gate,up,down}_proj.weight      (MoE, K = 0..E-1)

plus tok_embeddings / norm / output <-> model.embed_tokens / model.norm / lm_head (no lm_head when the
embeddings are tied). Both sides use the half-rotation rope layout, so q/k need no permutation.

Experts: the Qwen hub checkpoints, and what transformers 5.x `save_pretrained` writes, hold one tensor
per expert. transformers 5.x keeps them fused in memory instead: `mlp.experts.gate_up_proj`
[E, 2*hidden, dim] (gate rows first) and `mlp.experts.down_proj` [E, dim, hidden]. Our stacked
[E, out, in] weights are the per-expert tensors stacked along dim 0 (no transpose).

Interface (titan_tpu.checkpoint.hf.StateDictAdapter, as the Llama 3 adapter):
- `hf_tensors(name, shape)`: what the checkpoint layer's import and export use: `([hf_name], None)`,
  or for a stacked expert weight the E per-expert names and the stacking dim 0;
- `hf_name` / `our_name`: the one-to-one renames (every tensor except the stacked experts);
- `hf_names(name, num_experts)`: always defined; one name, or the E per-expert names a stacked
  expert weight is `torch.stack` of (dim 0); `our_name_and_index` is its inverse;
- `to_hf` / `from_hf`: whole-tensor dicts, stacking and unstacking experts (from_hf also reads
  transformers 5.x's fused in-memory layout);
- `to_hf_config(args)` / `check_hf_config(config, args)`: config.json out and checked in.
Stateless: one instance serves every flavor of both families.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from models.common.hf_names import DECODER_PER_LAYER, DECODER_TOP_LEVEL
from models.qwen3.args import Qwen3Args, Qwen3MoeArgs

_TOP_LEVEL = DECODER_TOP_LEVEL
_PER_LAYER = {
    **DECODER_PER_LAYER,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    # MoE router (its name cannot clash with the dense ones: gate vs gate_proj)
    "feed_forward.router.gate.weight": "mlp.gate.weight",
}
# Our stacked expert weight -> the per-expert projection in HF files.
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_PROJ_BACK = {v: k for k, v in _EXPERT_PROJ.items()}
_TOP_LEVEL_BACK = {v: k for k, v in _TOP_LEVEL.items()}
_PER_LAYER_BACK = {v: k for k, v in _PER_LAYER.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OURS_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3StateDictAdapter:
    """Maps names, tensors and configs between our Qwen 3 and transformers'. Unknown names fail
    loudly in both directions: a silently dropped tensor would load as garbage."""

    # transformers' folder: model.safetensors; 5.x reads `dtype`, 4.x `torch_dtype` from config.json.
    weights_stem = "model"
    config_dtype_keys = ("dtype", "torch_dtype")

    # -- names ------------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        if name in _TOP_LEVEL:
            return _TOP_LEVEL[name]
        match = _OURS_LAYER.match(name)
        if match and match.group(2) in _PER_LAYER:
            return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}"
        if _OURS_EXPERTS.match(name):
            raise KeyError(
                f"Qwen 3 parameter '{name}' stacks one Hugging Face tensor per expert; use hf_names()"
            )
        raise KeyError(f"no Hugging Face name for Qwen 3 parameter '{name}'")

    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """(HF names, stacking dim or None): the experts' weights are stacks along dim 0."""
        if _OURS_EXPERTS.match(name):
            return self.hf_names(name, shape[0]), 0
        return [self.hf_name(name)], None

    def hf_names(self, name: str, num_experts: int) -> list[str]:
        """HF names whose tensors, stacked along dim 0, make our tensor `name` (one for most)."""
        match = _OURS_EXPERTS.match(name)
        if match is None:
            return [self.hf_name(name)]
        layer, ours = match.groups()
        proj = _EXPERT_PROJ[ours]
        return [f"model.layers.{layer}.mlp.experts.{k}.{proj}.weight" for k in range(num_experts)]

    def our_name(self, hf_name: str) -> str:
        name, index = self.our_name_and_index(hf_name)
        if index is not None:
            raise KeyError(
                f"Hugging Face tensor '{hf_name}' is expert {index} of the stacked Qwen 3 parameter "
                f"'{name}'; use our_name_and_index()"
            )
        return name

    def our_name_and_index(self, hf_name: str) -> tuple[str, int | None]:
        """(our name, expert index along dim 0, or None when the tensor maps whole)."""
        if hf_name in _TOP_LEVEL_BACK:
            return _TOP_LEVEL_BACK[hf_name], None
        expert = _HF_EXPERT.match(hf_name)
        if expert:
            layer, index, proj = expert.groups()
            return f"layers.{layer}.feed_forward.experts.{_EXPERT_PROJ_BACK[proj]}", int(index)
        match = _HF_LAYER.match(hf_name)
        if match and match.group(2) in _PER_LAYER_BACK:
            return f"layers.{match.group(1)}.{_PER_LAYER_BACK[match.group(2)]}", None
        raise KeyError(f"Hugging Face tensor '{hf_name}' has no Qwen 3 counterpart")

    # -- whole tensors ----------------------------------------------------------------------------
    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our (unsharded) tensors -> HF file layout, experts unstacked."""
        out: dict[str, torch.Tensor] = {}
        for name, value in state_dict.items():
            if _OURS_EXPERTS.match(name):
                out.update(zip(self.hf_names(name, value.shape[0]), value.unbind(0)))
            else:
                out[self.hf_name(name)] = value
        return out

    def from_hf(
        self, hf_state_dict: Mapping[str, torch.Tensor], args: Qwen3Args | None = None
    ) -> dict[str, torch.Tensor]:
        """HF tensors (file layout or transformers 5.x's fused in-memory layout) -> ours. With `args`,
        the expert count is checked and a tied flavor drops a (duplicate) lm_head."""
        out: dict[str, torch.Tensor] = {}
        stacks: dict[str, dict[int, torch.Tensor]] = {}
        for hf_name, value in hf_state_dict.items():
            if hf_name == "lm_head.weight" and args is not None and args.tie_embeddings:
                continue
            fused = _HF_FUSED.match(hf_name)
            if fused:
                prefix = f"layers.{fused.group(1)}.feed_forward.experts."
                if fused.group(2) == "gate_up_proj":
                    out[prefix + "w1"], out[prefix + "w3"] = value.chunk(2, dim=1)
                else:
                    out[prefix + "w2"] = value
                continue
            name, index = self.our_name_and_index(hf_name)
            if index is None:
                out[name] = value
            else:
                stacks.setdefault(name, {})[index] = value
        expected = args.num_experts if isinstance(args, Qwen3MoeArgs) else None
        for name, experts in stacks.items():
            count = expected if expected is not None else max(experts) + 1
            if sorted(experts) != list(range(count)):
                missing = sorted(set(range(count)) - set(experts))
                raise KeyError(
                    f"Hugging Face checkpoint has {len(experts)} of {count} experts for '{name}' "
                    f"(missing e.g. {missing[:5]})"
                )
            out[name] = torch.stack([experts[k] for k in range(count)])
        return out

    # -- config.json ------------------------------------------------------------------------------
    def to_hf_config(self, args: Qwen3Args) -> dict[str, Any]:
        moe = isinstance(args, Qwen3MoeArgs)
        config: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen3",
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": args.tie_embeddings,
            "use_cache": True,
        }
        if isinstance(args, Qwen3MoeArgs):
            config.update(
                {
                    "num_experts": args.num_experts,
                    "num_experts_per_tok": args.top_k,
                    "moe_intermediate_size": args.moe_hidden_dim,
                    "norm_topk_prob": args.norm_topk_prob,
                    "router_aux_loss_coef": args.router_aux_loss_coef,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                }
            )
        return config

    def check_hf_config(self, config: dict[str, Any], args: Qwen3Args) -> list[str]:
        """Every way `config` (a parsed config.json) disagrees with `args`; empty when they agree.
        Shapes and what changes the logits; not the context length or the aux-loss coefficient."""
        moe = isinstance(args, Qwen3MoeArgs)
        problems: list[str] = []
        want_type = "qwen3_moe" if moe else "qwen3"
        if config.get("model_type") != want_type:
            problems.append(f"model_type is {config.get('model_type')!r}, expected {want_type!r}")
        heads = config.get("num_attention_heads")
        found: dict[str, Any] = {
            "vocab_size": config.get("vocab_size"),
            "hidden_size": config.get("hidden_size"),
            "num_hidden_layers": config.get("num_hidden_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim", 128),  # transformers' Qwen 3 default
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
        expected: dict[str, Any] = {
            "vocab_size": args.vocab_size,
            "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "tie_word_embeddings": args.tie_embeddings,
        }
        if isinstance(args, Qwen3MoeArgs):
            # transformers 5.x writes num_experts under its alias num_local_experts.
            found["num_experts"] = config.get("num_experts", config.get("num_local_experts"))
            found["num_experts_per_tok"] = config.get("num_experts_per_tok")
            found["moe_intermediate_size"] = config.get("moe_intermediate_size")
            found["norm_topk_prob"] = bool(config.get("norm_topk_prob", False))
            expected.update(
                num_experts=args.num_experts,
                num_experts_per_tok=args.top_k,
                moe_intermediate_size=args.moe_hidden_dim,
                norm_topk_prob=args.norm_topk_prob,
            )
            if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
                problems.append("some layers are dense (decoder_sparse_step / mlp_only_layers); ours are all MoE")
        else:
            found["intermediate_size"] = config.get("intermediate_size")
            expected["intermediate_size"] = args.ffn_hidden_dim
        for key, want in expected.items():
            if found[key] != want:
                problems.append(f"{key} is {found[key]!r}, the flavor has {want!r}")
        if config.get("attention_bias"):
            problems.append("attention_bias is true; Qwen 3 has no biases")
        if config.get("use_sliding_window"):
            problems.append("use_sliding_window is true; this model attends to the whole sequence")
        if config.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act is {config.get('hidden_act')!r}, expected 'silu'")
        eps = config.get("rms_norm_eps")
        if not isinstance(eps, (int, float)) or not math.isclose(eps, args.norm_eps, rel_tol=1e-6):
            problems.append(f"rms_norm_eps is {eps!r}, the flavor has {args.norm_eps!r}")
        # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
        params = config.get("rope_parameters")
        if isinstance(params, dict):
            theta = params.get("rope_theta", config.get("rope_theta"))
            scaling = params if params.get("rope_type", "default") != "default" else None
        else:
            theta, scaling = config.get("rope_theta", 10000.0), config.get("rope_scaling")
        if not isinstance(theta, (int, float)) or not math.isclose(theta, args.rope_theta, rel_tol=1e-9):
            problems.append(f"rope_theta is {theta!r}, the flavor has {args.rope_theta!r}")
        if scaling:
            problems.append(f"rope scaling is {scaling!r}; Qwen 3 flavors have none")
        return problems


QWEN3_STATE_DICT_ADAPTER = Qwen3StateDictAdapter()
