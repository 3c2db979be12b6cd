"""The layouts of a family whose tensors are each one Hugging Face tensor under another name or a
stack of several (Qwen 3 MoE keeps a layer's experts as one [E, out, in] weight, the folder one
tensor per expert): the family says which in `hf_tensors`, this turns that into the adapter
interface's layouts both ways (titan_tpu/protocols/state_dict_adapter.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from titan_tpu.protocols.state_dict_adapter import ImportPlan, Shapes
from titan_tpu.protocols.tensor_layout import BlockLayout

CONVERSION = "names mapped one to one, experts stacked"


def stacked_layout(names: Sequence[str], dim: int | None, shape: Sequence[int]) -> BlockLayout:
    """Our tensor of global `shape` as `names[0]` whole (dim None) or `torch.stack(names, dim)`."""
    shape = tuple(int(n) for n in shape)
    if dim is None:
        if len(names) != 1:
            raise ValueError(f"maps whole to {len(names)} tensors, expected 1")
        return BlockLayout.whole(names[0], shape)
    if not 0 <= dim < len(shape) or len(names) != shape[dim]:
        raise ValueError(f"{list(shape)} is not a stack of {len(names)} along dim {dim}")
    part = shape[:dim] + shape[dim + 1 :]
    return BlockLayout.stack([BlockLayout.whole(name, part) for name in names], dim)


def unstacked_layouts(name: str, names: Sequence[str], dim: int | None, shape: Sequence[int]) -> dict[str, BlockLayout]:
    """The reverse of `stacked_layout`: each of `names` as a layout over our tensor `name`."""
    whole = BlockLayout.whole(name, shape)
    if dim is None:
        return {names[0]: whole}
    return {hf_name: whole.narrow(dim, k, 1).squeeze(dim) for k, hf_name in enumerate(names)}


class StackedTensors(ABC):
    @abstractmethod
    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """The Hugging Face tensors our tensor `name` (global `shape`) is made of: `([hf_name], None)`
        when it maps whole, `(names, dim)` when it is `torch.stack(those tensors, dim)`, with
        `len(names) == shape[dim]`."""

    def import_layouts(self, args: Any, shapes: Shapes, available: Shapes) -> ImportPlan:
        layouts = {}
        for name, shape in shapes.items():
            try:
                layouts[name] = stacked_layout(*self.hf_tensors(name, shape), shape)
            except ValueError as e:
                raise ValueError(f"adapter: {name} {e}") from None
        return ImportPlan(layouts, CONVERSION)

    def export_layouts(self, args: Any, shapes: Shapes) -> dict[str, BlockLayout]:
        layouts: dict[str, BlockLayout] = {}
        for name, shape in shapes.items():
            layouts.update(unstacked_layouts(name, *self.hf_tensors(name, shape), shape))
        return layouts
