"""Batched sampling from a decoder with the KV cache: prefill the left-padded prompts once (a prompt
asked for several times once, its cache rows then copied), then one token per forward pass, with
temperature, top-p, a token budget and stop tokens.

Randomness is per row: each completion owns a vector of uniform numbers (one per generated position)
drawn from its own seeded generator, and the token is picked by inverse CDF over the (top-p filtered)
distribution. The tokens of a completion therefore do not depend on which other rows share its batch,
so one process and several data-parallel processes sample the same completions for the same prompts.

Under FSDP every forward would all-gather every block's parameters, once per generated token.
`gathered_for_generation` gathers them once for the whole rollout and frees them afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_tpu.generation.logprobs import logits_of
from titan_tpu.protocols.model_spec import Decoding
from titan_tpu.protocols.rollout import SamplingParams


@dataclass
class Completions:
    """tokens [B, T] (padding after a row's stop token is `pad_id`); mask [B, T] is True on generated
    tokens up to and including the stop token; stopped [B] says whether a row stopped by itself;
    logps [B, T] (float32, 0 off the mask): each generated token's log-probability under the model's
    own distribution, before temperature and top-p, the quantity a training forward's log-softmax
    gives (GRPO's old log-probabilities)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    stopped: torch.Tensor
    logps: torch.Tensor

    def lists(self) -> list[list[int]]:
        return [row[m].tolist() for row, m in zip(self.tokens, self.mask)]

    def logp_lists(self) -> list[torch.Tensor]:
        """Each row's log-probabilities of its completion tokens (the ones `lists` gives), on the host."""
        return [row[m].cpu() for row, m in zip(self.logps, self.mask)]


def row_uniforms(seeds: Sequence[int], length: int) -> torch.Tensor:
    """[len(seeds), length] uniform numbers in [0, 1), row i from its own generator seeded by seeds[i]."""
    rows = [torch.rand(length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) for seed in seeds]
    return torch.stack(rows) if rows else torch.empty(0, length, dtype=torch.float64)


def pick_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax at temperature 0, else inverse-CDF sampling with
    `uniforms` [B] from the top-p nucleus (the smallest set of likeliest tokens whose mass reaches top_p)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    if uniforms is None:
        raise ValueError("sampling at temperature > 0 needs one uniform number per row")
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p == 1:
        # The whole distribution: inverse CDF in vocabulary order, no sort (7% of a rollout's time).
        cdf = probs.cumsum(dim=-1)
        order = None
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = torch.where(mass_before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
        cdf = sorted_probs.cumsum(dim=-1)
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    return (index if order is None else order.gather(-1, index)).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> tokens [B, P] left-padded to the longest and the mask of real tokens [B, P]."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        tokens[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        real[i, width - len(prompt) :] = True
    return tokens.to(device), real.to(device)


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[Sequence[int]], list[int]]:
    """The distinct prompts in order of first appearance, and for each prompt its index among them."""
    index: dict[tuple[int, ...], int] = {}
    copies = [index.setdefault(tuple(prompt), len(index)) for prompt in prompts]
    distinct: list[Sequence[int]] = [()] * len(index)
    for prompt, k in zip(prompts, copies):
        distinct[k] = prompt
    return distinct, copies


# The decode batch is compacted once the rows still running are at most this share of it.
COMPACT_BELOW = 0.75
# Decode steps between two looks at which rows have stopped. Each look reads device memory on the
# host (whether all have stopped, which rows still run), which on an accelerator waits for the queue
# to drain: every token would stall it. Rows that stop in between decode padding until the next look.
STOP_CHECK_EVERY = 8


@torch.no_grad()
def generate(
    model: nn.Module,
    decoding: Decoding,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    pad_id: int,
    device: torch.device,
    uniforms: torch.Tensor | None = None,
    lockstep: dist.ProcessGroup | None = None,
) -> Completions:
    """Complete every prompt with the KV cache the model's family decodes with (`decoding`: its cache
    and, where the model allows, its fused step), stopping early once every row has stopped.

        `uniforms` [B, max_new_tokens]: the per-row random numbers (see `row_uniforms`); unused at
        temperature 0. Without `lockstep` the early stop is this process's own decision, so its forward
        may run only collectives whose other ranks decide alike: under FSDP, call it inside
        `gathered_for_generation`; tensor-parallel ranks hold the same rows and replicated logits, so they
        sample the same tokens and stop at the same step. `lockstep` is the group whose ranks hold other
        rows yet exchange activations in every forward (expert parallelism's all-to-alls): they stop
        together, once all of them have, and a rank whose rows have all stopped keeps decoding padding
        until then, so every rank runs the same number of forwards.
    """
    # Each distinct prompt is prefilled once and its cache rows copied to every row that asked for it
    # (GRPO asks for each prompt group_size times): the prefix caching an inference server does.
    distinct, copies = distinct_prompts(prompts)
    tokens, real = left_pad(distinct, pad_id, device)
    batch, width = len(prompts), tokens.shape[1]
    cache = decoding.new_cache(width + params.max_new_tokens)
    logits = logits_of(model(tokens, cache=cache, start_pos=0, key_padding_mask=real))[:, -1].float()
    if len(distinct) < batch:
        copies_index = torch.tensor(copies, dtype=torch.long, device=device)
        cache.keep_rows(copies_index)
        logits = logits[copies_index]
    # The decode steps through fused weights where the model allows, else its forward.
    fused = decoding.fused_step(model)
    stop_ids = torch.tensor(params.stop_ids, dtype=torch.long, device=device)
    out = torch.full((batch, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(batch, params.max_new_tokens, dtype=torch.bool, device=device)
    logps = torch.zeros(batch, params.max_new_tokens, dtype=torch.float32, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    active = torch.arange(batch, device=device)  # the rows still decoding, in the cache's row order
    if uniforms is not None:
        uniforms = uniforms.to(device)  # indexed by the device's row order each step, with no host copy
    for t in range(params.max_new_tokens):
        step_uniforms = uniforms[active, t] if uniforms is not None else None
        next_tokens = pick_tokens(logits, params, step_uniforms).masked_fill(stopped[active], pad_id)
        out[active, t] = next_tokens
        live = ~stopped[active]
        mask[active, t] = live
        # From the logits the token was drawn from: no second forward is needed for them.
        # (the picked logit less the log-sum-exp: no [B, V] log-softmax is kept)
        token_logps = logits.gather(-1, next_tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        logps[active, t] = token_logps.masked_fill(~live, 0.0)
        stopped[active] = stopped[active] | torch.isin(next_tokens, stop_ids)
        if t + 1 == params.max_new_tokens:
            break
        if (t + 1) % STOP_CHECK_EVERY == 0:
            if _all_stopped(stopped, lockstep):
                break
            running = (~stopped[active]).nonzero().squeeze(1)
            # Never down to no row: a rank in lockstep still runs its forwards (a batch of none is not one).
            if 0 < len(running) <= len(active) * COMPACT_BELOW:
                # Drop the finished rows from the cache and the batch: with long completions most of a
                # rollout's rows finish early, and decoding them on as padding would cost as much as
                # the rows still running.
                cache.keep_rows(running)
                active, next_tokens = active[running], next_tokens[running]
        if fused is not None:
            logits = fused.step(next_tokens[:, None], cache, width + t).float()
        else:
            logits = logits_of(model(next_tokens[:, None], cache=cache, start_pos=width + t))[:, -1].float()
    # Up to the last generated token of any row: the steps after every row had stopped (until the
    # look that saw it) hold padding only.
    length = int(mask.any(dim=0).nonzero().max()) + 1
    return Completions(tokens=out[:, :length], mask=mask[:, :length], stopped=stopped, logps=logps[:, :length])


def length_buckets(lengths: Sequence[int], buckets: int) -> list[list[int]]:
    """Row indices sorted by prompt length (ties by index) and cut into `buckets` runs of sizes that
    differ by at most one (fewer runs when there are fewer rows)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    count = max(1, min(buckets, len(order)))
    bounds = [len(order) * k // count for k in range(count + 1)]
    return [order[bounds[k] : bounds[k + 1]] for k in range(count)]


def generate_by_length(
    model: nn.Module,
    decoding: Decoding,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    pad_id: int,
    device: torch.device,
    buckets: int,
    uniforms: torch.Tensor | None = None,
    lockstep: dist.ProcessGroup | None = None,
) -> Completions:
    """`generate` over the prompts sorted by length in `buckets` batches of equal size, the rows of the
    result in the prompts' order. Each batch is left-padded only to its own longest prompt, so its KV
    cache, and the attention of each of its decode steps, leaves out the padding a single batch would
    give the shorter prompts; the price is smaller matmuls and one decode loop per batch. A row's
    tokens do not depend on its batch (see `generate`). In `lockstep`, every rank must pass as many
    prompts (each then runs as many batches, in step)."""
    if buckets <= 1:
        return generate(model, decoding, prompts, params, pad_id, device, uniforms, lockstep)
    parts = []
    for rows in length_buckets([len(p) for p in prompts], buckets):
        row_uniform = None if uniforms is None else uniforms[torch.tensor(rows)]
        parts.append(
            (rows, generate(model, decoding, [prompts[i] for i in rows], params, pad_id, device, row_uniform, lockstep))
        )
    length = max(part.tokens.shape[1] for _, part in parts)
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), length, dtype=torch.bool, device=device)
    logps = torch.zeros(len(prompts), length, dtype=torch.float32, device=device)
    stopped = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for rows, part in parts:
        index, width = torch.tensor(rows, device=device), part.tokens.shape[1]
        tokens[index, :width], mask[index, :width], logps[index, :width] = part.tokens, part.mask, part.logps
        stopped[index] = part.stopped
    return Completions(tokens=tokens, mask=mask, stopped=stopped, logps=logps)


def _all_stopped(stopped: torch.Tensor, lockstep: dist.ProcessGroup | None) -> bool:
    """Whether every row has stopped: this rank's rows, or every rank's of the `lockstep` group."""
    if lockstep is None:
        return bool(stopped.all())
    running = (~stopped).any().to(torch.int32).reshape(1)
    dist.all_reduce(running, op=dist.ReduceOp.MAX, group=lockstep)
    return not bool(running)


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module, reshard_after: Callable[[nn.Module], bool]) -> Iterator[None]:
    """Hold every FSDP group of `model` gathered for the duration (one all-gather per group for the
    whole rollout instead of one per group per token); then free them and give each group back the
    reshard-after-forward setting `reshard_after(module)` says it had. A model without FSDP passes
    through unchanged."""
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for group in groups:
        group.set_reshard_after_forward(False, recurse=False)
        group.unshard()
    try:
        yield
    finally:
        for group in groups:
            group.reshard()
            group.set_reshard_after_forward(reshard_after(group), recurse=False)
