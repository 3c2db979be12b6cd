"""LoRA adapters folded into the weights they adapt, W + alpha / rank * B A for every adapted
projection, and the model written that way as a plain Hugging Face folder: the factors merged in and
left out of the files, so transformers' from_pretrained, vLLM or any other reader loads the trained
model as an ordinary one. A model without adapters is written as `export_model_to_hf` writes it.

Adapted layers are `titan_tpu.models.common.lora.LoRALinear`s; their tensors are named in the state
dict as the model names them (`layers.0.attention.wq.weight`, `.lora_A`, `.lora_B`), whatever
wrappers activation checkpointing or compile put around the blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_tpu.checkpoint.hf_export import (
    DEFAULT_MAX_SHARD_BYTES,
    LORA_FACTORS,
    export_tensors_to_hf,
    exportable_state,
    gathered,
    is_lora_factor,
)
from titan_tpu.distributed.sharded_init import canonical_name
from titan_tpu.models.common.lora import LoRALinear, lora_layers
from titan_tpu.protocols.state_dict_adapter import StateDictAdapter

WEIGHT = ".weight"


def adapted_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapted projection, by the name its tensors carry in the state dict less `.weight`."""
    return {canonical_name(name): layer for name, layer in lora_layers(model)}


def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B A in float32 (the folder's writer casts to the export dtype): a bfloat16 product
    would lose the low bits of a small update."""
    return weight.float() + scaling * (lora_B.float() @ lora_A.float())


def _check_factors(state: Mapping[str, torch.Tensor], layers: Mapping[str, LoRALinear]) -> None:
    expected = {f"{path}.{factor}" for path in layers for factor in LORA_FACTORS}
    expected |= {path + WEIGHT for path in layers}
    found = {name for name in state if is_lora_factor(name)}
    missing = sorted(expected - set(state))
    strays = sorted(found - expected)
    if missing or strays:
        raise RuntimeError(
            f"LoRA merge: the state dict and the adapted layers disagree (missing {missing[:2]}, "
            f"factors of no adapted layer {strays[:2]})"
        )


def merged_state(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], Iterator[tuple[str, torch.Tensor]]]:
    """(the base tensors' shapes, an iterator of them whole with each adapted weight merged). Every
    rank iterates it in the same order: it gathers the shards of a sharded model."""
    state = exportable_state(model)
    layers = adapted_layers(model)
    _check_factors(state, layers)
    shapes = {name: tuple(value.shape) for name, value in state.items() if not is_lora_factor(name)}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in state.items():
            if is_lora_factor(name):
                continue  # gathered with the weight they adapt
            path = name.removesuffix(WEIGHT)
            if name.endswith(WEIGHT) and path in layers:
                lora_A, lora_B = gathered(state[f"{path}.lora_A"]), gathered(state[f"{path}.lora_B"])
                yield name, merged_weight(gathered(value), lora_A, lora_B, layers[path].scaling)
            else:
                yield name, gathered(value)

    return shapes, tensors()


def export_merged_to_hf(
    model: nn.Module,
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra_files: Mapping[str, Path] | None = None,
) -> Path | None:
    """The live (possibly sharded) model, adapters merged, as a Hugging Face folder; every rank calls
    it, rank 0 writes and gets the folder (None elsewhere). Never overwrites a non-empty `out`."""
    shapes, tensors = merged_state(model)
    return export_tensors_to_hf(tensors, shapes, out, adapter, args, dtype, max_shard_bytes, extra_files)


@torch.no_grad()
def merge_factors(model: nn.Module, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
    """Fold adapters read from elsewhere (a checkpoint's, by layer path -> (A, B)) into a plain,
    unsharded model's weights, in place."""
    params = dict(model.named_parameters())
    for path, (lora_A, lora_B) in factors.items():
        weight = params[path + WEIGHT]
        weight.copy_(merged_weight(weight, lora_A, lora_B, scaling))
