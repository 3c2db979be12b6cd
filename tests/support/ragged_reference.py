"""CPU references of TorchTPU's two MoE ops, written from their documentation in torch_tpu
(`torch_tpu/_internal/ops/ops.py`), so that everything the project passes to them (routing, group
sizes, offsets, the process group's name) is tested without a chip; only the ops themselves are not.

- `ragged_dot(lhs [m, k], rhs [g, k, n], group_sizes [g])`: rows split into consecutive groups,
  group i multiplied by rhs[i]; group sizes must sum to m. Differentiable in lhs and rhs.
- `ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
  process_group_name)`: rank i sends send_sizes[j] rows of operand from input_offsets[j] to rank j,
  which writes them at output_offsets[j] *as seen by the sender*; recv_sizes[j] is what i receives
  from j; rows of `output` that receive nothing keep their values. Differentiable in operand.

The exchange is `exchange_every_rank` / `operand_gradients` over every rank's arguments at once
(pure, checked on a hand example), and `GlooRaggedAllToAll` runs them on a process group by
all-gathering the arguments.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """result[start_i:end_i] = lhs[start_i:end_i] @ rhs[i], as documented."""
    if lhs.dim() != 2 or rhs.dim() != 3 or group_sizes.shape != (rhs.shape[0],) or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"ragged_dot: lhs (m, k), rhs (g, k, n), group_sizes (g,); got {tuple(lhs.shape)}, "
            f"{tuple(rhs.shape)}, {tuple(group_sizes.shape)}"
        )
    sizes = group_sizes.tolist()
    if sum(sizes) != lhs.shape[0] or min(sizes, default=0) < 0:
        raise ValueError(f"ragged_dot: group sizes {sizes} must be >= 0 and sum to lhs's {lhs.shape[0]} rows")
    groups = [rows @ rhs[i] for i, rows in enumerate(lhs.split(sizes))]
    return torch.cat(groups) if groups else lhs.new_zeros(0, rhs.shape[2])


Table = list[list[int]]  # [rank][peer]


def _blocks(
    input_offsets: Table, send_sizes: Table, output_offsets: Table, recv_sizes: Table
) -> list[tuple[int, int, int, int, int]]:
    """(sender, receiver, first operand row, first output row, rows) of every block sent; the
    sender's send size must be the receiver's receive size."""
    blocks = []
    for sender, sizes in enumerate(send_sizes):
        for receiver, rows in enumerate(sizes):
            if rows != recv_sizes[receiver][sender]:
                raise ValueError(
                    f"ragged_all_to_all: rank {sender} sends {rows} rows to rank {receiver}, which expects "
                    f"{recv_sizes[receiver][sender]}"
                )
            blocks.append((sender, receiver, input_offsets[sender][receiver], output_offsets[sender][receiver], rows))
    return blocks


def exchange_every_rank(
    operands: list[torch.Tensor], outputs: list[torch.Tensor], *index: list[list[int]]
) -> list[torch.Tensor]:
    """Every rank's result, from every rank's (operand, output, input_offsets, send_sizes,
    output_offsets, recv_sizes); `index` is the four lists of lists in that order."""
    results = [output.clone() for output in outputs]
    for sender, receiver, start, at, rows in _blocks(*index):
        if start + rows > operands[sender].shape[0] or at + rows > results[receiver].shape[0]:
            raise ValueError(f"ragged_all_to_all: block {sender} -> {receiver} ({rows} rows) out of bounds")
        results[receiver][at : at + rows] = operands[sender][start : start + rows]
    return results


def operand_gradients(
    operands: list[torch.Tensor], grad_outputs: list[torch.Tensor], *index: list[list[int]]
) -> list[torch.Tensor]:
    """Every rank's gradient w.r.t. its operand: each sent row gets the gradient of the row it was
    written to; rows sent nowhere get zero."""
    grads = [torch.zeros_like(operand) for operand in operands]
    for sender, receiver, start, at, rows in _blocks(*index):
        grads[sender][start : start + rows] += grad_outputs[receiver][at : at + rows]
    return grads


class GlooRaggedAllToAll:
    """`ragged_all_to_all` on `group` (any backend with all_gather_object): the caller's process
    group name must be this group's."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.calls = 0

    def __call__(
        self,
        operand: torch.Tensor,
        output: torch.Tensor,
        input_offsets: torch.Tensor,
        send_sizes: torch.Tensor,
        output_offsets: torch.Tensor,
        recv_sizes: torch.Tensor,
        process_group_name: str,
    ) -> torch.Tensor:
        if process_group_name != self.group.group_name:
            raise ValueError(f"ragged_all_to_all: group {process_group_name!r}, expected {self.group.group_name!r}")
        self.calls += 1
        index = [t.tolist() for t in (input_offsets, send_sizes, output_offsets, recv_sizes)]
        return _Exchange.apply(operand, output, index, self.group)


def _gather(value: Any, group: dist.ProcessGroup) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, operand: torch.Tensor, output: torch.Tensor, index: list[list[int]], group: dist.ProcessGroup
    ) -> torch.Tensor:
        every_rank = _gather((operand.detach(), output.detach(), index), group)
        operands, outputs, indices = zip(*every_rank)
        ctx.group, ctx.operands, ctx.index = group, list(operands), [list(i) for i in zip(*indices)]
        rank = dist.get_rank(group)
        return exchange_every_rank(ctx.operands, list(outputs), *ctx.index)[rank]

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad_outputs = _gather(grad_output.contiguous(), ctx.group)
        rank = dist.get_rank(ctx.group)
        return operand_gradients(ctx.operands, grad_outputs, *ctx.index)[rank], None, None, None
