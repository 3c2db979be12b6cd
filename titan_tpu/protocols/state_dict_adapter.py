"""A model family's map to and from Hugging Face transformers (or diffusers) folders.

The checkpoint layer reads and writes folders through it (titan_tpu/checkpoint/hf_import.py,
hf_export.py); each family provides one (`ModelSpec.state_dict_adapter`). How each of our tensors is
made of the folder's tensors, and each folder tensor of ours, is a `BlockLayout` (tensor_layout.py): a
renamed tensor, experts stacked, projections concatenated or split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from titan_tpu.protocols.tensor_layout import BlockLayout

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class ImportPlan:
    """Our tensors (those the plan could make) as layouts over a folder's tensors, and what was
    applied to make them, for messages ("names mapped one to one", transformers' conversion)."""

    layouts: dict[str, BlockLayout]
    conversion: str


class StateDictAdapter(Protocol):
    """Names, layouts and configs to and from a Hugging Face folder, and the folder's file stem and
    config dtype keys."""

    # Read-only, so that an adapter may declare them as class constants of narrower types.
    @property
    def weights_stem(self) -> str:
        """ "model" (transformers), "diffusion_pytorch_model" (diffusers)."""
        ...

    @property
    def config_dtype_keys(self) -> tuple[str, ...]:
        """The dtype keys an exported config.json carries."""
        ...

    def import_layouts(self, args: Any, shapes: Shapes, available: Shapes) -> ImportPlan:
        """Our tensors (name -> global shape, `shapes`) from a folder holding `available` (name ->
        shape). A tensor the folder cannot make is left out; the caller names what is missing."""
        ...

    def export_layouts(self, args: Any, shapes: Shapes) -> dict[str, BlockLayout]:
        """The tensors a folder of ours holds, in the order written, as layouts over ours."""
        ...

    def to_hf_config(self, args: Any) -> dict[str, Any]: ...

    def check_hf_config(self, config: dict[str, Any], args: Any) -> list[str]: ...
