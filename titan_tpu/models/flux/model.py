"""FLUX.1 flow transformer, single-device; parallelism is applied from outside.

Inputs are already packed into tokens: image latents [B, L_img, in_channels], text embeddings
[B, L_txt, context_dim] (T5), a pooled text vector [B, pooled_dim] (CLIP), the flow time t in [0, 1]
per sample, and (flux-dev) a guidance scale per sample. Position ids [L, 3] (text index, row, column)
drive the 3-axis rotary embedding. The output is the predicted velocity per image token.

Double-stream blocks keep separate weights for image and text tokens and attend jointly; single-stream
blocks run on the concatenated sequence (text first) with attention and MLP in parallel. Module names:
img_in, txt_in, time_in, guidance_in, vector_in, double_blocks[i].{img,txt}_{mod,attn,attn_out,mlp},
single_blocks[i].{modulation, attn, mlp_in, linear_out}, final_layer.{modulation, linear}.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_tpu.models.flux.args import FluxArgs
from titan_tpu.models.flux.layers import (
    GeluMLP,
    HeadProjections,
    MLPEmbedder,
    Modulation,
    init_linear,
    joint_attention,
    modulate,
    rope_tables,
    timestep_features,
)

# FLUX.1 embeds t and the guidance scale as if they ran from 0 to 1000 (diffusion-step units).
TIME_FACTOR = 1000.0


class DoubleStreamBlock(nn.Module):
    """Image and text streams, each with its own modulation, projections and MLP; one joint attention."""

    def __init__(self, args: FluxArgs) -> None:
        super().__init__()
        self.img_mod = Modulation(args.dim, 6)
        self.img_attn = HeadProjections(args.dim, args.head_dim)
        self.img_attn_out = nn.Linear(args.dim, args.dim)
        self.img_mlp = GeluMLP(args.dim, args.mlp_hidden_dim)
        self.txt_mod = Modulation(args.dim, 6)
        self.txt_attn = HeadProjections(args.dim, args.head_dim)
        self.txt_attn_out = nn.Linear(args.dim, args.dim)
        self.txt_mlp = GeluMLP(args.dim, args.mlp_hidden_dim)

    def init_weights(self) -> None:
        streams = (
            (self.img_mod, self.img_attn, self.img_mlp, self.img_attn_out),
            (self.txt_mod, self.txt_attn, self.txt_mlp, self.txt_attn_out),
        )
        for mod, attn, mlp, attn_out in streams:
            mod.init_weights()
            attn.init_weights()
            mlp.init_weights()
            init_linear(attn_out)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = self.img_mod(vec)
        txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = self.txt_mod(vec)
        img_q, img_k, img_v = self.img_attn(modulate(img, img_shift1, img_scale1))
        txt_q, txt_k, txt_v = self.txt_attn(modulate(txt, txt_shift1, txt_scale1))
        attn = joint_attention(
            torch.cat([txt_q, img_q], dim=2),
            torch.cat([txt_k, img_k], dim=2),
            torch.cat([txt_v, img_v], dim=2),
            cos,
            sin,
        )
        txt_len = txt.shape[1]
        txt_attn, img_attn = attn[:, :txt_len], attn[:, txt_len:]
        img = img + img_gate1 * self.img_attn_out(img_attn)
        img = img + img_gate2 * self.img_mlp(modulate(img, img_shift2, img_scale2))
        txt = txt + txt_gate1 * self.txt_attn_out(txt_attn)
        txt = txt + txt_gate2 * self.txt_mlp(modulate(txt, txt_shift2, txt_scale2))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over the joint sequence: attention and MLP from the same modulated input, their
    outputs concatenated into one output projection."""

    def __init__(self, args: FluxArgs) -> None:
        super().__init__()
        self.modulation = Modulation(args.dim, 3)
        self.attn = HeadProjections(args.dim, args.head_dim)
        self.mlp_in = nn.Linear(args.dim, args.mlp_hidden_dim)
        self.linear_out = nn.Linear(args.dim + args.mlp_hidden_dim, args.dim)

    def init_weights(self) -> None:
        self.modulation.init_weights()
        self.attn.init_weights()
        init_linear(self.mlp_in)
        init_linear(self.linear_out)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        h = modulate(x, shift, scale)
        q, k, v = self.attn(h)
        attn = joint_attention(q, k, v, cos, sin)
        mlp = nn.functional.gelu(self.mlp_in(h), approximate="tanh")
        return x + gate * self.linear_out(torch.cat([attn, mlp], dim=-1))


class FinalLayer(nn.Module):
    """Modulated LayerNorm and the projection back to latent channels. The modulation yields
    (scale, shift) in that order, as diffusers stores it (the original FLUX.1 code has shift first)."""

    def __init__(self, args: FluxArgs) -> None:
        super().__init__()
        self.modulation = Modulation(args.dim, 2)
        self.linear = nn.Linear(args.dim, args.out_channels)

    def init_weights(self) -> None:
        self.modulation.init_weights()
        # Zero output at init: the first prediction is v = 0, and the loss starts at E|noise - x0|^2.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(vec)
        return self.linear(modulate(x, shift, scale))


class FluxModel(nn.Module):
    """Velocity prediction v(x_t, t | text) for packed image tokens. Build under `torch.device("meta")`,
    then `to_empty(device=...)` and `init_weights()`; there are no buffers (rotary tables are computed
    from the position ids in each forward)."""

    def __init__(self, args: FluxArgs) -> None:
        super().__init__()
        self.args = args
        self.img_in = nn.Linear(args.in_channels, args.dim)
        self.txt_in = nn.Linear(args.context_dim, args.dim)
        self.time_in = MLPEmbedder(args.time_freq_dim, args.dim)
        self.guidance_in = MLPEmbedder(args.time_freq_dim, args.dim) if args.guidance_embed else None
        self.vector_in = MLPEmbedder(args.pooled_dim, args.dim)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(args) for _ in range(args.depth_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(args) for _ in range(args.depth_single))
        self.final_layer = FinalLayer(args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise every parameter. `buffer_device` is accepted for the trainer's protocol;
        this model has no buffers."""
        init_linear(self.img_in)
        init_linear(self.txt_in)
        for embedder in (self.time_in, self.guidance_in, self.vector_in):
            if embedder is not None:
                embedder.init_weights()
        for block in (*self.double_blocks, *self.single_blocks):
            block.init_weights()
        self.final_layer.init_weights()

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        pooled: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """img [B, L_img, in_channels], img_ids [L_img, 3], txt [B, L_txt, context_dim], txt_ids
        [L_txt, 3], timesteps [B] in [0, 1], pooled [B, pooled_dim], guidance [B] (flux-dev only)
        -> velocity [B, L_img, in_channels]."""
        args = self.args
        dtype = self.img_in.weight.dtype
        vec = self.time_in(timestep_features(timesteps * TIME_FACTOR, args.time_freq_dim).to(dtype))
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this flavor embeds a guidance scale: pass guidance [B]")
            vec = vec + self.guidance_in(timestep_features(guidance * TIME_FACTOR, args.time_freq_dim).to(dtype))
        vec = vec + self.vector_in(pooled)
        img = self.img_in(img)
        txt = self.txt_in(txt)
        cos, sin = rope_tables(torch.cat([txt_ids, img_ids], dim=0), args.axes_dim, args.rope_theta)
        for double in self.double_blocks:
            img, txt = double(img, txt, vec, cos, sin)
        x = torch.cat([txt, img], dim=1)
        for single in self.single_blocks:
            x = single(x, vec, cos, sin)
        return self.final_layer(x[:, txt.shape[1] :], vec)
