"""Qwen 3 MoE cut into pipeline stages, chained by hand on one process (no schedule, no processes):
the stages pass the router totals on with the hidden states, so the last stage's loss, with the
load-balancing term over every layer, and every parameter's gradient equal the whole model's. The
multi-process run through the schedule (PP 2 x EP 2) is tests/distributed/test_pipeline_parallel.py.

The bug this catches: a stage that forms the aux loss from its own layers only, or whose routers
never receive the aux gradient of the later stages' loss (the negative control drops the
gradient of the totals at a stage boundary and must fail the comparison)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.model import MoEOutput, Qwen3MoeModel, moe_loss

# A large coefficient so the aux term's gradient is not lost under the cross-entropy's.
ARGS = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], n_layers=4, router_aux_loss_coef=0.5)
STAGE_LAYERS = [(0,), (1, 2), (3,)]


def materialized() -> Qwen3MoeModel:
    with torch.device("meta"):
        model = Qwen3MoeModel(ARGS)
    model.to_empty(device=torch.device("cpu"))
    torch.manual_seed(0)
    model.init_weights()
    return model


def cut(model: Qwen3MoeModel) -> list[Qwen3MoeModel]:
    """The stages of STAGE_LAYERS, sharing nothing with `model` but holding its weights."""
    stages = []
    for index, layers in enumerate(STAGE_LAYERS):
        stage = copy.deepcopy(model)
        stage.keep_pipeline_stage(layers, first=index == 0, last=index == len(STAGE_LAYERS) - 1)
        stages.append(stage)
    return stages


def chained_loss_and_backward(
    stages: list[Qwen3MoeModel], tokens: torch.Tensor, labels: torch.Tensor, drop_totals_grad: bool = False
) -> torch.Tensor:
    """Forward stage by stage on detached copies of the previous stage's outputs (as a schedule
    receives them), then backward from the last stage to the first with the received gradients."""
    inputs: tuple[torch.Tensor, ...] = (tokens,)
    boundaries = []
    output = None
    for stage in stages:
        output = stage(*inputs)
        if len(output) == len(MoEOutput._fields):  # the last stage: MoEOutput's fields, a plain tuple
            break
        received = tuple(t.detach().requires_grad_() for t in output)
        boundaries.append((output, received))
        inputs = received
    assert output is not None and float(output[2]) == ARGS.router_aux_loss_coef
    loss = moe_loss(output, labels)
    loss.backward()
    for sent, received in reversed(boundaries):
        grads = [t.grad for t in received]
        if drop_totals_grad:
            grads[1] = torch.zeros_like(grads[1])
        torch.autograd.backward(sent, grads)
    return loss.detach()


def gradients(modules: list[Qwen3MoeModel]) -> dict[str, torch.Tensor]:
    return {n: p.grad for m in modules for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("drop_totals_grad", [False, True], ids=["chained", "totals_gradient_dropped"])
def test_stages_chained_equal_the_whole_model(drop_totals_grad: bool) -> None:
    model = materialized()
    stages = cut(model)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    expected_loss = moe_loss(model(tokens[:, :-1]), tokens[:, 1:])
    expected_loss.backward()
    loss = chained_loss_and_backward(stages, tokens[:, :-1], tokens[:, 1:], drop_totals_grad)
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-6, atol=0)
    expected, actual = gradients([model]), gradients(stages)
    assert expected.keys() == actual.keys()
    router = "layers.0.feed_forward.router.gate.weight"
    differences = {n: float((actual[n] - g).abs().max() / g.abs().max()) for n, g in expected.items()}
    print(f"\nmax relative gradient difference: {max(differences.values()):.1e}; {router}: {differences[router]:.1e}")
    if drop_totals_grad:
        # The first stage's routers lose the aux gradient of the loss formed on the last stage.
        assert differences[router] > 1e-3
    else:
        assert max(differences.values()) < 1e-5, differences
