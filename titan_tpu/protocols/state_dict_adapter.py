"""A model family's map to and from Hugging Face transformers (or diffusers) folders.

The checkpoint layer reads and writes folders through it (titan_tpu/checkpoint/hf_import.py,
hf_export.py); each family provides one (`ModelSpec.state_dict_adapter`).
"""

from __future__ import annotations

from typing import Any, Protocol


class StateDictAdapter(Protocol):
    """Names and configs to and from a Hugging Face folder, and the folder's file stem and config
    dtype keys."""

    # Read-only, so that an adapter may declare them as class constants of narrower types.
    @property
    def weights_stem(self) -> str:
        """ "model" (transformers), "diffusion_pytorch_model" (diffusers)."""
        ...

    @property
    def config_dtype_keys(self) -> tuple[str, ...]:
        """The dtype keys an exported config.json carries."""
        ...

    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        """The Hugging Face tensors our tensor `name` (global `shape`) is made of: `([hf_name], None)`
        when it maps whole, `(names, dim)` when it is `torch.stack(those tensors, dim)`, with
        `len(names) == shape[dim]`."""
        ...

    def to_hf_config(self, args: Any) -> dict[str, Any]: ...

    def check_hf_config(self, config: dict[str, Any], args: Any) -> list[str]: ...
