"""The layouts of a family whose tensors are each one Hugging Face tensor under another name or a
stack of several (Qwen 3 MoE keeps a layer's experts as one [E, out, in] weight, the folder one
tensor per expert): the family says which in `hf_tensors`, this turns that into the adapter
interface's layouts both ways (titan_tpu/protocols/state_dict_adapter.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from titan_tpu.protocols.state_dict_adapter import ImportPlan, Shapes
from titan_tpu.protocols.tensor_layout import BlockLayout, stacked_layout, unstacked_layouts

CONVERSION = "names mapped one to one, experts stacked"


class StackedTensors(ABC):
    @abstractmethod
    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """The Hugging Face tensors our tensor `name` (global `shape`) is made of: `([hf_name], None)`
        when it maps whole, `(names, dim)` when it is `torch.stack(those tensors, dim)`, with
        `len(names) == shape[dim]`."""

    def _parts(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        names, dim = self.hf_tensors(name, shape)
        return list(names), dim

    def import_layouts(self, args: Any, shapes: Shapes, available: Shapes) -> ImportPlan:
        layouts = {}
        for name, shape in shapes.items():
            try:
                layouts[name] = stacked_layout(*self._parts(name, shape), shape)
            except ValueError as e:
                raise ValueError(f"adapter: {name} {e}") from None
        return ImportPlan(layouts, CONVERSION)

    def export_layouts(self, args: Any, shapes: Shapes) -> dict[str, BlockLayout]:
        layouts: dict[str, BlockLayout] = {}
        for name, shape in shapes.items():
            layouts.update(unstacked_layouts(name, *self._parts(name, shape), shape))
        return layouts
