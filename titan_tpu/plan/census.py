"""Every parameter of the run's model, with the share of it one device stores under the run's layout.

The model is built on `meta` through the registry, exactly as the trainer builds it (no memory is
touched), and each parameter is classified by where it sits in the module tree:

- tensor parallel (tp > 1): the weights the family's TP plan (`ModelSpec.planning.tp_plan`, the styles its
  `parallelize` applies) shards column-wise or row-wise are split over tp along the dimension that
  style shards (`tp_split_dims`); everything else (norms, and whatever the plan leaves alone, such
  as Qwen 3 MoE's router and experts) is replicated over tp;
- expert parallel (ep > 1): every MoE layer's experts are split over ep on the expert dimension, then
  FSDP-sharded over dp_shard / ep on the first dimension that splits evenly, the expert dimension
  when it does (`titan_tpu.distributed.expert_parallel.expert_shard_dim`, the trainer's rule; a
  layout where none does is refused as the trainer refuses it);
- FSDP (dp > 1 or cp > 1): every other parameter is sharded over dp_shard (x cp: the cp ranks
  shard too, `ParallelDims.fsdp_shards`) on its first dimension, rounded up as FSDP2 pads uneven
  shards; dp_replicate replicates.

The FSDP units are the blocks the trainer shards one by one (`titan_tpu.distributed.parallelize.blocks`)
and the root, which holds the rest (embeddings, final norm, head).

With `lora.enable` the model is built with its adapters swapped in as the trainer swaps them
(titan_tpu/lora/apply.py): the base's parameters are frozen (`ParamShare.trainable`), and each factor
is split over tp by the rule that places it (titan_tpu/lora/placement.py `factor_split_dim`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.config.sections import LoRAConfig
from titan_tpu.distributed.expert_parallel import (
    expert_fsdp_refusal,
    expert_shard_dim,
    moe_experts,
    moe_layers,
    num_experts,
    validate_expert_parallel,
)
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.distributed.parallelize import block_containers, blocks
from titan_tpu.lora.apply import apply_lora
from titan_tpu.lora.placement import FACTORS, factor_split_dim
from titan_tpu.models.common.lora import lora_layers
from titan_tpu.models.registry import get_model_spec

ROOT = "root"


@dataclass(frozen=True)
class ParamShare:
    name: str
    numel: int  # whole parameter
    local_numel: int  # on the most loaded device
    tp_numel: int  # after tensor/expert parallelism, before FSDP: what an FSDP all-gather rebuilds
    unit: str  # FSDP unit: a block's name, the block's experts ("<block>.experts") or "root"
    fsdp_degree: int  # devices the FSDP unit is sharded over
    trainable: bool = True  # False: frozen (a LoRA run's base), no gradient and no optimizer state
    # Stored in the compute dtype rather than float32: a LoRA run's adapted linears' frozen weight and
    # bias (titan_tpu/lora/apply.py `base_dtype`).
    in_compute_dtype: bool = False

    @property
    def gathered_numel(self) -> int:
        """Elements an FSDP all-gather of it produces (and a reduce-scatter takes): FSDP2 pads every
        rank's shard to the largest (`local_numel` on the most loaded device), so the gathered
        buffer is degree x that shard, more than `tp_numel` wherever the dimension does not split
        evenly (a 1,024-row weight over 8,192 shards gathers 8,192 rows)."""
        return self.fsdp_degree * self.local_numel


@dataclass(frozen=True)
class Census:
    args: Any  # the model arguments the run builds
    params: tuple[ParamShare, ...]
    n_blocks: int

    @property
    def total(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def local(self) -> int:
        return sum(p.local_numel for p in self.params)

    @property
    def trained(self) -> tuple[ParamShare, ...]:
        """The parameters that get gradients and optimizer state (all but a LoRA run's frozen base)."""
        return tuple(p for p in self.params if p.trainable)

    def units(self) -> dict[str, list[ParamShare]]:
        grouped: dict[str, list[ParamShare]] = {}
        for param in self.params:
            grouped.setdefault(param.unit, []).append(param)
        return grouped


def run_model_args(config: TrainConfig) -> Any:
    """The flavor's arguments with the config's overrides and, for decoders, the run's sequence length
    (the language-model task sizes the rotary tables from training.seq_len)."""
    spec = get_model_spec(config.model.name)
    args = spec.args_for(config)
    if any(f.name == "max_seq_len" for f in dataclasses.fields(args)):
        args = dataclasses.replace(args, max_seq_len=config.training.seq_len)
    return args


# A LoRA run's adapters as a hashable key: (rank, alpha, target_modules).
AdapterKey = tuple[int, float, tuple[str, ...]]


@functools.lru_cache(maxsize=4)
def meta_model(name: str, args: Any, adapters: AdapterKey | None = None) -> nn.Module:
    """Built once per shape (and LoRA adapters, swapped in as the trainer swaps them): a plan only reads
    the module tree (tables of plans rebuild the same 405B model many times otherwise)."""
    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    if adapters is not None:
        rank, alpha, targets = adapters
        lora = LoRAConfig(enable=True, rank=rank, alpha=alpha, target_modules=list(targets))
        apply_lora(model, lora, block_containers(model), f"model {name}")
    return model


def build_on_meta(config: TrainConfig) -> tuple[nn.Module, Any]:
    args = run_model_args(config)
    lora = config.lora
    adapters = (lora.rank, lora.alpha, tuple(lora.target_modules)) if lora.enable else None
    return meta_model(config.model.name, args, adapters), args


def adapter_split_dims(model: nn.Module, weight_split: Mapping[str, int]) -> dict[str, int]:
    """Parameter name -> the dimension tensor parallelism splits it along, for every LoRA factor whose
    weight `weight_split` splits (the trainer's placement rule, titan_tpu/lora/placement.py)."""
    split: dict[str, int] = {}
    for path, _ in lora_layers(model):
        for factor in FACTORS:
            dim = factor_split_dim(factor, weight_split.get(f"{path}.weight"))
            if dim is not None:
                split[f"{path}.{factor}"] = dim
    return split


def tp_split_dims(model: nn.Module, styles: Mapping[str, Any]) -> dict[str, int]:
    """Parameter name -> the dimension tensor parallelism splits it along, for every parameter a
    plan's styles shard, by torch's rules: a column-wise Linear splits its output rows (weight and
    bias dim 0), a row-wise one its input columns (weight dim 1; the bias is replicated); on an
    Embedding column-wise splits the embedding dim (1), row-wise the vocabulary (0); a bare
    parameter's `Shard` placement names its dimension. Other styles (sequence parallel, replicated,
    input layouts) split no parameter."""
    split: dict[str, int] = {}
    for path, style in styles.items():
        if isinstance(style, Shard):
            split[path] = style.dim
            continue
        module = model.get_submodule(path)
        embedding = isinstance(module, nn.Embedding)
        if isinstance(style, ColwiseParallel):
            dims = {"weight": 1} if embedding else {"weight": 0, "bias": 0}
        elif isinstance(style, RowwiseParallel):
            dims = {"weight": 0} if embedding else {"weight": 1}
        else:
            continue
        for name, _ in module.named_parameters(recurse=False):
            if name in dims:
                split[f"{path}.{name}"] = dims[name]
    return split


def _split(shape: list[int], dim: int, degree: int, what: str) -> list[int]:
    if shape[dim] % degree:
        raise ConfigError(f"parallelism: {what} of size {shape[dim]} does not split over {degree} devices")
    return [size // degree if i == dim else size for i, size in enumerate(shape)]


def _fsdp_local(shape: list[int], dim: int, degree: int) -> int:
    rows = math.ceil(shape[dim] / degree)
    return rows * math.prod(shape) // shape[dim] if shape[dim] else 0


def census(config: TrainConfig, dims: ParallelDims) -> Census:
    """The model's parameters and one device's share of each under `dims`."""
    model, args = build_on_meta(config)
    tp_split: dict[str, int] = {}
    if dims.tp_enabled:
        plan = get_model_spec(config.model.name).planning.tp_plan
        if plan is None:
            raise ConfigError(f"model '{config.model.name}' has no tensor-parallel plan; set parallelism.tp = 1")
        parallelism = config.parallelism
        styles = plan.styles(model, dims.tp, parallelism.sequence_parallel, parallelism.loss_parallel)
        tp_split = tp_split_dims(model, styles)
        tp_split.update(adapter_split_dims(model, tp_split))
    block_ids = {id(block) for block in blocks(model)}
    block_names = [name for name, module in model.named_modules() if id(module) in block_ids]
    expert_params: set[int] = set()
    if dims.ep_enabled:
        spec = get_model_spec(config.model.name)
        experts = (
            spec.planning.expert_modules(model, dims.ep)
            if spec.planning.expert_modules
            else [moe_experts(m) for m in moe_layers(model)]
        )
        if not experts:
            raise ConfigError(
                f"parallelism.ep = {dims.ep}: model '{config.model.name}' has no experts; set parallelism.ep = 1"
            )
        validate_expert_parallel(dims, num_experts(experts[0]))
        expert_params = {id(p) for module in experts for p in module.parameters()}
    fsdp = dims.fsdp_shards if dims.fsdp_enabled else 1
    lora_base = {f"{path}.{name}" for path, _ in lora_layers(model) for name in ("weight", "bias")}
    shares: list[ParamShare] = []
    for name, param in model.named_parameters():
        unit = next((b for b in block_names if name.startswith(b + ".")), ROOT)
        shape = list(param.shape)
        if id(param) in expert_params:
            shape = _split(shape, 0, dims.ep, f"{name} (experts)")
            degree = dims.dp_shard // dims.ep if dims.fsdp_enabled else 1
            # The trainer's choice (expert_parallel.shard_experts), refused where it refuses.
            fsdp_dim = expert_shard_dim(shape, degree)
            if fsdp_dim is None:
                raise ConfigError(expert_fsdp_refusal(name, shape, degree, dims))
            shares.append(
                ParamShare(
                    name,
                    param.numel(),
                    _fsdp_local(shape, fsdp_dim, degree),
                    math.prod(shape),
                    f"{unit}.experts",
                    degree,
                    param.requires_grad,
                )
            )
            continue
        if name in tp_split:
            shape = _split(shape, tp_split[name], dims.tp, name)
        local = _fsdp_local(shape, 0, fsdp)
        shares.append(
            ParamShare(name, param.numel(), local, math.prod(shape), unit, fsdp, param.requires_grad, name in lora_base)
        )
    return Census(args, tuple(shares), len(block_names))
