"""Grouped-query causal self-attention, with a pluggable kernel and an optional KV cache."""

import torch
from torch import nn

from titan_tpu.models.common.attention_kernels import SdpaAttention, masked_attention
from titan_tpu.models.common.init import trunc_normal_std_
from titan_tpu.models.common.kv_cache import LayerKVCache
from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.rope import apply_rotary_emb
from titan_tpu.protocols.attention import AttentionKernel


class Attention(nn.Module):
    """Multi-head attention with n_kv_heads <= n_heads (GQA), rotary positions and a causal mask.

    `head_dim` is explicit because it need not be dim / n_heads (Qwen 3 uses 128 at every size).
    `qk_norm` adds a per-head RMSNorm on q and k before the rotation, as Qwen 3 does.
    `kernel` computes causal attention (see attention_kernels.py: "sdpa", "blocked:N", "splash").
    Padded batches and cached decoding take the masked SDPA path instead.

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
        kernel: AttentionKernel = SdpaAttention(),
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.kernel = kernel
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

    def extra_repr(self) -> str:
        return f"kernel={self.kernel.name}"

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerKVCache | None = None,
        start_pos: int = 0,
        attn_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; cos/sin [S, head_dim] (or [B, S, head_dim]) are the rotary
        tables at x's positions; `document_ids` [B, S] keeps packed documents apart (documents.py).

        Without cache or mask this is the training path: the causal kernel. `kv_cache` stores this
        call's keys and values at slots start_pos:start_pos+S and attends over all slots up to there;
        `attn_mask` [B, 1, S, L] (True = may attend, L = start_pos + S) is then required, and may also
        be given alone for a padded batch (see kv_cache.py for the convention).
        """
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        if kv_cache is not None:
            if attn_mask is None:
                raise ValueError("Attention with a kv_cache needs the attn_mask its KVCache.advance made")
            k, v = kv_cache.update(k, v, start_pos)
        if attn_mask is None:
            # The fourth argument only with documents: a kernel without document support keeps (q, k, v).
            out = self.kernel(q, k, v) if document_ids is None else self.kernel(q, k, v, document_ids)
        else:
            if document_ids is not None:
                raise ValueError("document_ids are for training; a padded or cached batch masks by attn_mask")
            out = masked_attention(q, k, v, attn_mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
