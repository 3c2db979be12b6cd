"""KV-cache generation gives what recomputing the whole sequence gives, for left-padded batches of
prompts of different lengths, on a Llama 3 and a Qwen 3 (QK-norm) debug model in float32."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from titan_tpu.models.common.decoder import DecoderLM
from titan_tpu.models.common.kv_cache import KVCache, LayerKVCache, padded_causal_mask
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7]]
NEW_TOKENS = 5
PAD_ID = 0


def _model(family: str) -> DecoderLM:
    torch.manual_seed(0)
    if family == "llama3":
        model: DecoderLM = Llama3Model(dataclasses.replace(LLAMA3_FLAVORS["debug"], n_layers=2, max_seq_len=64))
    else:
        model = Qwen3Model(dataclasses.replace(QWEN3_FLAVORS["debug"], n_layers=2, max_seq_len=64))
    model.init_weights()
    return model.eval()


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return tokens, mask


def _greedy_without_cache(model: DecoderLM, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: one unpadded row, the whole sequence recomputed for every new token."""
    sequence, step_logits = list(prompt), []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([sequence]))[0, -1]
        step_logits.append(logits)
        sequence.append(int(logits.argmax()))
    return sequence[len(prompt) :], step_logits


def _greedy_with_cache(
    model: DecoderLM, prompts: list[list[int]], position_error: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Batched: prefill the left-padded prompts, then decode one token per call. `position_error`
    shifts every decode step's start_pos (the negative control)."""
    tokens, mask = _left_padded(prompts)
    cache = KVCache(max_len=tokens.shape[1] + NEW_TOKENS)
    logits = model(tokens, cache=cache, start_pos=0, key_padding_mask=mask)[:, -1]
    step_logits, generated = [logits], [logits.argmax(-1)]
    for step in range(NEW_TOKENS - 1):
        start_pos = tokens.shape[1] + step + position_error
        logits = model(generated[-1][:, None], cache=cache, start_pos=start_pos)[:, -1]
        step_logits.append(logits)
        generated.append(logits.argmax(-1))
    return torch.stack(generated, dim=1), step_logits


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cached_greedy_decoding_matches_recomputing_the_full_sequence(family: str) -> None:
    # Catches: keys/values written to or read from the wrong slots, rotary positions not offset by
    # start_pos, padding attended to, or a prompt's logits changed by its left padding.
    model = _model(family)
    with torch.no_grad():
        generated, cached_logits = _greedy_with_cache(model, PROMPTS)
        for row, prompt in enumerate(PROMPTS):
            expected_tokens, expected_logits = _greedy_without_cache(model, prompt)
            assert generated[row].tolist() == expected_tokens
            for step, want in enumerate(expected_logits):
                torch.testing.assert_close(cached_logits[step][row], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_wrong_position_offset_gives_different_logits(family: str) -> None:
    # Negative control for the test above: decoding one slot early overwrites the last key and
    # rotates by the wrong angle, which the comparison must notice.
    model = _model(family)
    with torch.no_grad():
        _, good = _greedy_with_cache(model, PROMPTS)
        _, shifted = _greedy_with_cache(model, PROMPTS, position_error=-1)
    assert not torch.allclose(good[1], shifted[1], atol=1e-3)


def test_padded_batch_without_cache_matches_each_prompt_alone() -> None:
    # The no-cache forward with a key-padding mask (how a trainer scores left-padded rollouts) gives
    # each row's unpadded logits; without the mask the short rows attend to padding and differ.
    model = _model("qwen3")
    tokens, mask = _left_padded(PROMPTS)
    with torch.no_grad():
        masked = model(tokens, key_padding_mask=mask)
        unmasked = model(tokens)
        for row, prompt in enumerate(PROMPTS):
            alone = model(torch.tensor([prompt]))[0]
            torch.testing.assert_close(masked[row, -len(prompt) :], alone, atol=1e-5, rtol=1e-5)
        short = len(PROMPTS[1])
        assert not torch.allclose(unmasked[1, -short:], masked[1, -short:], atol=1e-3)


def test_padded_causal_mask_sees_real_keys_up_to_itself_and_always_itself() -> None:
    key_padding = torch.tensor([[False, False, True, True]])
    mask = padded_causal_mask(key_padding, start_pos=1)[0, 0]
    expected = torch.tensor(
        [
            [False, True, False, False],  # a padding query: only itself
            [False, False, True, False],
            [False, False, True, True],
        ]
    )
    assert torch.equal(mask, expected)


def test_transposed_keys_hold_what_the_plain_layout_holds() -> None:
    """A layer whose keys are moved to [B, H_kv, D, max_len] after its prefill keeps every key and
    value the plain layout would hold, through decode writes (`update_transposed` and the modules'
    `update`) and a dropped row, and a layer transposed before its first write allocates that way.
    Bugs caught: the keys copied untransposed or their slots along the wrong dimension, a decode
    write into the wrong slot, `keep_rows` leaving the transposed buffer alone; the negative control
    (a key written one slot early) shows a wrong slot is seen."""
    torch.manual_seed(0)
    batch, kv_heads, dim, max_len = 3, 2, 4, 9
    prefill_k, prefill_v = torch.randn(batch, kv_heads, 5, dim), torch.randn(batch, kv_heads, 5, dim)
    steps = [(torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim)) for _ in range(3)]
    plain, moved = LayerKVCache(max_len), LayerKVCache(max_len)
    plain.update(prefill_k, prefill_v, 0)
    moved.update(prefill_k, prefill_v, 0)
    moved.transpose_keys()
    moved.transpose_keys()  # idempotent
    assert moved.k is not None and moved.k.shape == (batch, kv_heads, dim, max_len)
    for slot, (k, v) in enumerate(steps, start=5):
        keys, values = plain.update(k, v, slot)
        if slot == 6:
            keys_t, got_values = moved.update_transposed(k, v, slot)
            got_keys = keys_t.transpose(2, 3)
        else:
            got_keys, got_values = moved.update(k, v, slot)
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    rows = torch.tensor([2, 0])
    plain.keep_rows(rows)
    moved.keep_rows(rows)
    assert plain.k is not None and moved.k is not None
    assert torch.equal(moved.k.transpose(2, 3), plain.k)
    fresh = LayerKVCache(max_len)
    fresh.transpose_keys()
    keys_t, _ = fresh.update_transposed(prefill_k, prefill_v, 0)
    assert torch.equal(keys_t.transpose(2, 3), prefill_k)
    early = LayerKVCache(max_len)
    early.transpose_keys()
    early.update_transposed(prefill_k, prefill_v, 0)
    keys_t, _ = early.update_transposed(steps[0][0], steps[0][1], 4)
    assert not torch.equal(keys_t.transpose(2, 3)[:, :, :5], prefill_k)
    with pytest.raises(ValueError, match="transpose_keys"):
        LayerKVCache(max_len).update_transposed(prefill_k, prefill_v, 0)


def test_cache_refuses_gaps_overflow_and_a_changed_batch() -> None:
    model = _model("llama3")
    cache = KVCache(max_len=8)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache, start_pos=0)
        with pytest.raises(ValueError, match="skips slots"):
            model(torch.tensor([[4]]), cache=cache, start_pos=4)
        with pytest.raises(ValueError, match="do not fit"):
            model(torch.tensor([[4] * 6]), cache=cache, start_pos=3)
        with pytest.raises(ValueError, match="holds 1 sequences"):
            model(torch.tensor([[4], [5]]), cache=cache, start_pos=3)
        with pytest.raises(ValueError, match="needs a KVCache"):
            model(torch.tensor([[4]]), start_pos=3)


def test_cached_decoding_runs_through_fsdp_wrapped_blocks(tmp_path: Path) -> None:
    # FSDP2's hooks must hand the cache, start position and mask through to each block, and gathering
    # and freeing the parameters around every decode step must not disturb the cache.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model("qwen3")
    with torch.no_grad():
        expected_tokens, expected_logits = _greedy_with_cache(model, PROMPTS)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():
            tokens, logits = _greedy_with_cache(model, PROMPTS)
    finally:
        dist.destroy_process_group()
    assert torch.equal(tokens, expected_tokens)
    for got, want in zip(logits, expected_logits):
        torch.testing.assert_close(got, want)
