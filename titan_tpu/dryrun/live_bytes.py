"""The bytes of fake tensors alive at a moment: what the simulated step would hold.

Each storage an op makes is tracked from then until it is released (a weak reference's callback,
when the last tensor on it goes). A total reads every tracked storage's size *now*: FSDP2 frees a
gathered block by resizing its storage to zero and gathers into it again by resizing it back,
outside any op, so sizes are read, not remembered.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class LiveBytes:
    def __init__(self) -> None:
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.peak = 0

    def track(self, value: Any) -> int:
        """Track the storage of every tensor in `value` (an op's output); returns the bytes of the
        largest it had not seen."""
        largest = 0
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = id(storage)
                known = self._storages.get(key)
                if known is None or known() is not storage:
                    self._storages[key] = weakref.ref(storage, self._forget(key))
                    largest = max(largest, storage.nbytes())
        return largest

    def _forget(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        """The callback that drops a released storage's entry."""

        def forget(_: weakref.ref[torch.UntypedStorage]) -> None:
            self._storages.pop(key, None)

        return forget

    def total(self) -> int:
        return sum(storage.nbytes() for ref in list(self._storages.values()) if (storage := ref()) is not None)

    def sample(self) -> None:
        self.peak = max(self.peak, self.total())
