"""Mixture-of-experts routing stood in for on fake tensors: every expert gets the same share.

A router's choices are data: `bincount` of the chosen experts gives the counts, and the layer reads
them on the host (`int(counts.max())`, the expert-parallel split sizes), which fake tensors, having
no values, cannot answer. The dry run answers with the planner's assumption (titan_tpu/plan/
roofline.py routes top_k copies of every token, spread evenly): the counts of N choices over E experts
are N // E each, the first N % E one more. Those counts are real tensors kept beside their fake
twins, and every op that reads only such tensors is computed on the real ones too, so what the
model derives from them (sums, cumulative offsets, the maximum) has values; the collectives that
exchange counts between expert-parallel ranks hand back the same counts, since under even routing
every rank's are the same. Shapes, kernels and collectives downstream are then those of balanced
routing: skewed routing (hot experts) is not simulated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

_aten = torch.ops.aten
_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional


def even_counts(choices: int, experts: int) -> torch.Tensor:
    counts = torch.full((experts,), choices // experts, dtype=torch.int64)
    counts[: choices % experts] += 1
    return counts


NOT_HANDLED = object()


def bins(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The experts a `bincount(choices, weights, minlength)` counts over: its minlength."""
    return int(kwargs.get("minlength", args[2] if len(args) > 2 else 0))


class EvenRouting:
    """Real values beside the fake routing tensors; `before` answers the ops fake tensors cannot,
    `after` carries the values through the ops that read only such tensors."""

    def __init__(self) -> None:
        self.values = WeakTensorKeyDictionary()  # fake tensor -> its real value
        self.used = False

    def before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value of `_local_scalar_dense` (`.item()`, `.tolist()`) of a routing tensor; NOT_HANDLED
        for every other op."""
        if func is _aten._local_scalar_dense.default and args[0] in self.values:
            with unset_fake_temporarily():
                return self.values[args[0]].item()
        return NOT_HANDLED

    def after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is _aten.bincount.default:
            with unset_fake_temporarily():
                self.values[out] = even_counts(args[0].numel(), bins(args, kwargs))
            self.used = True
            return
        if not self.values:  # no router has run (a dense model): nothing to carry
            return
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(t in self.values for t in tensors):
            return
        if func is _c10d.alltoall_base_.default:
            self.values[args[0]] = self.values[args[1]]  # every rank receives what it sends
        elif func in (_c10d._allgather_base_.default, _functional.all_gather_into_tensor.default):
            gathered = func is _c10d._allgather_base_.default
            source = self.values[args[1] if gathered else args[0]]
            target = args[0] if gathered else out
            with unset_fake_temporarily():
                self.values[target] = source.repeat(target.numel() // source.numel()).view(target.shape)
        elif all(t in self.values for t in tensors):
            real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            with unset_fake_temporarily():
                real_out = func(*real_args, **real_kwargs)
            for fake, real in zip(tree_leaves(out), tree_leaves(real_out)):
                if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
                    self.values[fake] = real

    def _real(self, value: Any) -> Any:
        return self.values[value] if isinstance(value, torch.Tensor) else value
