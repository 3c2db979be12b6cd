"""FLUX.1 <-> diffusers `FluxTransformer2DModel`: parameter names, config.json, config check.

Every tensor maps whole to one diffusers tensor (our q/k/v are separate Linears, as in diffusers, and
the final modulation is stored (scale, shift) as diffusers stores it), so only names change and the
values may be DTensor shards. diffusers folders name their weights `diffusion_pytorch_model.safetensors`
(or shards with `diffusion_pytorch_model.safetensors.index.json`): `weights_stem` says so, and
`config_dtype_keys` which dtype keys its config.json may carry.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from titan_tpu.models.common.stacked_layouts import StackedTensors
from titan_tpu.models.flux.args import FluxArgs

T = TypeVar("T")

_TOP_LEVEL = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "final_layer.modulation.lin": "norm_out.linear",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear",
    "txt_mod.lin": "norm1_context.linear",
    "img_attn.wq": "attn.to_q",
    "img_attn.wk": "attn.to_k",
    "img_attn.wv": "attn.to_v",
    "img_attn.q_norm": "attn.norm_q",
    "img_attn.k_norm": "attn.norm_k",
    "txt_attn.wq": "attn.add_q_proj",
    "txt_attn.wk": "attn.add_k_proj",
    "txt_attn.wv": "attn.add_v_proj",
    "txt_attn.q_norm": "attn.norm_added_q",
    "txt_attn.k_norm": "attn.norm_added_k",
    "img_attn_out": "attn.to_out.0",
    "txt_attn_out": "attn.to_add_out",
    "img_mlp.w1": "ff.net.0.proj",
    "img_mlp.w2": "ff.net.2",
    "txt_mlp.w1": "ff_context.net.0.proj",
    "txt_mlp.w2": "ff_context.net.2",
}
_SINGLE = {
    "modulation.lin": "norm.linear",
    "attn.wq": "attn.to_q",
    "attn.wk": "attn.to_k",
    "attn.wv": "attn.to_v",
    "attn.q_norm": "attn.norm_q",
    "attn.k_norm": "attn.norm_k",
    "mlp_in": "proj_mlp",
    "linear_out": "proj_out",
}
# (our block container, diffusers' block container, module map)
_BLOCKS = (("double_blocks", "transformer_blocks", _DOUBLE), ("single_blocks", "single_transformer_blocks", _SINGLE))
_LEAF = re.compile(r"^(.+)\.(weight|bias)$")
_BLOCK = re.compile(r"^([a-z_]+)\.(\d+)\.(.+)$")


def _invert(mapping: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in mapping.items()}


class FluxStateDictAdapter(StackedTensors):
    """Maps names and configs between our FluxModel and diffusers' FluxTransformer2DModel. Stateless."""

    class_name = "FluxTransformer2DModel"
    weights_stem = "diffusion_pytorch_model"
    # diffusers' own save_pretrained writes no dtype key: it fails on "dtype" and warns that it
    # ignores "torch_dtype" on every load.
    config_dtype_keys: tuple[str, ...] = ()

    def _rename(self, name: str, forward: bool) -> str:
        leaf = _LEAF.match(name)
        if leaf is not None:
            module, kind = leaf.groups()
            top = _TOP_LEVEL if forward else _invert(_TOP_LEVEL)
            if module in top:
                return f"{top[module]}.{kind}"
            block = _BLOCK.match(module)
            if block is not None:
                container, index, inner = block.groups()
                for ours, theirs, mapping in _BLOCKS:
                    src, dst = (ours, theirs) if forward else (theirs, ours)
                    table = mapping if forward else _invert(mapping)
                    if container == src and inner in table:
                        return f"{dst}.{index}.{table[inner]}.{kind}"
        side = "FLUX parameter" if forward else "diffusers tensor"
        raise KeyError(f"{side} '{name}' has no counterpart")

    def hf_name(self, name: str) -> str:
        return self._rename(name, forward=True)

    def our_name(self, hf_name: str) -> str:
        return self._rename(hf_name, forward=False)

    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """Every FLUX tensor maps whole to one diffusers tensor (StackedTensors turns this into layouts)."""
        return [self.hf_name(name)], None

    def to_hf(self, state_dict: dict[str, T]) -> dict[str, T]:
        return {self.hf_name(name): value for name, value in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, T]) -> dict[str, T]:
        return {self.our_name(name): value for name, value in hf_state_dict.items()}

    def to_hf_config(self, args: FluxArgs) -> dict[str, Any]:
        """config.json that `FluxTransformer2DModel.from_pretrained` reads (patching is done outside
        the transformer, so patch_size is 1 and in_channels counts packed channels)."""
        return {
            "_class_name": self.class_name,
            "patch_size": 1,
            "in_channels": args.in_channels,
            "out_channels": None,
            "num_layers": args.depth_double,
            "num_single_layers": args.depth_single,
            "attention_head_dim": args.head_dim,
            "num_attention_heads": args.n_heads,
            "joint_attention_dim": args.context_dim,
            "pooled_projection_dim": args.pooled_dim,
            "guidance_embeds": args.guidance_embed,
            "axes_dims_rope": list(args.axes_dim),
        }

    def check_hf_config(self, config: dict[str, Any], args: FluxArgs) -> list[str]:
        """Every way a diffusers transformer config.json disagrees with `args`; empty when they agree.
        Keys diffusers would fill with its defaults are compared against those defaults."""
        problems: list[str] = []
        class_name = config.get("_class_name", self.class_name)
        if class_name != self.class_name:
            problems.append(f"_class_name is {class_name!r}, expected {self.class_name!r}")
        if config.get("patch_size", 1) != 1:
            problems.append(f"patch_size is {config.get('patch_size')!r}; only 1 (pre-packed latents) is supported")
        out_channels = config.get("out_channels")
        if out_channels not in (None, args.in_channels):
            problems.append(f"out_channels is {out_channels!r}, the flavor has {args.in_channels!r}")
        defaults = FluxArgs()
        expected = {
            "in_channels": (args.in_channels, defaults.in_channels),
            "num_layers": (args.depth_double, 19),
            "num_single_layers": (args.depth_single, 38),
            "attention_head_dim": (args.head_dim, 128),
            "num_attention_heads": (args.n_heads, 24),
            "joint_attention_dim": (args.context_dim, 4096),
            "pooled_projection_dim": (args.pooled_dim, 768),
            "guidance_embeds": (args.guidance_embed, False),
            "axes_dims_rope": (list(args.axes_dim), [16, 56, 56]),
        }
        for key, (want, default) in expected.items():
            found = config.get(key, default)
            if isinstance(found, tuple):
                found = list(found)
            if found != want:
                problems.append(f"{key} is {found!r}, the flavor has {want!r}")
        return problems


FLUX_STATE_DICT_ADAPTER = FluxStateDictAdapter()
