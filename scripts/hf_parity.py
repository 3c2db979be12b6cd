"""The hf family against transformers itself: build a model the way a run does (on `meta`, then
`to_empty` and the run's sharding-invariant init), give transformers' own model the same weights,
and compare the loss and every gradient on the same tokens. Used by the tests and by
`scripts/hf_sweep.py` (here, beside it: it reaches into both the models and the engine, which
model code may not)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_tpu.distributed.sharded_init import init_weights
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.hf.args import HFArgs
from titan_tpu.models.hf.model import HFCausalLM

# The whole logits in one chunk: the comparison is of the model, not of the chunking.
_ONE_CHUNK = 2**26


def built_like_a_run(args: HFArgs, seq_len: int, seed: int = 0) -> HFCausalLM:
    """On meta, then to_empty and the run's init (titan_tpu/distributed/parallelize.py's order)."""
    args = dataclasses.replace(args, max_seq_len=seq_len)
    with torch.device("meta"):
        model = HFCausalLM(args)
    model.to_empty(device=torch.device("cpu"))
    init_weights(model, seed=seed, buffer_device=torch.device("cpu"))
    return model


def transformers_twin(model: HFCausalLM, attention: str | None = None) -> nn.Module:
    """transformers' own model of the same config, built as transformers builds it, with our weights
    (attention: the model's own implementation unless `attention` names another)."""
    twin = type(model.hf)._from_config(
        type(model.args.config).from_dict(model.args.config.to_dict()),
        attn_implementation=attention or model.hf.config._attn_implementation,
        dtype=torch.float32,
    )
    state = {name.removeprefix("hf."): tensor for name, tensor in model.state_dict().items()}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    tied = getattr(twin, "_tied_weights_keys", None) or {}
    if unexpected or any(name not in tied for name in missing):
        raise AssertionError(f"state dicts differ: missing {missing}, unexpected {unexpected}")
    return twin


def loss_and_grads(
    model: nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token loss over `tokens` [B, S+1] and each parameter's gradient (names without `hf.`)."""
    model.zero_grad(set_to_none=True)
    loss = cross_entropy_loss(logits_of(tokens[:, :-1]), tokens[:, 1:], _ONE_CHUNK)
    loss.backward()
    grads = {
        name.removeprefix("hf."): p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return loss.detach(), grads


@dataclass(frozen=True)
class Parity:
    loss_rel: float
    worst_grad: str  # the parameter whose gradient differs most, relative to its size
    worst_grad_rel: float
    missing_grads: tuple[str, ...]  # gradients one side has and the other not

    def within(self, loss_rel: float = 1e-5, grad_rel: float = 1e-4) -> bool:
        return not self.missing_grads and self.loss_rel <= loss_rel and self.worst_grad_rel <= grad_rel


def parity(
    ours: tuple[torch.Tensor, dict[str, torch.Tensor]], theirs: tuple[torch.Tensor, dict[str, torch.Tensor]]
) -> Parity:
    """How far two (loss, gradients) are: the loss's relative difference, and per tensor
    max |a - b| / max(max |b|, 1e-6)."""
    (loss, grads), (their_loss, their_grads) = ours, theirs
    loss_rel = abs(float(loss) - float(their_loss)) / max(abs(float(their_loss)), 1e-12)
    worst, worst_rel = "", 0.0
    for name in grads.keys() & their_grads.keys():
        a, b = grads[name].float(), their_grads[name].float()
        rel = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6) if a.numel() else 0.0
        if rel > worst_rel:
            worst, worst_rel = name, rel
    missing = tuple(sorted(grads.keys() ^ their_grads.keys()))
    return Parity(loss_rel, worst, worst_rel, missing)


def against_transformers(model: HFCausalLM, tokens: torch.Tensor) -> Parity:
    """Both in eval mode: dropout (GPT-2's, OPT's) would draw differently on each side; gradients
    flow the same."""
    model.eval()
    twin = transformers_twin(model).eval()
    ours = loss_and_grads(model, model, tokens)
    theirs = loss_and_grads(twin, lambda ids: twin(input_ids=ids).logits, tokens)
    return parity(ours, theirs)
