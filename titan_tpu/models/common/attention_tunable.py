"""The causal attention kernel as a measured choice: SDPA everywhere, plain-matmul blocks on CPUs,
the splash kernel on TPUs (see `tunable.py` for how a choice is measured).

Why measured: which kernel is fastest depends on the CPU kind, the dtype and the sequence length,
and a fixed rule tuned on one machine was 2.5x off on the next (blocked:128 in bf16 against SDPA on
an AMX Xeon, after it had been the faster one on the AVX512-BF16 CPU it was tuned on).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titan_tpu.models.common.attention_kernels import attention_kernel, splash_block
from titan_tpu.protocols.tunable import KernelRun, KernelShape, Tunable, forward_backward

# Query-block sizes of the blocked kernel worth timing on a CPU: multiples of its matmul tiles, up
# to where a block's float32 scores (block x seq_len) leave the caches.
CPU_BLOCKS = (64, 128, 256, 512)
# Tokens of the micro-batch the candidates are timed on. Fewer sequences than the run's: at sequence
# 2048 a batch of 8 cost 55 s of start-up for five candidates. Not one sequence of a short run,
# though: at sequence 256 in bf16 that ranked SDPA first on an AVX512-BF16 CPU where blocks of 64
# train 1.13x faster (llama3_debug, docs/benchmarks/kernels_epyc_2026-12-03.md), as a batch of 8 had measured.
MEASURE_TOKENS = 2048
# The correctness check's sequence length: every block size but the largest runs in several blocks
# (the largest's code path is the others'), and the check costs a fraction of the timing.
CHECK_SEQ_LEN = 512


def _candidates(args: Any, shape: KernelShape) -> dict[str, Any]:
    names = ["sdpa"]
    if shape.device.type == "cpu":
        names += [f"blocked:{block}" for block in CPU_BLOCKS if block < shape.seq_len]
    # torch_tpu 0.2's splash kernel takes no segment ids, so document-masked runs leave it out.
    if (
        shape.device.type == "tpu"
        and shape.splash_op is not None
        and splash_block(shape.seq_len)
        and not shape.document_mask
    ):
        names.append("splash")
    return {name: attention_kernel(name, splash_op=shape.splash_op) for name in names}


def _heads(args: Any, shape: KernelShape) -> tuple[int, int]:
    return args.n_heads // shape.tp, max(1, args.n_kv_heads // shape.tp)


def _batch(shape: KernelShape) -> int:
    """Sequences timed: the run's micro-batch, up to MEASURE_TOKENS tokens."""
    return max(1, min(shape.batch, MEASURE_TOKENS // shape.seq_len))


def _workload(args: Any, shape: KernelShape) -> KernelRun:
    heads, kv_heads = _heads(args, shape)
    generator = torch.Generator().manual_seed(0)

    def make(n: int) -> torch.Tensor:
        return torch.randn(_batch(shape), shape.seq_len, n, args.attn_head_dim, generator=generator)

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    # Packed documents: four per row, as a stand-in for the run's (which the data decides).
    documents = None
    if shape.document_mask:
        documents = (torch.arange(shape.seq_len) * 4 // shape.seq_len).expand(_batch(shape), -1).to(shape.device)

    def run(kernel: Any, dtype: torch.dtype) -> list[torch.Tensor]:
        def in_model_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # As titan_tpu/models/common/attention.py hands them over: [B, S, H, D] projections seen as
            # [B, H, S, D], not contiguous; what a kernel does about that is part of its cost.
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = kernel(q, k, v) if documents is None else kernel(q, k, v, documents)
            return out.transpose(1, 2)

        inputs = (t.to(device=shape.device, dtype=dtype) for t in (q, k, v))
        return forward_backward(in_model_layout, *inputs)

    return run


def _check_shape(shape: KernelShape) -> KernelShape:
    seq_len = min(shape.seq_len, CHECK_SEQ_LEN)
    if shape.splash_op is not None and splash_block(shape.seq_len) and not splash_block(seq_len):
        seq_len = shape.seq_len
    return dataclasses.replace(shape, batch=1, seq_len=seq_len)


def _key(args: Any, shape: KernelShape) -> tuple[int, ...]:
    return (_batch(shape), *_heads(args, shape), shape.seq_len, args.attn_head_dim, int(shape.document_mask))


def _config_override(name: str) -> str:
    block = {"sdpa": "0"}.get(name, name.partition(":")[2])
    if not block:
        raise ValueError(f"attention kernel '{name}' has no model.attention_block value")
    return f"--model.attention_block={block}"


ATTENTION = Tunable(
    field="attention",
    is_auto=lambda args: args.attention.name == "auto",
    candidates=_candidates,
    reference="sdpa",
    fallback="sdpa",
    workload=_workload,
    check_shape=_check_shape,
    key=_key,
    config_override=_config_override,
    name_of=lambda args: args.attention.name,
)
