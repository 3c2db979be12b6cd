"""The hf family decoded by our sampler through transformers' own KV cache (titan_tpu/models/hf/decoding.py)
against transformers' `generate` on the same weights.

Bugs caught: padding attended to (rows whose prompt is shorter than the longest get other tokens), a cache that keeps rows the sampler dropped (the
rows after the first finished one get another row's keys), and a family whose state-space layers the
cache cannot hold accepted instead of refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts import hf_parity as parity
from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import load_config
from titan_tpu.generation import sampler
from titan_tpu.generation.sampler import generate
from titan_tpu.models.hf.decoding import HF_DECODING, HFDecodeCache, unsupported
from titan_tpu.models.registry import get_model_spec
from titan_tpu.protocols.rollout import SamplingParams

PROMPTS = [[5, 9, 23, 7, 11], [42, 8], [100, 3, 17], [64]]
NEW = 8


def mistral() -> torch.nn.Module:
    config = load_config(
        "llama3_debug", ["--model.name=hf", "--hf.architecture=MistralForCausalLM", "--model.flavor=debug"]
    )
    model = parity.built_like_a_run(get_model_spec("hf").args_for(config), 64, seed=3)
    weights = torch.Generator().manual_seed(3)  # the same model whatever ran before
    with torch.no_grad():  # clear margins, so greedy tokens depend on every earlier token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=weights)
    return model.eval()


def transformers_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy decoding of one prompt alone (no padding), and its tokens' log-probs
    from the raw logits. No eos: ours stops on the stop ids it is given only, and transformers would
    otherwise stop at the eos or (with min_new_tokens) mask it, choosing another token than ours."""
    model.hf.generation_config.eos_token_id = None
    out = model.hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logps = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.logits, tokens)])
    return tokens, logps


@torch.no_grad()
def test_our_sampler_decodes_an_hf_model_as_transformers_generate_does(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mistral()
    # Rows 4 and 5 repeat rows 1 and 2: they share their prefill (transformers' cache rows copied).
    prompts = [*PROMPTS, PROMPTS[1], PROMPTS[2]]
    expected = [transformers_greedy(model, p) for p in prompts]
    # A stop token that ends one row early: the rows after it are decoded from a compacted cache.
    stop = expected[1][0][2]
    monkeypatch.setattr(sampler, "STOP_CHECK_EVERY", 1)
    monkeypatch.setattr(sampler, "COMPACT_BELOW", 1.0)
    params = SamplingParams(NEW, temperature=0.0, stop_ids=(stop,))
    got = generate(model, HF_DECODING, prompts, params, 0, torch.device("cpu"))
    for row, (tokens, logps) in enumerate(expected):
        ours = got.lists()[row]
        end = tokens.index(stop) + 1 if stop in tokens else NEW
        assert ours == tokens[:end], (row, ours, tokens)
        torch.testing.assert_close(got.logp_lists()[row], logps[:end], rtol=0, atol=1e-4)

    # Negative control: the padding mask left out, left-padded rows attend to their padding and decode
    # other tokens. (Positions counted from the padding would not show: rotary attention depends on
    # the distance between positions, which a row's constant shift leaves alone.)
    def attending_to_padding(
        self: HFDecodeCache, tokens: torch.Tensor, start: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        return real(self, tokens, start, None)

    real = HFDecodeCache.extend
    monkeypatch.setattr(HFDecodeCache, "extend", attending_to_padding)
    unmasked = generate(model, HF_DECODING, prompts, params, 0, torch.device("cpu"))
    assert unmasked.lists()[0] == got.lists()[0]  # the longest prompt has no padding
    assert unmasked.lists()[1:] != got.lists()[1:]


def test_a_class_with_layers_the_cache_does_not_hold_is_refused() -> None:
    hybrid = SimpleNamespace(
        architecture="HybridForCausalLM", config=SimpleNamespace(layer_types=["full_attention", "mamba"])
    )
    plain = SimpleNamespace(architecture="MistralForCausalLM", config=SimpleNamespace(layer_types=None))
    assert unsupported(hybrid) == "HybridForCausalLM has mamba layers, which transformers' KV cache does not hold"
    assert unsupported(plain) is None


def test_grpo_trains_an_hf_model_with_the_builtin_sampler(tmp_path: Path) -> None:
    """GRPO on a transformers model (it was refused before its KV cache was wired): two steps, each
    with a rollout sampled through transformers' cache, and a held-out evaluation."""
    from titan_tpu.training.trainer import Trainer

    overrides = [
        "--model.name=hf",
        "--hf.architecture=MistralForCausalLM",
        "--model.flavor=debug",
        "--training.dtype=float32",
        "--training.steps=2",
        "--rl.prompts_per_step=4",
        "--rl.group_size=4",
        "--training.global_batch_size=16",
        "--metrics.log_freq=1",
        "--metrics.eval_freq=2",
        "--rl.eval_prompts=8",
        REWARDS,
        f"--job.dump_folder={tmp_path}",
    ]
    trainer = Trainer(load_config("grpo_qwen3_debug", overrides))
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["completion_length"] > 0
    assert "heldout_accuracy" in steps[1]
