"""Expert parallelism's token exchange through a ragged all-to-all (TorchTPU's
`torch.tpu.ops.ragged_all_to_all` on TPU): each rank's runs go to the rank holding their experts
without padding and without the host-side split sizes of `all_to_all_single`.

The op (documented by torch_tpu): rank i sends `send_sizes[j]` rows of `operand` starting at row
`input_offsets[j]` to rank j, which writes them into its copy of `output` at row `output_offsets[j]`
*as seen by the sender*; `recv_sizes[j]` is what rank i receives from rank j. It is differentiable
in `operand`.

Everything below comes from the same routing counts as the all-to-all path. Rows arrive ordered by
(source rank, local expert), exactly as `all_to_all_single` delivers them, so the experts' regrouping
after the exchange is shared. With C[s, e] the rows rank s routes to expert e (every rank's counts,
all-gathered) and L experts per rank, sent[s, r] = sum of C[s, r*L:(r+1)*L] (rows s sends to r).
On rank i, for each rank r:

    dispatch  input_offsets[r] = sum_{t<r} sent[i, t]    send_sizes[r] = sent[i, r]
              output_offsets[r] = sum_{s<i} sent[s, r]   recv_sizes[r] = sent[r, i]
    combine   input_offsets[r] = sum_{s<r} sent[s, i]    send_sizes[r] = sent[r, i]
              output_offsets[r] = sum_{t<i} sent[r, t]   recv_sizes[r] = sent[i, r]

(the combine is the dispatch with the roles of sender and receiver swapped: each block goes back to
where it came from).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums along the last dimension: where each block begins."""
    return torch.cumsum(sizes, dim=-1) - sizes


@dataclass(frozen=True)
class RaggedExchange:
    """The offsets and sizes of one dispatch / combine pair on `rank`, from every rank's counts."""

    sent: torch.Tensor  # [ep, ep]: rows rank s sends to rank r
    rank: int
    received_matrix: torch.Tensor  # [source rank, local expert]: what arrives here, in arrival order
    group_name: str

    @classmethod
    def from_counts(cls, every_rank_counts: torch.Tensor, rank: int, group_name: str) -> RaggedExchange:
        """`every_rank_counts` [ep, E]: each rank's rows per global expert (the routing's counts)."""
        ep = every_rank_counts.shape[0]
        per_rank = every_rank_counts.view(ep, ep, -1)  # [source, destination, local expert]
        return cls(per_rank.sum(-1), rank, per_rank[:, rank], group_name)

    def dispatch(self, rows: torch.Tensor, op: Callable[..., torch.Tensor]) -> torch.Tensor:
        """This rank's rows (sorted by global expert) -> the rows of its experts, by source rank."""
        sent, i = self.sent, self.rank
        return self._exchange(
            op,
            rows,
            received=int(sent[:, i].sum()),
            input_offsets=_starts(sent[i]),
            send_sizes=sent[i],
            output_offsets=_starts(sent.T)[:, i],
            recv_sizes=sent[:, i],
        )

    def combine(self, rows: torch.Tensor, op: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The experts' output rows (by source rank) -> back to the ranks and positions they came from."""
        sent, i = self.sent, self.rank
        return self._exchange(
            op,
            rows,
            received=int(sent[i].sum()),
            input_offsets=_starts(sent[:, i]),
            send_sizes=sent[:, i],
            output_offsets=_starts(sent)[:, i],
            recv_sizes=sent[i],
        )

    def _exchange(
        self,
        op: Callable[..., torch.Tensor],
        rows: torch.Tensor,
        received: int,
        **offsets_and_sizes: torch.Tensor,
    ) -> torch.Tensor:
        # int32 offsets and sizes: XLA's ragged all-to-all takes one integer type for all four.
        index = {name: t.to(device=rows.device, dtype=torch.int32) for name, t in offsets_and_sizes.items()}
        output = rows.new_zeros(received, *rows.shape[1:])
        return op(operand=rows, output=output, process_group_name=self.group_name, **index)
