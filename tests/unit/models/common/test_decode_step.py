"""The fused decode step (titan_tpu/models/common/decode_step.py) computes, bit for bit, what the modules'
cached forward computes, and declines the models it cannot prove that for; the single-query
attention that shares each kv head's cache among its query heads equals per-head attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_tpu.models.common.attention_kernels import decode_attention, masked_attention
from titan_tpu.models.common.decode_step import FusedDecoder
from titan_tpu.models.common.decoder import DecoderLM
from titan_tpu.models.common.kv_cache import KVCache
from titan_tpu.models.common.transformer import TransformerBlock
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model, Qwen3MoeModel

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7]]
STEPS = 4


def _model(family: str) -> DecoderLM:
    """Every parameter random (norm scales included), so a norm weight on the wrong heads or a
    projection in the wrong place changes the logits."""
    torch.manual_seed(0)
    if family == "qwen3_bf16":
        return _model("qwen3").to(torch.bfloat16)
    if family == "llama3":
        model: DecoderLM = Llama3Model(dataclasses.replace(LLAMA3_FLAVORS["debug"], n_layers=2, max_seq_len=64))
    else:
        tied = family == "qwen3_tied"
        model = Qwen3Model(dataclasses.replace(QWEN3_FLAVORS["debug"], n_layers=2, max_seq_len=64, tie_embeddings=tied))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    return model.eval()


@torch.no_grad()
def _decode(model: DecoderLM, fused: FusedDecoder | None) -> list[torch.Tensor]:
    """Prefill the left-padded PROMPTS through the modules, then STEPS greedy decode steps through
    `fused` (the modules when None); each step's logits [B, V]."""
    width = max(len(p) for p in PROMPTS)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    real = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in PROMPTS])
    cache = KVCache(width + STEPS)
    logits = model(tokens, cache=cache, start_pos=0, key_padding_mask=real)[:, -1]
    steps = []
    for t in range(STEPS):
        next_tokens = logits.argmax(-1)[:, None]
        if fused is None:
            logits = model(next_tokens, cache=cache, start_pos=width + t)[:, -1]
        else:
            logits = fused.step(next_tokens, cache, width + t)
        steps.append(logits)
    return steps


@pytest.mark.parametrize("family", ["qwen3", "qwen3_tied", "llama3", "qwen3_bf16"])
def test_the_fused_step_gives_the_modules_logits_bit_for_bit(family: str) -> None:
    """In fp32 and in bf16 (where the norms and the rotation upcast). Bugs caught: q, k, v or gate
    and up concatenated in another order than the split reads them, q_norm's and k_norm's scales on
    the wrong heads, the rotation at the wrong position or with the wrong sign, the cache written at
    the wrong slot, the tied head read from the wrong weight."""
    model = _model(family)
    fused = FusedDecoder.of(model)
    assert fused is not None
    expected = _decode(model, None)
    got = _decode(model, fused)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    # Negative control: the gate and up halves swapped (silu(up) * gate) give other logits.
    swapped = [
        dataclasses.replace(b, w13=torch.cat((b.w13[b.w13.shape[0] // 2 :], b.w13[: b.w13.shape[0] // 2])))
        for b in fused.blocks
    ]
    wrong = _decode(model, FusedDecoder(model, swapped))
    assert (wrong[0] - expected[0]).abs().max() > 1e-2


def test_models_the_fused_step_does_not_cover_decode_through_their_modules() -> None:
    """A model whose forward is not the plain decoder's (MoE), a block that is not the shared one
    (compiled, wrapped or a subclass), or a pipeline stage without the embedding gets None: the
    sampler then runs the model's own forward. Bug caught: a fused step that silently computes a
    dense block's math for a model that computes something else."""
    torch.manual_seed(0)
    moe = Qwen3MoeModel(dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], n_layers=2, max_seq_len=64))
    assert FusedDecoder.of(moe) is None

    class OtherBlock(TransformerBlock):
        pass

    model = _model("qwen3")
    assert FusedDecoder.of(model) is not None
    block: TransformerBlock = model.layers["1"]  # type: ignore[assignment]
    model.layers["1"] = OtherBlock(block.attention, block.feed_forward, 256, 1e-6, 0.02)
    assert FusedDecoder.of(model) is None
    stage = _model("qwen3")
    stage.tok_embeddings = None
    assert FusedDecoder.of(stage) is None


def test_a_decode_query_shares_each_kv_heads_cache_with_its_query_heads() -> None:
    """masked_attention of one query per row (a decode step) against attention with every kv head
    repeated for its query heads (query head h reads kv head h // (H / H_kv)), under a per-row
    padding mask. Bug caught: query heads grouped onto the wrong kv head (h % H_kv, the interleaved
    order), which the negative control shows is a different result."""
    torch.manual_seed(0)
    batch, heads, kv_heads, slots, dim = 3, 8, 2, 11, 16
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv_heads, slots, dim), torch.randn(batch, kv_heads, slots, dim)
    mask = torch.ones(batch, 1, 1, slots, dtype=torch.bool)
    mask[0, ..., :4] = False
    mask[2, ..., :7] = False
    got = masked_attention(q, k, v, mask)
    group = heads // kv_heads
    repeated = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    expected = F.scaled_dot_product_attention(q, *repeated, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    interleaved = F.scaled_dot_product_attention(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), attn_mask=mask)
    assert (interleaved - expected).abs().max() > 1e-2


def test_decode_attention_equals_sdpa_over_the_cache() -> None:
    """decode_attention (batched matmuls over the keys stored transposed, an additive mask) against
    masked_attention (SDPA over the keys as the modules store them, its grouping checked above) on a
    padded batch, the keys read as a cache's slice is. Bugs caught: the scale left out or applied
    twice, query heads grouped onto the wrong kv head, the mask ignored or broadcast over the wrong
    dimension, keys read untransposed; the negative controls (the padding visible, scores scaled
    twice as much) show such results are told apart at this tolerance."""
    torch.manual_seed(0)
    batch, heads, kv_heads, slots, dim = 5, 8, 2, 23, 32
    q = torch.randn(batch, heads, dim)
    k, v = torch.randn(batch, kv_heads, slots, dim), torch.randn(batch, kv_heads, slots, dim)
    visible = torch.ones(batch, 1, 1, slots, dtype=torch.bool)
    visible[0, ..., :4] = False
    visible[3, ..., :9] = False
    additive = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    expected = masked_attention(q[:, :, None], k, v, visible)[:, :, 0]
    # As a transposed cache holds them: the first `slots` of a longer buffer [B, H_kv, D, max_len].
    buffer = torch.zeros(batch, kv_heads, dim, slots + 7)
    buffer[..., :slots] = k.transpose(2, 3)
    keys_t = buffer[..., :slots]
    torch.testing.assert_close(decode_attention(q, keys_t, v, additive), expected, rtol=1e-5, atol=1e-6)
    unmasked = decode_attention(q, keys_t, v, torch.zeros_like(additive))
    assert (unmasked - expected).abs().max() > 1e-2
    # A scale of 2/sqrt(D) (or none) on the scores.
    assert (decode_attention(q * 2, keys_t, v, additive) - expected).abs().max() > 1e-2


def test_compiled_blocks_give_a_fused_step_compiled_in_one_graph() -> None:
    """Blocks compiled whole (compile.enable) give a fused decoder whose step runs through their
    torch.compile context (here the "eager" backend, which traces as inductor would without its
    code generation) and matches the modules; a model with only some blocks compiled gets None.
    Bugs caught: the compiled path falling back to the modules (a fused step that cannot be traced
    in one graph fails here under the blocks' fullgraph=True), weights read from the wrapper instead
    of the block it compiles, a later rollout's decoder run with an earlier one's weights, a
    half-compiled model fused as if plain."""
    torch._dynamo.reset()
    model = _model("qwen3")
    expected = _decode(model, None)
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, backend="eager", fullgraph=True)
    fused = FusedDecoder.of(model)
    assert fused is not None and fused.compiled
    for g, e in zip(_decode(model, fused), expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # The next rollout's decoder, after an optimizer step, reuses the graph with the new weights
    # (a graph that kept the first decoder's weights as constants would give the old logits).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    moved = _decode(model, None)
    assert (moved[0] - expected[0]).abs().max() > 1e-2
    for g, e in zip(_decode(model, FusedDecoder.of(model)), moved):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-4)  # logits grown with the weights
    model.layers["1"] = model.layers["1"]._orig_mod
    assert FusedDecoder.of(model) is None


def test_only_the_compiled_float32_step_transposes_the_cached_keys() -> None:
    """The compiled step in float32 attends with `decode_attention` over keys it moves to [D, L];
    eager, and compiled under bf16 autocast, it keeps the modules' layout for SDPA. Bugs caught: the
    compiled float32 step left on the slow layout (its products then read the keys transposed), an
    eager step that would lose its bit-for-bit logits, a bf16 step handed to the float32 matmuls;
    the autocast case checks the decision reads autocast's dtype, not the weights'."""
    torch._dynamo.reset()
    model = _model("qwen3")
    tokens = torch.tensor([[5, 17, 99], [7, 8, 9]])

    def transposed_after_a_step(fused: FusedDecoder) -> bool:
        cache = KVCache(6)
        model(tokens, cache=cache, start_pos=0)
        fused.step(tokens[:, -1:], cache, 3)
        return all(layer.keys_transposed for layer in cache.layers.values())

    with torch.no_grad():
        eager = FusedDecoder.of(model)
        assert eager is not None and not transposed_after_a_step(eager)
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block, backend="eager", fullgraph=True)
        compiled = FusedDecoder.of(model)
        assert compiled is not None and compiled.compiled and transposed_after_a_step(compiled)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not transposed_after_a_step(compiled)
