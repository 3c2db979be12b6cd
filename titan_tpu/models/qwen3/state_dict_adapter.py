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

The shared decoder adapter (`titan_tpu.models.common.hf_adapter`) does the one-to-one names and config.json;
this one adds QK-norm and the router to the names, the stacked experts (`hf_tensors`, `hf_names`
and their inverse `our_name_and_index`; `to_hf` / `from_hf` stack and unstack them, and from_hf also
reads transformers 5.x's fused in-memory layout), and the MoE config keys.
Stateless: one instance serves every flavor of both families.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titan_tpu.models.common.hf_adapter import DECODER_PER_LAYER, QK_NORM_PER_LAYER, DecoderHFAdapter
from titan_tpu.models.qwen3.args import Qwen3Args, Qwen3MoeArgs

# Our stacked expert weight -> the per-expert projection in HF files.
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_PROJ_BACK = {v: k for k, v in _EXPERT_PROJ.items()}
_OURS_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3StateDictAdapter(DecoderHFAdapter[Qwen3Args]):
    """Maps names, tensors and configs between our Qwen 3 (dense and MoE) and transformers'."""

    family = "Qwen 3"
    per_layer = {
        **DECODER_PER_LAYER,
        **QK_NORM_PER_LAYER,
        # MoE router (its name cannot clash with the dense ones: gate vs gate_proj)
        "feed_forward.router.gate.weight": "mlp.gate.weight",
    }
    hf_default_head_dim = 128  # transformers' Qwen 3 default

    # -- names ------------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        if _OURS_EXPERTS.match(name):
            raise KeyError(f"Qwen 3 parameter '{name}' stacks one Hugging Face tensor per expert; use hf_names()")
        return super().hf_name(name)

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
        expert = _HF_EXPERT.match(hf_name)
        if expert:
            layer, index, proj = expert.groups()
            return f"layers.{layer}.feed_forward.experts.{_EXPERT_PROJ_BACK[proj]}", int(index)
        return super().our_name(hf_name), None

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
    def hf_model_type(self, args: Qwen3Args) -> str:
        return "qwen3_moe" if isinstance(args, Qwen3MoeArgs) else "qwen3"

    def hf_architecture(self, args: Qwen3Args) -> str:
        return "Qwen3MoeForCausalLM" if isinstance(args, Qwen3MoeArgs) else "Qwen3ForCausalLM"

    def feed_forward_config(self, args: Qwen3Args) -> dict[str, Any]:
        config: dict[str, Any] = {"intermediate_size": args.ffn_hidden_dim, "use_sliding_window": False}
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

    def compared_fields(self, config: dict[str, Any], args: Qwen3Args) -> dict[str, tuple[Any, Any]]:
        """The shared shapes, and the feed-forward's: the SwiGLU width (dense), the experts (MoE; the
        intermediate_size a MoE config carries sizes nothing). Not the aux-loss coefficient."""
        fields = super().compared_fields(config, args)
        if not isinstance(args, Qwen3MoeArgs):
            fields["intermediate_size"] = (config.get("intermediate_size"), args.ffn_hidden_dim)
            return fields
        # transformers 5.x writes num_experts under its alias num_local_experts.
        experts = config.get("num_experts", config.get("num_local_experts"))
        fields["num_experts"] = (experts, args.num_experts)
        fields["num_experts_per_tok"] = (config.get("num_experts_per_tok"), args.top_k)
        fields["moe_intermediate_size"] = (config.get("moe_intermediate_size"), args.moe_hidden_dim)
        fields["norm_topk_prob"] = (bool(config.get("norm_topk_prob", False)), args.norm_topk_prob)
        return fields

    def family_problems(self, config: dict[str, Any], args: Qwen3Args) -> list[str]:
        problems = super().family_problems(config, args)
        if config.get("use_sliding_window"):
            problems.append("use_sliding_window is true; this model attends to the whole sequence")
        sparse = config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers")
        if isinstance(args, Qwen3MoeArgs) and sparse:
            problems.append("some layers are dense (decoder_sparse_step / mlp_only_layers); ours are all MoE")
        return problems


QWEN3_STATE_DICT_ADAPTER = Qwen3StateDictAdapter()
