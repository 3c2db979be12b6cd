"""Several documents packed into one row, kept apart: positions restart, attention stays inside each.

A row of packed examples is described by `document_ids` [B, S]: equal ids on consecutive tokens are one
document (ids only need to change at boundaries; padding is a document of its own). Every token's
rotary position counts from its document's first token, and a token attends only to earlier tokens of
its own document (block-diagonal causal attention), so a packed row computes what each document
would compute alone.
"""

from __future__ import annotations

import torch


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a document begins (the first token of every row, and every change of id)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: each token's offset from its document's first token."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    first = torch.where(document_starts(document_ids), index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_segments(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: the index of each token's document in its row, so that two documents with the
    same id (not adjacent) still count as two."""
    return document_starts(document_ids).cumsum(dim=1)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True where query i may attend key j: j <= i within one document."""
    seq_len = document_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    segments = document_segments(document_ids)
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]
