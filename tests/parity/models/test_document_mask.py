"""Packed documents with document masking compute what each document computes alone in transformers.

One batch of two rows, each packing documents of uneven lengths (a row may start mid-way through
nothing: every row begins a document), through our Llama 3 with `document_ids`; each document alone
through transformers' LlamaForCausalLM with the same weights and the same labels. The loss and every
parameter's gradient agree in float32 to 1e-5, for SDPA (explicit mask) and the blocked kernel with
blocks smaller than the documents (the skipped keys and the per-block mask both matter). Negative
control: the same packed batch without document_ids (attention across documents) does not agree.
Bugs caught: a mask leaking across documents (checked by patching the blocked kernel's mask away), a
blocked kernel skipping keys a row may see, gradients of the skipped keys not zero-filled. Positions
restarting cannot show here: rotary attention depends only on the offset between query and key, so
shifting a whole document's positions changes nothing once attention stays inside it; the positions
themselves are checked directly (the last test).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.parity.models.test_llama3 import _args, _hf_config, _randomize, hf_to_titan
from titan_tpu.models.common.attention_kernels import attention_kernel
from titan_tpu.models.common.documents import document_causal_mask, document_positions
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER

# Document lengths per row; each row holds 48 tokens.
ROWS = [[5, 17, 3, 23], [30, 1, 17]]
SEQ = 48
TOLERANCE = 1e-5


def _documents() -> torch.Tensor:
    ids = [[d for d, length in enumerate(row) for _ in range(length)] for row in ROWS]
    return torch.tensor(ids)


def _models(kernel: str) -> tuple[Llama3Model, LlamaForCausalLM]:
    torch.manual_seed(0)
    args = dataclasses.replace(_args(False), attention=attention_kernel(kernel))
    hf = LlamaForCausalLM(_hf_config(args)).float()
    _randomize(hf)
    ours = Llama3Model(args)
    ours.load_state_dict(hf_to_titan(hf.state_dict(), ours), strict=False)
    ours.rope.reset_buffers(torch.device("cpu"))
    return ours, hf


def _losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _hf_alone(hf: LlamaForCausalLM, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed loss of every document run alone, each with its own positions from 0."""
    total = torch.zeros(())
    for row, lengths in enumerate(ROWS):
        start = 0
        for length in lengths:
            piece = slice(start, start + length)
            logits = hf(tokens[row : row + 1, piece]).logits
            total = total + _losses(logits, labels[row : row + 1, piece])
            start += length
    return total / labels.numel()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kernel", ["sdpa", "blocked:8"])
def test_packed_documents_match_each_document_alone(kernel: str) -> None:
    ours, hf = _models(kernel)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ours.args.vocab_size, (len(ROWS), SEQ), generator=generator)
    labels = torch.randint(0, ours.args.vocab_size, (len(ROWS), SEQ), generator=generator)

    want = _hf_alone(hf, tokens, labels)
    want.backward()
    hf_grads = {name: g for name, g in _grads(hf).items()}
    got = _losses(ours(tokens, document_ids=_documents()), labels) / labels.numel()
    got.backward()
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    for name, grad in _grads(ours).items():
        torch.testing.assert_close(
            grad, hf_grads[LLAMA3_STATE_DICT_ADAPTER.hf_name(name)], rtol=TOLERANCE, atol=TOLERANCE, msg=name
        )

    # Negative control: packed without the mask, documents see each other and positions run on.
    unmasked = _losses(ours(tokens), labels) / labels.numel()
    assert abs(float(unmasked) - float(want)) > 1e-3


def test_blocked_and_sdpa_agree_with_documents_in_bf16() -> None:
    """The blocked kernel's key skipping and mask against SDPA's explicit mask, both directions."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, SEQ, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, SEQ, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 4, SEQ, 16, dtype=torch.bfloat16)
    results = []
    for name in ("sdpa", "blocked:8", "blocked:64"):
        out = attention_kernel(name)(q, k, v, _documents())
        results.append([out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), grad))])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_positions_restart_and_the_mask_is_block_diagonal_causal() -> None:
    documents = torch.tensor([[0, 0, 0, 1, 1, 7, 7, 7], [3, 3, 3, 3, 3, 3, 3, 3]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]
    mask = document_causal_mask(documents)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask.sum() == 6 + 3 + 6
    # Equal ids that are not adjacent are two documents.
    assert not document_causal_mask(torch.tensor([[0, 1, 0]]))[0, 0, 2, 0]
