"""The loss mask of multi-turn episodes: gradients reach only the tokens the model sampled.

Rows are built as GRPO builds them (`build_micro_batches` with each episode's `trained` flags) from a
prompt, a model turn, the environment's answer (a tool result, with the template around it) and a
second model turn, and trained with the real objective through a Qwen 3 debug model in fp32. The
logits that predict the environment's tokens are then perturbed (a hook on the output head): the
loss and every parameter's gradient must not change. The negative control trains the same rows with
the environment's tokens in the mask: the same perturbation then moves the gradients.
"""

from __future__ import annotations

import dataclasses

import torch

from titan_tpu.generation.logprobs import logps_of
from titan_tpu.models.registry import get_model_spec
from titan_tpu.tasks.grpo.objective import grpo_loss
from titan_tpu.tasks.grpo.rollout import MicroBatch, build_micro_batches

PROMPT = [1, 5, 9, 13, 17]
# model turn (3 tokens) | tool result and template (4) | model turn (2)
COMPLETION = [30, 31, 32, 40, 41, 42, 43, 50, 51]
TRAINED = [True] * 3 + [False] * 4 + [True] * 2


def batch(trained: list[bool]) -> MicroBatch:
    completions = {0: COMPLETION, 1: COMPLETION[:3] + [44, 45, 46, 47] + [52, 53]}
    [micro] = build_micro_batches(
        [[0, 1]],
        {0: PROMPT, 1: PROMPT},
        completions,
        advantages=torch.tensor([1.0, -0.5]),
        completion_lengths=torch.tensor([float(sum(trained))] * 2),
        global_batch=2,
        micro_batch=2,
        dp_world=1,
        pad_id=0,
        device=torch.device("cpu"),
        sampled_logps={r: torch.full((len(COMPLETION),), -2.0) for r in (0, 1)},
        reference_logps=None,
        first_on_policy=False,
        trained={0: trained, 1: trained},
    )
    return micro


def gradients(micro: MicroBatch, perturb: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    spec = get_model_spec("qwen3")
    args = dataclasses.replace(spec.flavor("debug"), n_layers=1)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    if perturb:
        # Noise on the logits at the positions whose next token the environment wrote.
        environment = torch.zeros_like(micro.tokens, dtype=torch.bool)
        environment[:, len(PROMPT) - 1 : len(PROMPT) - 1 + len(TRAINED)] = ~torch.tensor(TRAINED)
        noise = torch.randn(*micro.tokens.shape, args.vocab_size, generator=torch.Generator().manual_seed(1))

        def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
            return output + 5 * noise * environment[..., None]

        model.output.register_forward_hook(hook)
    logps = logps_of(model(micro.tokens), micro.tokens)
    assert micro.old_logps is not None
    terms = grpo_loss(
        logps,
        micro.old_logps,
        micro.advantages,
        micro.mask,
        eps_low=0.2,
        eps_high=0.28,
        aggregation="token_mean",
        max_completion_tokens=8,
        token_normaliser=micro.token_normaliser,
    )
    terms.loss.backward()
    return terms.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_mask_covers_the_model_turns_only() -> None:
    """Catches a mask from the prompt's end to the row's end (single-turn's), which would train the tool
    result: position t of the mask is the prediction of token t + 1."""
    micro = batch(TRAINED)
    start = len(PROMPT) - 1
    assert micro.mask[0, start : start + len(TRAINED)].tolist() == [float(t) for t in TRAINED]
    assert micro.mask[0, :start].sum() == 0 and micro.mask[0, start + len(TRAINED) :].sum() == 0


def test_perturbing_the_environment_tokens_changes_no_gradient() -> None:
    masked = batch(TRAINED)
    loss, grads = gradients(masked, perturb=False)
    perturbed_loss, perturbed = gradients(masked, perturb=True)
    assert loss != 0 and any(g.abs().sum() > 0 for g in grads.values())
    assert torch.equal(loss, perturbed_loss)
    assert all(torch.equal(grads[name], perturbed[name]) for name in grads)
    # Negative control: with the environment's tokens in the mask the same perturbation reaches the gradients.
    everything = batch([True] * len(TRAINED))
    _, leaky = gradients(everything, perturb=False)
    _, leaky_perturbed = gradients(everything, perturb=True)
    assert max((leaky[n] - leaky_perturbed[n]).abs().max() for n in leaky) > 1e-4
