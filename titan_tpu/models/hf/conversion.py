"""transformers' own checkpoint conversion, run on layouts instead of weights.

A folder that transformers saves (and the Hub publishes) holds a model's tensors under the
checkpoint's names, which are not always the runtime modules' names: Mixtral's experts are
`block_sparse_moe.experts.K.w1.weight` one per expert, its runtime module one fused
`mlp.experts.gate_up_proj`. transformers converts on `from_pretrained` and back on `save_pretrained`
(`transformers.conversion_mapping`, `transformers.core_model_loading`): renames, then converters made
of ops (MergeModulelist, Concatenate, Chunk, Split, Transpose, ...) that call torch's stack, cat,
chunk, split and transpose.

Here those same converters run on `LayoutTensor`s: meta tensors that carry a `BlockLayout` (which block of
which source each element comes from) and answer torch's ops by moving layouts, not values. So the
result is, for every runtime tensor, where its elements lie in the folder, from the headers alone;
each rank then reads only the blocks its shard holds (titan_tpu/checkpoint/hf_import.py). An op that
changes values or reshapes across blocks (a dequantisation, an interleave) has no layout; such a
folder is refused naming the op.

Not all of it is transformers' documented surface (`WeightConverter` and the ops are; the loop that
renames and groups checkpoint keys is its loader's own): `transformers_conversion` imports those names
and says so in one line if an installed transformers lacks them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from titan_tpu.protocols.state_dict_adapter import ImportPlan, Shapes
from titan_tpu.protocols.tensor_layout import BlockLayout

if TYPE_CHECKING:  # transformers is imported where a model is built
    from transformers import PreTrainedModel


class NoLayout(Exception):
    """An op of the conversion moves values in a way a layout cannot describe."""


def _chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    step = -(-size // chunks)  # torch.chunk: ceil-sized chunks, possibly fewer than asked
    return [(start, min(step, size - start)) for start in range(0, size, step)] if size else [(0, 0)]


def _split_bounds(size: int, split: int | list[int]) -> list[tuple[int, int]]:
    if isinstance(split, int):
        return [(start, min(split, size - start)) for start in range(0, size, split)]
    starts = [sum(split[:i]) for i in range(len(split))]
    if sum(split) != size:  # as torch.split refuses it: the folder's tensor does not fit
        raise ValueError(f"split sizes {split} do not add up to {size}")
    return list(zip(starts, split))


def _dim(args: tuple, kwargs: dict, position: int, default: int = 0) -> int:
    return int(kwargs.get("dim", args[position] if len(args) > position else default))


class LayoutTensor(torch.Tensor):
    """A `meta` tensor of a layout's shape; torch's ops on it return LayoutTensors whose layout
    says where their elements come from."""

    source_layout: BlockLayout

    @staticmethod
    def of(layout: BlockLayout) -> LayoutTensor:
        tensor = torch.Tensor._make_subclass(LayoutTensor, torch.empty(layout.shape, device="meta"))
        tensor.source_layout = layout
        return tensor

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if getattr(func, "__name__", "") in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise NoLayout(getattr(func, "__qualname__", repr(func)))


def _layouts(tensors: Any) -> list[BlockLayout]:
    if not all(isinstance(t, LayoutTensor) for t in tensors):
        raise NoLayout("an op mixes converted tensors with others")
    return [t.source_layout for t in tensors]


def _stack(tensors: Any, *args: Any, **kwargs: Any) -> LayoutTensor:
    return LayoutTensor.of(BlockLayout.stack(_layouts(tensors), _dim(args, kwargs, 0)))


def _cat(tensors: Any, *args: Any, **kwargs: Any) -> LayoutTensor:
    return LayoutTensor.of(BlockLayout.cat(_layouts(tensors), _dim(args, kwargs, 0)))


def _pieces(tensor: LayoutTensor, dim: int, bounds: list[tuple[int, int]]) -> tuple[LayoutTensor, ...]:
    return tuple(LayoutTensor.of(tensor.source_layout.narrow(dim, start, length)) for start, length in bounds)


def _chunk(tensor: LayoutTensor, chunks: int, *args: Any, **kwargs: Any) -> tuple[LayoutTensor, ...]:
    dim = _dim(args, kwargs, 0)  # negative dims index the shape and narrow as torch's do
    return _pieces(tensor, dim, _chunk_bounds(tensor.source_layout.shape[dim], int(chunks)))


def _split(tensor: LayoutTensor, split: Any, *args: Any, **kwargs: Any) -> tuple[LayoutTensor, ...]:
    dim = _dim(args, kwargs, 0)
    sizes = split if isinstance(split, int) else [int(n) for n in split]
    return _pieces(tensor, dim, _split_bounds(tensor.source_layout.shape[dim], sizes))


def _transpose(tensor: LayoutTensor, *args: Any, **kwargs: Any) -> LayoutTensor:
    dim0 = int(kwargs.get("dim0", args[0] if args else 0))
    dim1 = int(kwargs.get("dim1", args[1] if len(args) > 1 else 1))
    return LayoutTensor.of(tensor.source_layout.transpose(dim0, dim1))


def _squeeze(tensor: LayoutTensor, *args: Any, **kwargs: Any) -> LayoutTensor:
    if not args and "dim" not in kwargs:
        layout = tensor.source_layout
        for dim in reversed(range(len(layout.shape))):
            layout = layout.squeeze(dim)
        return LayoutTensor.of(layout)
    return LayoutTensor.of(tensor.source_layout.squeeze(_dim(args, kwargs, 0)))


def _unsqueeze(tensor: LayoutTensor, *args: Any, **kwargs: Any) -> LayoutTensor:
    return LayoutTensor.of(tensor.source_layout.unsqueeze(_dim(args, kwargs, 0)))


def _same(tensor: LayoutTensor, *args: Any, **kwargs: Any) -> LayoutTensor:
    return tensor


_HANDLERS: dict[Callable[..., Any], Callable[..., Any]] = {
    torch.stack: _stack,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.concatenate: _cat,
    torch.chunk: _chunk,
    torch.Tensor.chunk: _chunk,
    torch.split: _split,
    torch.Tensor.split: _split,
    torch.transpose: _transpose,
    torch.Tensor.transpose: _transpose,
    torch.squeeze: _squeeze,
    torch.Tensor.squeeze: _squeeze,
    torch.unsqueeze: _unsqueeze,
    torch.Tensor.unsqueeze: _unsqueeze,
    torch.Tensor.contiguous: _same,
    torch.Tensor.detach: _same,
}
# Reads of a tensor's metadata, answered by the meta tensor itself (property reads arrive as `__get__`).
_METADATA = {"__get__", "size", "dim", "numel", "__len__", "is_contiguous", "element_size", "__repr__"}


def transformers_conversion() -> Any:
    """transformers' loader module, checked for what this file uses of it."""
    from transformers import core_model_loading

    needed = ("WeightConverter", "WeightRenaming", "rename_source_key", "dot_natural_key", "revert_weight_conversion")
    lacking = [name for name in needed if not hasattr(core_model_loading, name)]
    if lacking:
        raise ImportError(
            f"transformers.core_model_loading has no {', '.join(lacking)}; the hf family reads checkpoint "
            "folders through transformers 5.x's conversion"
        )
    return core_model_loading


def describe(mapping: list[Any], model_type: str) -> str:
    """One line for messages: which conversion was applied."""
    loading = transformers_conversion()
    ops = sorted({type(op).__name__ for t in mapping if isinstance(t, loading.WeightConverter) for op in t.operations})
    renames = sum(isinstance(t, loading.WeightRenaming) for t in mapping)
    if not ops and not renames:
        return f"none (transformers converts no {model_type} checkpoint names)"
    parts = [f"{renames} renamings"] if renames else []
    if ops:
        parts.append(f"converters with {', '.join(ops)}")
    return f"transformers' {model_type} checkpoint conversion ({'; '.join(parts)})"


def _mapping(model: PreTrainedModel, add_legacy: bool) -> list[Any]:
    from transformers.conversion_mapping import get_model_conversion_mapping

    # A fresh list each time: the transforms collect tensors and remember what they matched.
    return list(get_model_conversion_mapping(model, add_legacy=add_legacy))


def import_plan(model: PreTrainedModel, available: Shapes, prefix: str = "") -> ImportPlan:
    """`model`'s runtime tensors (named `prefix` + transformers' name) as layouts over a folder's
    tensors `available`, grouped and converted as transformers' loader does."""
    loading = transformers_conversion()
    mapping = _mapping(model, add_legacy=True)
    renamings = [t for t in mapping if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, loading.WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    runtime: dict[str, Any] = {name: True for name in model.state_dict()}
    base = getattr(model, "base_model_prefix", None)
    groups: dict[str, Any] = {}
    for key in sorted(available, key=loading.dot_natural_key):
        name, pattern = loading.rename_source_key(key, renamings, converters, base, runtime)
        if name not in runtime and key in runtime:
            name, pattern = loading.rename_source_key(key, [], [], base, runtime)
        if name not in runtime:
            continue  # not read; the caller names it
        if pattern is not None:
            transform = groups.setdefault(name, copy.deepcopy(by_pattern[pattern]))
        else:
            transform = groups.setdefault(name, loading.WeightRenaming(key, name))
            pattern = key
        transform.add_tensor(name, key, pattern, LayoutTensor.of(BlockLayout.whole(key, available[key])))
    layouts: dict[str, BlockLayout] = {}
    for first, transform in groups.items():
        try:
            converted = transform.convert(first, model=model, config=model.config)
        except NoLayout as e:
            raise ValueError(f"transformers converts {first} with an op that has no layout here ({e})") from None
        except (ValueError, RuntimeError, IndexError):
            continue  # the folder's tensors do not combine (one missing, one misshapen): named by the caller
        for name, value in converted.items():
            value = value[0] if isinstance(value, list) else value
            if not isinstance(value, LayoutTensor):
                raise ValueError(f"transformers' conversion of {first} gave a {type(value).__name__}, not a layout")
            layouts[prefix + name] = value.source_layout
    return ImportPlan(layouts, describe(mapping, model.config.model_type))


def export_layouts(
    model: PreTrainedModel, shapes: Mapping[str, tuple[int, ...]], prefix: str = ""
) -> dict[str, BlockLayout]:
    """The tensors transformers' save_pretrained writes for `model`, as layouts over its runtime
    tensors `shapes` (named `prefix` + transformers' name), by transformers' own reverse conversion."""
    loading = transformers_conversion()
    state = {
        name.removeprefix(prefix): LayoutTensor.of(BlockLayout.whole(name, shape))
        for name, shape in shapes.items()
        if name.startswith(prefix)
    }
    try:
        saved = loading.revert_weight_conversion(model, state)
    except NoLayout as e:
        raise ValueError(f"transformers' reverse conversion uses an op that has no layout here ({e})") from None
    layouts: dict[str, BlockLayout] = {}
    for name, value in saved.items():
        if not isinstance(value, LayoutTensor):
            raise ValueError(f"transformers' reverse conversion of {name} gave a {type(value).__name__}, not a layout")
        layouts[name] = value.source_layout
    return layouts
