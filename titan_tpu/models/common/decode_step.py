"""One cached decode step of a dense decoder with as few operations as its math allows.

A decode step feeds one token per row: every matmul has a handful of rows, so the step's time goes
as much to the number of operations as to their arithmetic (on a 2-core CPU, `qwen3_debug` at batch
128: about 60 operations per block through the modules' forwards). `FusedDecoder` snapshots a
model's weights once per rollout, with the projections that read the same input concatenated (q, k
and v; the feed-forward's gate and up) and Qwen 3's q and k norms side by side, and runs a step as
one straight function over them: the same arithmetic as the modules', in fewer, larger calls (bit
for bit eager; compiled, fp32 attention sums in another order: `decode_attention`, to about 1e-6).

It serves what it can prove it computes like the modules: a `DecoderLM` whose blocks are the
shared `TransformerBlock` (its `Attention`, a dense `FeedForward`, `RMSNorm`s, projections that are
plain nn.Linear, so no LoRA adapter), every weight a plain tensor (one process, or FSDP's gathered
parameters during a rollout); with every block compiled
whole (`compile.enable`), the step is compiled in one graph as they are. Anything else
(tensor-parallel DTensors, wrapped or partly compiled blocks, mixtures of experts, pipeline stages)
gets None and decodes through the modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from titan_tpu.models.common.attention import Attention
from titan_tpu.models.common.attention_kernels import decode_attention, masked_attention
from titan_tpu.models.common.decoder import DecoderLM
from titan_tpu.models.common.feed_forward import FeedForward
from titan_tpu.models.common.kv_cache import KVCache
from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.precision import autocast_dtype
from titan_tpu.models.common.transformer import TransformerBlock
from titan_tpu.protocols.model_spec import Decoding


@dataclass(frozen=True)
class _Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm's forward (norms.py): statistics in float32, scale in the input's dtype."""
        if x.dtype == self.weight.dtype == torch.float32 and self.weight.shape == x.shape[-1:]:
            # The same products in one call (F.rms_norm scales last).
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).type_as(x) * self.weight


@dataclass(frozen=True)
class _Block:
    name: str  # the block's key in the model's ModuleDict, which names its cache layer
    attention_norm: _Norm
    wqkv: torch.Tensor  # [(H + 2 H_kv) D, dim]: wq, wk, wv stacked
    qk_norm: _Norm | None  # weight [H + H_kv, D]: q_norm's on the query heads, k_norm's on the key heads
    n_heads: int
    n_kv_heads: int
    head_dim: int
    wo: torch.Tensor
    ffn_norm: _Norm
    w13: torch.Tensor  # [2 F, dim]: the gate w1, then the up projection w3
    w2: torch.Tensor


class FusedDecoder:
    """`step(tokens [B, 1], cache, start_pos)` gives what `model(tokens, cache=cache,
    start_pos=start_pos)[:, -1]` gives, logits [B, V], from weights taken when it was built."""

    def __init__(
        self,
        model: DecoderLM,
        blocks: list[_Block],
        compiler: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> None:
        assert model.tok_embeddings is not None and model.norm is not None
        self.embedding = model.tok_embeddings.weight
        self.rope = model.rope
        self.blocks = blocks
        self.norm = _Norm(model.norm.weight, model.norm.eps)
        self.output = self.embedding if model.output is None else model.output.weight
        # The whole step as one graph, compiled as the model's blocks are (their torch.compile
        # context: same backend and options). Dynamo keys its cache on the step's code, so the
        # decoders of later rollouts reuse the graphs (recompiled only for new shapes, dynamic after
        # the first: the cache length grows every step).
        self._compiled_step = None if compiler is None else compiler(self._step)

    @staticmethod
    def of(model: nn.Module) -> FusedDecoder | None:
        """The fused decoder of `model`'s current weights, or None when `model` is not a whole dense
        `DecoderLM` of plain tensors (see the module docstring)."""
        # A family that overrides the plain decoder's forward (MoE) computes something else.
        if not isinstance(model, DecoderLM) or type(model).forward is not DecoderLM.forward:
            return None
        decoder: DecoderLM = model
        if decoder.tok_embeddings is None or decoder.norm is None or type(decoder.norm) is not RMSNorm:
            return None
        if any(type(p) is not nn.Parameter and type(p) is not torch.Tensor for p in decoder.parameters()):
            return None  # DTensors (tensor parallelism, FSDP's shards outside a gathered rollout)
        layers = list(decoder.layers.items())
        # Blocks compiled whole (`compile.enable`): the fused step is compiled alike.
        compiled = [(name, layer) for name, layer in layers if isinstance(layer, OptimizedModule)]
        if compiled and len(compiled) != len(layers):
            return None
        compiler = None
        if compiled:
            compiler = compiled[0][1].dynamo_ctx
            layers = [(name, layer._orig_mod) for name, layer in compiled]
        found = [_fused_block(name, layer) for name, layer in layers]
        blocks = [block for block in found if block is not None]
        if len(blocks) != len(found):
            return None
        return FusedDecoder(decoder, blocks, compiler)

    @property
    def compiled(self) -> bool:
        """Whether `step` runs as one compiled graph (the model's blocks were compiled)."""
        return self._compiled_step is not None

    def step(self, tokens: torch.Tensor, cache: KVCache, start_pos: int) -> torch.Tensor:
        # SDPA turns a boolean mask into this additive one in every call; once per step here, and
        # outside the compiled graph: inside, the compiler fused the mask's construction into each
        # layer's softmax and rebuilt it there (2.8x that kernel's time, 2-core Xeon).
        visible = cache.advance(start_pos, tokens, None)  # [B, 1, 1, L]
        attn_mask = torch.zeros(visible.shape, dtype=self.embedding.dtype, device=visible.device)
        attn_mask.masked_fill_(~visible, float("-inf"))
        if self._matmul_attention():
            for block in self.blocks:
                cache.layer(block.name).transpose_keys()
        # This position's rotary rows (views): the graph then depends on no table of max_seq_len rows,
        # so models of another max_seq_len reuse it.
        cos, sin = self.rope(start_pos + 1)
        cos, sin = cos[start_pos], sin[start_pos]
        if self._compiled_step is not None:
            return self._compiled_step(tokens, attn_mask, cos, sin, cache, start_pos)
        return self._step(tokens, attn_mask, cos, sin, cache, start_pos)

    def _matmul_attention(self) -> bool:
        """Whether this step's attention is `decode_attention` over keys kept transposed: compiled, in
        float32 (with SDPA in the graph, compiling and 150 steps did not finish in 280 s on a 2-core
        Xeon). Eager, SDPA over the cache as the modules keep it, for logits bit for bit theirs (the
        matmuls were level with it there: 1.00x per rollout); in lower precision, compiled too, for
        SDPA's float32 sums."""
        if not self.compiled:
            return False
        return (autocast_dtype(self.embedding) or self.embedding.dtype) == torch.float32

    def _step(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        start_pos: int,
    ) -> torch.Tensor:
        x = F.embedding(tokens[:, 0], self.embedding)  # [B, dim]
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * (-sin_1, sin_2): one roll instead of chunk, neg, cat.
        signed_sin = torch.cat((-sin[:half], sin[half:]))
        for block in self.blocks:
            x = x + self._attention(block, block.attention_norm(x), cos, signed_sin, cache, start_pos, attn_mask)
            gate_up = F.linear(block.ffn_norm(x), block.w13)
            hidden = block.w13.shape[0] // 2
            x = x + F.linear(F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:], block.w2)
        return F.linear(self.norm(x), self.output)

    @staticmethod
    def _attention(
        block: _Block,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        cache: KVCache,
        start_pos: int,
        attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        batch, heads, kv_heads, dim = x.shape[0], block.n_heads, block.n_kv_heads, block.head_dim
        qkv = F.linear(x, block.wqkv)
        qk = qkv[:, : (heads + kv_heads) * dim].view(batch, heads + kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, 1, dim)
        if block.qk_norm is not None:
            qk = block.qk_norm(qk)
        # apply_rotary_emb (rope.py) in fp32 on q and k together.
        qk32 = qk.float()
        qk = (qk32 * cos.float() + qk32.roll(dim // 2, dims=-1) * signed_sin.float()).type_as(qk)
        q, k = qk[:, :heads], qk[:, heads:].view(batch, kv_heads, 1, dim)
        layer = cache.layer(block.name)
        if layer.keys_transposed:
            keys_t, values = layer.update_transposed(k, v, start_pos)
            out = decode_attention(q, keys_t, values, attn_mask)
        else:
            keys, values = layer.update(k, v, start_pos)
            out = masked_attention(q.reshape(batch, heads, 1, dim), keys, values, attn_mask)
        return F.linear(out.reshape(batch, heads * dim), block.wo)


def _fused_block(name: str, layer: nn.Module) -> _Block | None:
    if type(layer) is not TransformerBlock:
        return None
    attention, ffn = layer.attention, layer.feed_forward
    if type(attention) is not Attention or type(ffn) is not FeedForward:
        return None
    if type(layer.attention_norm) is not RMSNorm or type(layer.ffn_norm) is not RMSNorm:
        return None
    projections = (attention.wq, attention.wk, attention.wv, attention.wo, ffn.w1, ffn.w2, ffn.w3)
    if any(type(linear) is not nn.Linear for linear in projections):
        return None  # a LoRA adapter's output is more than its weight's: decoded through the modules
    qk_norm = None
    if (attention.q_norm is None) != (attention.k_norm is None):
        return None
    if attention.q_norm is not None and attention.k_norm is not None:
        if type(attention.q_norm) is not RMSNorm or type(attention.k_norm) is not RMSNorm:
            return None
        if attention.k_norm.eps != attention.q_norm.eps:
            return None
        weight = torch.cat(
            (
                attention.q_norm.weight.expand(attention.n_heads, -1),
                attention.k_norm.weight.expand(attention.n_kv_heads, -1),
            )
        )
        qk_norm = _Norm(weight, attention.q_norm.eps)
    return _Block(
        name=name,
        attention_norm=_Norm(layer.attention_norm.weight, layer.attention_norm.eps),
        wqkv=torch.cat((attention.wq.weight, attention.wk.weight, attention.wv.weight)),
        qk_norm=qk_norm,
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim,
        wo=attention.wo.weight,
        ffn_norm=_Norm(layer.ffn_norm.weight, layer.ffn_norm.eps),
        w13=torch.cat((ffn.w1.weight, ffn.w3.weight)),
        w2=ffn.w2.weight,
    )


# How the decoder families decode (`Capabilities.decoding`): our KV cache, filled by the modules'
# forward, and the fused step where the model allows one.
DECODER_DECODING = Decoding(new_cache=KVCache, fused_step=FusedDecoder.of)
