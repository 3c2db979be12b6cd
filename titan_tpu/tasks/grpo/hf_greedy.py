"""Greedy answers of an exported Hugging Face folder from two decoders: our KV-cached sampler on our
model with the folder's weights, and transformers' own model and `generate`. The same weights must
give the same tokens in both; where they do not, the export renamed, transposed or dropped a weight,
or our model and theirs differ (positions, norms, the cache).

Our sampler decodes the prompts as one left-padded batch; transformers decodes each prompt alone, so
padding cannot hide a difference. Each answer runs through its stop token (included) or to
`max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.generation.sampler import generate
from titan_tpu.models.registry import get_model_spec
from titan_tpu.protocols.model_spec import Decoding
from titan_tpu.protocols.rollout import SamplingParams


def load_exported(folder: Path, model_name: str, flavor: str) -> tuple[nn.Module, Decoding]:
    """Our model of `model_name`/`flavor` with the folder's weights, in fp32, for evaluation, and how
    its family decodes."""
    spec = get_model_spec(model_name)
    if spec.capabilities.decoding is None:
        raise ValueError(f"model {model_name} does not decode with a KV cache")
    args = spec.flavor(flavor)
    model = spec.model_cls(args)
    load_hf_weights(model, folder, spec.state_dict_adapter, args)
    return model.float().eval(), spec.capabilities.decoding


@torch.no_grad()
def greedy_ours(
    model: nn.Module,
    decoding: Decoding,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
) -> list[list[int]]:
    params = SamplingParams(max_new_tokens, temperature=0.0, stop_ids=tuple(stop_ids))
    return generate(model, decoding, prompts, params, pad_id, torch.device("cpu")).lists()


@torch.no_grad()
def greedy_transformers(
    folder: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int], pad_id: int
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([list(prompt)]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
        )
        answers.append(out[0, len(prompt) :].tolist())
    return answers
