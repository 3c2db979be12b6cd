"""Context parallelism (CP): every sample's sequence is split over the `cp` mesh axis, and each
attention layer all-gathers keys and values so that a rank's queries see every earlier token.

Load balance. The sequence of S tokens is cut into 2 x cp chunks of S / (2 cp); cp rank i holds
chunks i and 2 cp - 1 - i. Under the causal mask a query at position p attends to p + 1 keys, so a
rank holding the first and the last chunk does as much attention work as one holding two middle
ones; a contiguous split would leave the last rank with about 2 x the average work
(TorchTitan's and Megatron's "load-balanced" layout).

Attention. Everything in the model but attention is per token, so it runs unchanged on a rank's
2 x S / (2 cp) tokens. Attention gathers keys and values over cp (a differentiable all-gather whose
backward reduce-scatters, i.e. sums, the gradients every rank's queries sent to each key), and
computes the rank's queries against all S keys under the causal mask of their true positions
(SDPA with an explicit [S / cp, S] mask, whatever kernel the run chose for whole sequences; kv
heads shared with their query groups by SDPA's `enable_gqa`, as in the model's masked path). The
rotary tables are read at the true positions too. Memory per rank: the gathered K/V of every layer,
which attention keeps for backward (2 x S x kv heads x head_dim per sample and layer), and one
[S / cp, S] mask that every layer shares (titan_tpu/plan/context_parallel.py counts both).

Gradients. A rank's loss is the mean over its tokens; cp ranks hold equal shares of the same
samples, so the mean of their means is the sample mean, and FSDP, which shards over dp_shard x cp
(`ParallelDims`), averages the cp ranks' gradients exactly as it averages data-parallel ones.

The model code knows none of this: `apply_context_parallel` swaps each attention module's kernel
and hooks the rotary module, as tensor and expert parallelism hook theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.distributed.expert_parallel import GatherRows

# What an attention module's `kernel` is (titan_tpu/models/common/attention_kernels.py's AttentionKernel, which
# this layer may not import): kernel(q, k, v[, document_ids]) -> out, with a `name`.
Kernel = Callable[..., torch.Tensor]


def rank_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """[seq_len / cp] int64: the positions cp rank `cp_rank` holds, chunk i then chunk 2 cp - 1 - i."""
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"context parallelism {cp} needs a sequence length divisible by {2 * cp}, got {seq_len}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat((first, last))


def split_for_rank(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """The part of `x` (the whole sequence along `dim`) that cp rank `cp_rank` holds."""
    return x.index_select(dim, rank_positions(x.shape[dim], cp, cp_rank, x.device))


def join_ranks(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `split_for_rank`: every rank's part (in rank order) back into sequence order."""
    cp = len(parts)
    gathered = torch.cat(parts, dim)
    seq_len = gathered.shape[dim]
    positions = torch.cat([rank_positions(seq_len, cp, rank, gathered.device) for rank in range(cp)])
    return gathered.index_select(dim, torch.argsort(positions))


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[B, H, S / cp, D] on each rank -> [B, H, S, D], the ranks' parts one after the other (rank
    order, not sequence order); differentiable: the gradient is summed back to each rank's part."""
    bs, heads, local_len, head_dim = x.shape
    rows = GatherRows.apply(x, group)  # [cp * B, H, S / cp, D]
    return rows.view(cp, bs, heads, local_len, head_dim).permute(1, 2, 0, 3, 4).reshape(bs, heads, -1, head_dim)


@dataclass(frozen=True)
class ContextParallelAttention:
    """The attention kernel of a cp rank: its queries [B, H, S / cp, D] against the keys and values
    of all cp ranks, under the causal mask of the tokens' true positions. Replaces the run's
    whole-sequence kernel (`inner`, kept for its name) in every attention module."""

    inner: Kernel
    group: dist.ProcessGroup = field(compare=False)
    cp: int
    cp_rank: int
    name: str = field(default="", init=False)
    # (sequence length, device) -> causal_mask: built once, shared by every layer and step.
    masks: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", f"cp{self.cp}[{getattr(self.inner, 'name', 'kernel')}]")

    def causal_mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """[S / cp, S] bool: query i of this rank may attend gathered key j (rank order) when j's
        true position is not after i's."""
        queries = rank_positions(seq_len, self.cp, self.cp_rank, device)
        keys = torch.cat([rank_positions(seq_len, self.cp, rank, device) for rank in range(self.cp)])
        return keys[None, :] <= queries[:, None]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if document_ids is not None:
            raise ValueError("context parallelism does not split document ids; data.document_mask needs cp = 1")
        keys = gather_sequence(k, self.group, self.cp)
        values = gather_sequence(v, self.group, self.cp)
        key = (keys.shape[2], q.device)
        if key not in self.masks:
            self.masks[key] = self.causal_mask(*key)
        mask = self.masks[key]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _rotary_at_rank_positions(cp: int, cp_rank: int) -> Any:
    """A forward hook for a rotary module whose forward(seq_len) returns the (cos, sin) tables of
    positions 0..seq_len-1, and whose `cos`/`sin` buffers hold every position: it returns the
    tables at this rank's true positions of a cp x seq_len sequence instead."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        (local_len,) = args
        cos, sin = module.cos, module.sin
        if not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor):
            raise TypeError(f"{type(module).__name__} has no `cos` and `sin` tables for context parallelism")
        seq_len = local_len * cp
        if seq_len > cos.shape[0]:
            raise ValueError(f"sequence length {seq_len} ({cp} cp ranks x {local_len}) exceeds the rotary tables")
        positions = rank_positions(seq_len, cp, cp_rank, cos.device)
        return cos[positions], sin[positions]

    return hook


def apply_context_parallel(attention_modules: Iterable[nn.Module], rotary: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make a decoder context-parallel: each attention module's `kernel` becomes the cp rank's
    gathering kernel, and the rotary module answers with the rank's true positions. The model's
    forward must take this rank's tokens (`split_for_rank` of every row)."""
    cp, cp_rank, group = cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group()
    # One cp kernel per distinct inner kernel (normally one for the whole model), so its mask is shared.
    shared: dict[Kernel, ContextParallelAttention] = {}
    for attention in attention_modules:
        # nn.Module's stub types every attribute as a tensor or a module; `kernel` is neither.
        kernel: Kernel = attention.kernel  # type: ignore[assignment]  # a plain callable attribute
        cp_kernel = shared.setdefault(kernel, ContextParallelAttention(kernel, group, cp, cp_rank))
        attention.kernel = cp_kernel  # type: ignore[assignment]  # a plain callable attribute
    rotary.register_forward_hook(_rotary_at_rank_positions(cp, cp_rank))
