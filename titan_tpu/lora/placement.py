"""The adapters' factors on the tensor-parallel mesh, placed to match the projection they wrap.

torch's styles do not know LoRA: ColwiseParallel shards every parameter of an nn.Linear on dim 0, which
splits lora_A [r, in] by rank, and RowwiseParallel shards only weight and bias and replicates the rest,
so lora_A does not follow its input's split. DTensor would still compute the right values, by
redistributing inside every adapted layer on every step. After the family's plan has run, each factor
is placed from its weight's placement on the tp mesh:

    weight Shard(0) (column-wise, y split by output)  ->  lora_A Replicate, lora_B Shard(0)
    weight Shard(1) (row-wise, x split by input)      ->  lora_A Shard(1),  lora_B Replicate
    weight Replicate, or a plain tensor               ->  both as the weight is

so that DTensor's matmul rules give the low-rank term the base term's layout: column-wise,
x @ A^T is replicated and @ B^T comes out Shard(-1), as x @ W^T does; row-wise, x (Shard(-1)) @ A^T
is Partial and stays Partial through @ B^T, summed with the base's Partial by the style's own output
redistribution. The gradients follow: lora_A's Replicate gradient is summed over the group.

In a run this happens on `meta`, before FSDP wraps anything: the factors become fresh DTensors of the
full shapes, whose values come from the init after materialisation (titan_tpu/distributed/sharded_init.py).
On materialised tensors (a layer sharded by hand) their values are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from titan_tpu.models.common.lora import lora_layers

FACTORS = ("lora_A", "lora_B")


def factor_split_dim(factor: str, weight_split_dim: int | None) -> int | None:
    """The dimension tensor parallelism splits `factor` along, given the one it splits the wrapped
    weight along (None: not split). The one rule both the placement and the planner use."""
    if weight_split_dim == 0:
        return 0 if factor == "lora_B" else None
    if weight_split_dim == 1:
        return 1 if factor == "lora_A" else None
    return None


def factor_placements(factor: str, weight_placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """`factor`'s placements on the mesh whose placements for the weight are `weight_placements`."""
    placements: list[Placement] = []
    for placement in weight_placements:
        weight_dim = placement.dim if isinstance(placement, Shard) else None
        if weight_dim is not None and weight_dim < 0:
            weight_dim += 2
        dim = factor_split_dim(factor, weight_dim)
        if dim is None and weight_dim is None and not isinstance(placement, Replicate):
            raise ValueError(f"{factor}: no placement follows a weight placed {placement}")
        placements.append(Replicate() if dim is None else Shard(dim))
    return tuple(placements)


def place_factors(model: nn.Module) -> list[str]:
    """Re-place every LoRALinear's factors of `model` (on meta, after its TP plan) to match its weight;
    returns the names of the layers changed. A layer whose weight is a plain tensor keeps plain factors."""
    changed = []
    for name, layer in lora_layers(model):
        weight = layer.weight
        if not isinstance(weight, DTensor):
            continue
        for factor in FACTORS:
            param = layer._parameters[factor]
            assert param is not None  # a LoRALinear always has both factors
            wanted = factor_placements(factor, weight.placements)
            if isinstance(param, DTensor) and param.device_mesh == weight.device_mesh and param.placements == wanted:
                continue
            placed = distribute_tensor(_whole(param), weight.device_mesh, wanted, src_data_rank=None)
            layer.register_parameter(factor, nn.Parameter(placed, requires_grad=param.requires_grad))
            changed.append(name)
    return list(dict.fromkeys(changed))


def _whole(param: torch.Tensor) -> torch.Tensor:
    """The factor's full value on every rank (on meta, an empty tensor of its full shape)."""
    if param.is_meta:
        local = param.to_local() if isinstance(param, DTensor) else param
        return torch.empty(param.shape, dtype=local.dtype, device=local.device)
    return param.full_tensor().detach() if isinstance(param, DTensor) else param.detach()


@torch.no_grad()
def reset_adapters(model: nn.Module) -> None:
    """Every LoRALinear's factors to PEFT's start (A Kaiming-uniform, B = 0): called by the model's
    init, inside the layout-invariant draws, so every layout starts from the same adapters."""
    for _, layer in lora_layers(model):
        layer.reset_adapter()
