"""Whether a Hugging Face folder makes every tensor of a model, checked from the safetensors headers
before any weight is read, and one line that says what does not fit: the first tensor missing from
the folder, the first of the wrong shape, the first the model would not read, and the conversion
that was applied (the adapter's import plan, titan_tpu/protocols/state_dict_adapter.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_tpu.config.errors import ConfigError
from titan_tpu.protocols.state_dict_adapter import Shapes, StateDictAdapter
from titan_tpu.protocols.tensor_layout import BlockLayout

logger = logging.getLogger(__name__)


def _first(what: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f" (and {len(items) - 1} more {what})" if len(items) > 1 else ""
    return [f"{items[0]}{more}"]


def layout_problems(layouts: dict[str, BlockLayout], shapes: Shapes, available: Shapes) -> list[str]:
    """What keeps `layouts` from making each of `shapes` out of the `available` tensors."""
    problems = [f"{name} cannot be made from the folder" for name in shapes if name not in layouts]
    # Several of ours may read one folder tensor (a fused projection chunked): its extent is theirs together.
    extents: dict[str, tuple[int, ...]] = {}
    for name, layout in layouts.items():
        if name in shapes and layout.shape != tuple(shapes[name]):
            problems.append(f"{name} comes out {list(layout.shape)}, the model has {list(shapes[name])}")
        for source, extent in layout.extents().items():
            seen = extents.get(source, extent)
            extents[source] = tuple(max(a, b) for a, b in zip(seen, extent))
    for source, extent in extents.items():
        if source not in available:
            problems.append(f"{source} is missing")
        elif tuple(available[source]) != extent:
            problems.append(f"{source} is {list(available[source])} there, {list(extent)} here")
    return problems


def folder_problems(expected: dict[str, BlockLayout], available: Shapes) -> list[str]:
    """The folder against the tensors a folder of this model holds (`expected`): missing, wrong
    shape, not read; the first of each kind, with how many more."""
    missing = [f"{name} is missing" for name in expected if name not in available]
    misshapen = [
        f"{name} is {list(available[name])} there, {list(layout.shape)} here"
        for name, layout in expected.items()
        if name in available and tuple(available[name]) != layout.shape
    ]
    unexpected = [f"{name} is not a tensor of this model" for name in available if name not in expected]
    return _first("missing", missing) + _first("of the wrong shape", misshapen) + _first("unread", unexpected)


def plan_import(
    folder: Path, adapter: StateDictAdapter, args: Any, shapes: Shapes, available: Shapes, what: str
) -> dict[str, BlockLayout]:
    """Our tensors' layouts over the folder's tensors; ConfigError naming what does not fit."""
    try:
        plan = adapter.import_layouts(args, shapes, available)
    except ValueError as e:
        raise ConfigError(f"Hugging Face folder {folder} cannot be read into {what}: {e}") from None
    problems = layout_problems(plan.layouts, shapes, available)
    if problems:
        # Named from the folder's side where the model can say what its own folder would hold (the
        # conversion's intermediate names mean little to whoever wrote the folder).
        try:
            named = folder_problems(adapter.export_layouts(args, shapes), available)
        except ValueError:  # the model cannot say what its own folder holds: name our side instead
            named = []
        named = named or _first("problems", problems)
        raise ConfigError(
            f"Hugging Face folder {folder} does not fit {what}: {'; '.join(named)}; conversion: {plan.conversion}"
        )
    read = {source for layout in plan.layouts.values() for source in layout.sources}
    unread = [name for name in available if name not in read]
    if unread and (not dist.is_initialized() or dist.get_rank() == 0):  # every rank finds the same
        logger.warning(
            "Hugging Face folder %s holds %d tensor%s that %s does not read, e.g. %s",
            folder,
            len(unread),
            "" if len(unread) == 1 else "s",
            what,
            unread[0],
        )
    return {name: plan.layouts[name] for name in shapes}
