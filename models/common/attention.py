"""Grouped-query causal self-attention."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_std_
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, H_kv, D] -> [B, S, H_kv * n_rep, D], each kv head repeated for its group of query heads.

    Done by hand rather than with SDPA's `enable_gqa` so the layer relies on no backend-specific support
    for that flag (PyTorch's own CPU and CUDA kernels have it; an out-of-tree accelerator backend such
    as the TPU one need not). The price is one k/v copy the size of q.
    """
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, seqlen, n_kv_heads, n_rep, head_dim).reshape(
        bs, seqlen, n_kv_heads * n_rep, head_dim
    )


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int
) -> torch.Tensor:
    """Causal attention on [B, H, S, D] in query blocks of `block` tokens, with plain matmuls.

    Each query block attends only to the keys up to its own end, so the blocks above the diagonal,
    half of the work for long sequences, are never computed; only the diagonal block needs a mask.
    Scores and softmax are float32. On CPUs this runs at matmul speed, where the fused SDPA kernels
    are several times slower in bf16; on accelerators SDPA's fused kernels are the better choice.
    """
    seqlen, head_dim = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim)
    outputs = []
    for start in range(0, seqlen, block):
        stop = min(start + block, seqlen)
        scores = (q[:, :, start:stop] @ k[:, :, :stop].transpose(-1, -2)).float() * scale
        diagonal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=q.device).tril()
        scores[..., start:].masked_fill_(~diagonal, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        outputs.append(probs @ v[:, :, :stop])
    return torch.cat(outputs, dim=2)


class Attention(nn.Module):
    """Multi-head attention with n_kv_heads <= n_heads (GQA), rotary positions and a causal mask.

    `head_dim` is explicit because it need not be dim / n_heads (Qwen 3 uses 128 at every size).
    `qk_norm` adds a per-head RMSNorm on q and k before the rotation, as Qwen 3 does.
    `attention_block` 0 uses `scaled_dot_product_attention`; N > 0 uses `blocked_causal_attention`
    with N-token query blocks.

    The forward derives head counts from the projected tensors, not from the constructor arguments: under
    tensor parallelism wq/wk/wv hold only this rank's heads, and the same code must run on the shard.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        norm_eps: float,
        attention_block: int = 0,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.attention_block = attention_block
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def init_weights(self, out_init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_std_(linear.weight, 0.02)
        # wo writes into the residual stream; a smaller std keeps its variance from growing with depth.
        trunc_normal_std_(self.wo.weight, out_init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        n_rep = q.shape[2] // k.shape[2]
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        if self.attention_block > 0:
            out = blocked_causal_attention(q, k, v, self.attention_block)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
