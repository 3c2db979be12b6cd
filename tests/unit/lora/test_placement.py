"""The adapters' factors on a tensor-parallel mesh (titan_tpu/lora/placement.py), in a fake 16-rank world
(collectives are no-ops, so this checks placements and communication, not values; the values of a
sharded layer against one process are checked in tests/distributed/test_lora.py).

What must hold: after torch's styles, each factor is placed by its weight's placement, and the adapter
term then needs no collective of its own in forward (DTensor would otherwise redistribute to make the
product valid: correct values, extra communication on every layer and step), with the base term's
layout (column-wise Shard(-1), row-wise Partial) so the two add without one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_tpu.distributed.tensor_parallel import ReplicateParallel
from titan_tpu.lora.placement import factor_placements, factor_split_dim, place_factors
from titan_tpu.models.common.lora import LoRALinear


def tp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (8, 2), mesh_dim_names=("dp", "tp"))["tp"]


def adapted(out_features: int, in_features: int) -> LoRALinear:
    layer = LoRALinear.wrapping(nn.Linear(in_features, out_features), rank=4, alpha=8.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_A.normal_()
        layer.lora_B.normal_()
    return layer


def model() -> nn.ModuleDict:
    return nn.ModuleDict({"up": adapted(16, 8), "down": adapted(8, 16), "same": adapted(8, 8)})


def plan(model: nn.Module, mesh: DeviceMesh) -> None:
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(), "same": ReplicateParallel()})


def placements(layer: nn.Module) -> dict[str, tuple[object, ...]]:
    return {name: tuple(p.placements) for name, p in layer.named_parameters() if isinstance(p, DTensor)}


def test_the_rule(fake_world: int) -> None:
    assert [factor_split_dim(f, d) for f in ("lora_A", "lora_B") for d in (0, 1, None)] == [
        None,
        1,
        None,
        0,
        None,
        None,
    ]
    assert factor_placements("lora_A", (Shard(0), Replicate())) == (Replicate(), Replicate())
    assert factor_placements("lora_B", (Replicate(), Shard(0))) == (Replicate(), Shard(0))
    with pytest.raises(ValueError, match="no placement follows"):
        factor_placements("lora_A", (Partial(),))


def test_factors_follow_their_weight_and_stay_frozen_or_trained(fake_world: int) -> None:
    """Catches torch's colwise split of lora_A by rank and rowwise's factors left replicated beside a
    weight split by input; the base stays frozen and the factors trained through the re-wrapping."""
    layers = model()
    plan(layers, tp_mesh())
    assert placements(layers["up"])["lora_A"] == (Shard(0),)  # what ColwiseParallel does to every parameter
    assert placements(layers["down"])["lora_A"] == (Replicate(),)  # RowwiseParallel splits only weight and bias
    assert sorted(place_factors(layers)) == ["down", "up"]
    assert placements(layers["up"]) == {
        "weight": (Shard(0),),
        "bias": (Shard(0),),
        "lora_A": (Replicate(),),
        "lora_B": (Shard(0),),
    }
    assert placements(layers["down"]) == {
        "weight": (Shard(1),),
        "bias": (Replicate(),),
        "lora_A": (Shard(1),),
        "lora_B": (Replicate(),),
    }
    assert set(placements(layers["same"]).values()) == {(Replicate(),)}
    for layer in layers.values():
        assert not layer.weight.requires_grad and layer.lora_A.requires_grad and layer.lora_B.requires_grad
    assert place_factors(layers) == []  # placed once: nothing to change the second time


def _collectives(layers: nn.Module, x: torch.Tensor) -> int:
    with CommDebugMode() as comm:
        out = layers["down"](layers["up"](x))
    out.sum()  # waits for the output's collective (a no-op in the fake world), as any use would
    return comm.get_total_counts()


def test_the_adapter_term_has_the_base_terms_layout_and_no_collective(fake_world: int) -> None:
    mesh = tp_mesh()
    layers = model()
    plan(layers, mesh)
    place_factors(layers)
    x = torch.randn(2, 3, 8)
    base = model()
    for layer in base.values():  # the same base, no adapter term
        layer.adapter_enabled = False
    plan(base, mesh)
    place_factors(base)
    # The row-wise layer's all-reduce of its Partial output is the only collective, with or without adapters.
    assert _collectives(layers, x) == _collectives(base, x) == 1
    up, down = layers["up"], layers["down"]
    x_up = distribute_tensor(x, mesh, [Replicate()])
    assert (
        F.linear(x_up, up.weight).placements == F.linear(F.linear(x_up, up.lora_A), up.lora_B).placements == (Shard(2),)
    )
    x_down = distribute_tensor(torch.randn(2, 3, 16), mesh, [Shard(2)])
    low_rank = F.linear(F.linear(x_down, down.lora_A), down.lora_B)
    assert F.linear(x_down, down.weight).placements == low_rank.placements == (Partial(),)


def test_negative_control_a_factor_split_by_rank_needs_collectives(fake_world: int) -> None:
    """lora_A left as ColwiseParallel made it (Shard(0), its rank split): the adapter term gathers."""
    layers = model()
    plan(layers, tp_mesh())
    place_factors(layers)
    up = layers["up"]
    up.lora_A = nn.Parameter(distribute_tensor(up.lora_A.full_tensor().detach(), up.lora_A.device_mesh, [Shard(0)]))
    assert _collectives(layers, torch.randn(2, 3, 8)) > 1
