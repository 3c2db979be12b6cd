"""The bytes of fake tensors alive at a moment: what the simulated step would hold.

Each storage an op makes is tracked from then until it is released (a weak reference's callback,
when the last tensor on it goes): the running total adds a storage's size when it appears and takes
it off when it goes. FSDP2 frees a gathered block by resizing its storage to zero and gathers into
it again by resizing it back, outside any op, so the running total drifts by those resizes;
`rescan` reads every tracked storage's size again and sets it right. Reading thousands of storages
after every one of a step's hundred thousand ops would cost more than the step (titan_tpu/dryrun/
fake_mode.py rescans every few ops).
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
        self._sizes: dict[int, int] = {}  # the size each was counted at
        self.total = 0
        self.peak = 0

    def track(self, value: Any) -> None:
        """Track the storage of every tensor in `value` (an op's output)."""
        # Most ops return one tensor: tree_leaves on every one of a step's hundred thousand ops costs.
        for tensor in (value,) if isinstance(value, torch.Tensor) else tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = id(storage)
                known = self._storages.get(key)
                if known is None or known() is not storage:
                    self._forget(key)(known)  # a released storage whose id came back
                    self._storages[key] = weakref.ref(storage, self._forget(key))
                    self._sizes[key] = storage.nbytes()
                    self.total += self._sizes[key]

    def _forget(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage] | None], None]:
        """The callback that takes a released storage off the total."""

        def forget(_: weakref.ref[torch.UntypedStorage] | None) -> None:
            self._storages.pop(key, None)
            self.total -= self._sizes.pop(key, 0)

        return forget

    def rescan(self) -> None:
        """Read every tracked storage's size again (FSDP's resizes)."""
        for key, ref in list(self._storages.items()):
            storage = ref()
            if storage is not None:
                size = storage.nbytes()
                self.total += size - self._sizes[key]
                self._sizes[key] = size

    def sample(self) -> None:
        self.peak = max(self.peak, self.total)
