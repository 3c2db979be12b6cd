"""Our attention kernels inside transformers' models (titan_tpu/models/hf/attention.py): registered with
transformers' attention registry, run where a call is plain causal attention, and transformers'
SDPA with the mask it built everywhere else (the mask function registered with ours: without it
transformers drops the causal mask silently)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from scripts import hf_parity as parity
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.common.attention_kernels import BlockedAttention, attention_kernel
from titan_tpu.models.hf import attention as hf_attention
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.registry import get_model_spec

SEQ = 24


def mistral(kernel: str, *overrides: str) -> HFCausalLM:
    """A debug Mistral built as a run builds it, attending through `kernel`."""
    config = load_config(
        "llama3_debug", ["--model.name=hf", "--hf.architecture=MistralForCausalLM", "--model.flavor=debug", *overrides]
    )
    args = dataclasses.replace(get_model_spec("hf").args_for(config), attention=attention_kernel(kernel))
    return parity.built_like_a_run(args, SEQ)


def against_sdpa(model: HFCausalLM) -> parity.Parity:
    """Loss and every gradient against transformers' own SDPA model with the same weights."""
    tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    twin = parity.transformers_twin(model, attention="sdpa")
    ours = parity.loss_and_grads(model, model, tokens)
    theirs = parity.loss_and_grads(twin, lambda ids: twin(input_ids=ids).logits, tokens)
    return parity.parity(ours, theirs)


def test_our_blocked_kernel_runs_in_the_model_and_computes_what_sdpa_does() -> None:
    """Catches the kernel registered but never called (the model built with SDPA), its output handed
    back in [B, H, S, D] instead of transformers' [B, S, H, D], or a scale or grouping it gets wrong."""
    with mock.patch.object(BlockedAttention, "__call__", autospec=True, side_effect=BlockedAttention.__call__) as call:
        model = mistral("blocked:8")
        assert model.hf.config._attn_implementation == "titan_tpu_blocked_8"
        result = against_sdpa(model)
    assert call.call_count == model.n_blocks  # each layer once, in the one forward of the comparison
    assert result.within(loss_rel=1e-5, grad_rel=1e-4), result


def test_a_sliding_window_goes_to_sdpa_with_its_mask() -> None:
    """Mistral with a window of 8 over 24 tokens: the mask transformers builds for our name is
    SDPA's (a tensor here), so the call goes to SDPA with it. The negative control registers our
    function without the mask function: the window is silently dropped and the gradients differ."""
    window = ("--model.overrides={ sliding_window = 8 }",)
    assert against_sdpa(mistral("blocked:16", *window)).within(loss_rel=1e-5, grad_rel=1e-4)
    from transformers import AttentionMaskInterface

    with mock.patch.object(AttentionMaskInterface, "register"):  # our mask function never registered
        dropped = against_sdpa(mistral("blocked:4", *window))
    assert not dropped.within(loss_rel=1e-5, grad_rel=1e-4), dropped


def test_attention_block_refused_for_a_class_without_the_registry() -> None:
    """Bloom's attention (ALiBi) is its own code, not a registry call: a block size is refused at start."""
    with pytest.raises(ConfigError, match=r"model.attention_block: BloomForCausalLM does not take its attention"):
        get_model_spec("hf").args_for(
            load_config(
                "llama3_debug",
                [
                    "--model.name=hf",
                    "--hf.architecture=BloomForCausalLM",
                    "--model.flavor=debug",
                    "--model.attention_block=64",
                ],
            )
        )


def test_auto_is_measured_only_where_the_class_takes_our_kernels() -> None:
    from titan_tpu.models.hf.spec import HF_ATTENTION

    def args(architecture: str) -> object:
        config = load_config(
            "llama3_debug", ["--model.name=hf", f"--hf.architecture={architecture}", "--model.flavor=debug"]
        )
        return dataclasses.replace(get_model_spec("hf").args_for(config), attention=attention_kernel("auto"))

    assert HF_ATTENTION.is_auto(args("MistralForCausalLM"))
    assert not HF_ATTENTION.is_auto(args("BloomForCausalLM"))
    assert hf_attention.takes_registered_attention(args("MistralForCausalLM"))  # type: ignore[arg-type]
