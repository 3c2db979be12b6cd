"""The causal attention kernel interface: kernel(q, k, v) -> out, interchangeable behind one call.

The kernels themselves (SDPA, blocked, TPU splash) are in titan_tpu/models/common/attention_kernels.py;
which one a run uses ("auto") is measured at start-up (titan_tpu/autotune/).
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionKernel(Protocol):
    """Causal attention over [B, H, S, D] queries and [B, H_kv, S, D] keys and values; with
    `document_ids` [B, S], within each packed document only (titan_tpu/models/common/documents.py)."""

    @property
    def name(self) -> str: ...

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor: ...
