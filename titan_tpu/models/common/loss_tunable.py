"""The cross-entropy's chunk size as a measured choice (see `tunable.py` for how a choice is measured).

The chunked loss (`chunked_cross_entropy.py`) upcasts one chunk of logits at a time; its budget,
2^26 float32 elements, bounds the loss's memory. Eagerly on a CPU a smaller chunk is faster: each
pass over a chunk then stays in the caches. At `llama3_100m`'s head, `train.py --config llama3_100m
--compile.enable=false --training.dtype=float32` logged 35.4 ms for 2^20 against 55.8 ms for 2^26
(512 tokens of a 32768 vocabulary) on an AVX512-BF16 AMD EPYC. Which size wins depends on the cache sizes, the dtype and the vocabulary, so it is
measured, among budgets up to the default: the planner's memory bound holds for every candidate.

The loss runs eagerly also where `[compile] enable` compiles the blocks, so every run measures its
chunk. Compiled, the chunked loss (at the budget, since the compile time grows with the number of
chunks) timed fast on its own, but not inside a training step: on the AVX512-BF16 AMD EPYC, a profile
of `llama3_100m` in bf16 spent 1.78 s of a 12.4 s step in the compiled loss's own kernels (330
tokens/s; separate runs with the loss eager at its measured chunk read 374-407), and in one script
the output-head matmul, logits and loss of that model's micro-batch took 2.9 s with the loss
compiled against 2.3 s eager at 2^20 (median of 3). A vocab-sharded loss (loss parallel) does not chunk at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titan_tpu.models.common.chunked_cross_entropy import CHUNK_ELEMENTS, chunk_tokens, chunked_cross_entropy
from titan_tpu.protocols.tunable import KernelRun, KernelShape, Tunable, forward_backward

# Chunk budgets (float32 elements) worth timing, the default first: a tie keeps the fewest chunks.
BUDGETS = tuple(CHUNK_ELEMENTS >> shift for shift in range(0, 12, 2))  # 2^26 down to 2^16
# Logits elements the candidates are timed on: a micro-batch's logits can be gigabytes, and the time
# per token stops depending on the token count once a chunk is a small part of them.
MEASURE_ELEMENTS = 2**24
# Tokens of the correctness check: several chunks for the smaller budgets at a small vocabulary.
CHECK_TOKENS = 256
_IGNORE_INDEX = -100


def _name(budget: int) -> str:
    """ "2^k" for a power of two (every candidate), else the number a config forced."""
    power = budget.bit_length() - 1
    return f"2^{power}" if budget == 1 << power else str(budget)


def _budget(name: str) -> int:
    return 2 ** int(name.removeprefix("2^")) if name.startswith("2^") else int(name)


def _tokens(args: Any, shape: KernelShape) -> int:
    """Tokens timed: this rank's micro-batch, up to MEASURE_ELEMENTS logits."""
    return max(1, min(shape.batch * shape.seq_len, MEASURE_ELEMENTS // args.vocab_size))


def _candidates(args: Any, shape: KernelShape) -> dict[str, int]:
    """Budgets that chunk the timed tokens differently from every larger one; only the default for
    a loss that does not run the chunked kernel eagerly."""
    if not shape.eager_loss:
        return {_name(CHUNK_ELEMENTS): CHUNK_ELEMENTS}
    tokens = _tokens(args, shape)
    seen: set[int] = set()
    candidates: dict[str, int] = {}
    for budget in BUDGETS:
        per_chunk = min(tokens, chunk_tokens(args.vocab_size, budget))
        if per_chunk not in seen:
            seen.add(per_chunk)
            candidates[_name(budget)] = budget
    return candidates


def _workload(args: Any, shape: KernelShape) -> KernelRun:
    tokens = _tokens(args, shape)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, args.vocab_size, generator=generator)
    labels = torch.randint(0, args.vocab_size, (tokens,), generator=generator)
    labels[::7] = _IGNORE_INDEX  # the ignored-label path runs too (padding, prompt tokens)
    labels = labels.to(shape.device)

    def run(budget: int, dtype: torch.dtype) -> list[torch.Tensor]:
        step = chunk_tokens(args.vocab_size, budget)

        def loss(x: torch.Tensor) -> torch.Tensor:
            return chunked_cross_entropy(x, labels, _IGNORE_INDEX, step)

        return forward_backward(loss, logits.to(device=shape.device, dtype=dtype))

    return run


def _check_shape(shape: KernelShape) -> KernelShape:
    return dataclasses.replace(shape, batch=1, seq_len=min(shape.batch * shape.seq_len, CHECK_TOKENS))


def _key(args: Any, shape: KernelShape) -> tuple[int, ...]:
    return (_tokens(args, shape), args.vocab_size, int(shape.eager_loss))


LOSS_CHUNKS = Tunable(
    field="loss_chunk_elements",
    is_auto=lambda args: args.loss_chunk_elements == -1,
    candidates=_candidates,
    reference=_name(CHUNK_ELEMENTS),
    fallback=_name(CHUNK_ELEMENTS),
    workload=_workload,
    check_shape=_check_shape,
    key=_key,
    config_override=lambda name: f"--model.overrides.loss_chunk_elements={_budget(name)}",
    name_of=lambda args: _name(args.loss_chunk_elements),
)
