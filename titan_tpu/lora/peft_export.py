"""LoRA adapters out as a PEFT folder, which `peft.PeftModel.from_pretrained(transformers_model, OUT)`
(and vLLM's LoRA loader) reads onto the base model:

    OUT/adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, target_modules (the
                                   Hugging Face module names), bias "none", task_type CAUSAL_LM, ...
    OUT/adapter_model.safetensors  base_model.model.<HF module>.lora_A.weight [r, in]
                                   base_model.model.<HF module>.lora_B.weight [out, r]

PEFT names an adapter by the path of its module in transformers' model. Where our model holds
transformers' own model (the hf family's, under `hf`), an adapted layer's path inside it is that name,
as PEFT's own save writes it. Elsewhere (Llama 3, Qwen 3) the modules come from the family's
state-dict adapter, as the full-weight export's tensors do (`StateDictAdapter.export_layouts`): each
folder weight made of one of our adapted weights is a selection of its rows and columns. A rename
selects all of them, a permutation reorders the rows, a fused projection of ours split into several
modules gives each a range of rows. Since (W + s B A)[rows, cols] = W[rows, cols] + s B[rows] A[:, cols],
that module's adapter is B's rows and A's columns, exactly (A repeated whole for each part of a row
split). A folder weight that mixes in another tensor (fused there with another projection) or
transposes ours has no such adapter and is refused: the merged export (`titan_tpu.lora.merge`) writes
any model.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_tpu.checkpoint.hf_export import (
    export_dtype,
    exportable_state,
    gathered,
    is_lora_factor,
    refuse_non_empty,
)
from titan_tpu.checkpoint.hf_format import TRANSFORMERS_FILES
from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.sharded_init import canonical_name
from titan_tpu.lora.merge import WEIGHT, adapted_layers
from titan_tpu.models.common.lora import LoRALinear
from titan_tpu.protocols.state_dict_adapter import Shapes, StateDictAdapter
from titan_tpu.protocols.tensor_layout import BlockLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's prefix for a causal LM's adapter tensors: PeftModelForCausalLM.base_model (the LoRA tuner)
# .model (the transformers model).
PEFT_PREFIX = "base_model.model."

Factors = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # layer path -> (A [r, in], B [out, r])


@dataclass(frozen=True)
class LoRASettings:
    """What every adapted layer shares: PEFT's r, lora_alpha and lora_dropout."""

    rank: int
    alpha: float
    dropout: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, layers: Mapping[str, LoRALinear]) -> LoRASettings:
        kinds = {cls(layer.rank, layer.alpha, layer.dropout) for layer in layers.values()}
        if len(kinds) != 1:
            first, other = sorted(kinds, key=str)[:2]
            raise ConfigError(
                f"export: a PEFT folder holds one rank, alpha and dropout; the adapters have {first} and {other}"
            )
        return kinds.pop()


@dataclass(frozen=True)
class ModuleSlice:
    """A Hugging Face module made of one adapted weight of ours: its output rows are our rows `rows`
    (B's rows), its input columns our columns `cols` (A's columns)."""

    module: str
    rows: torch.Tensor
    cols: torch.Tensor


def _rows_and_columns(hf_name: str, layout: BlockLayout, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of `weight`'s rows and columns the folder tensor `hf_name` holds, in its order."""
    if layout.sources != [weight]:
        others = [source for source in layout.sources if source != weight]
        raise ConfigError(
            f"export: {hf_name} holds {weight} fused with {others[0]}; a PEFT adapter cannot express that, "
            "export the model merged instead"
        )
    if len(layout.shape) != 2:
        raise ConfigError(f"export: {hf_name} is {list(layout.shape)}, not a [out, in] weight; export merged instead")
    picks = [torch.full((n,), -1, dtype=torch.long) for n in layout.shape]
    for piece in layout.pieces:
        if piece.axes != (0, 1):
            raise ConfigError(
                f"export: {hf_name} is {weight} transposed (PEFT's fan_in_fan_out); export the model merged instead"
            )
        for axis, pick in enumerate(picks):
            start, size = piece.offsets[axis], piece.sizes[axis]
            wanted = torch.arange(piece.source_offsets[axis], piece.source_offsets[axis] + size)
            given = pick[start : start + size]
            if ((given >= 0) & (given != wanted)).any():
                raise ConfigError(
                    f"export: {hf_name} is not a selection of {weight}'s rows and columns; export the model merged instead"
                )
            given.copy_(wanted)
    return picks[0], picks[1]


@dataclass(frozen=True)
class TransformersTree:
    """Where our model holds transformers' own model: its path in ours (`hf` in the hf family's, ""
    when ours is one) and the names of its modules, as PEFT names them."""

    root: str
    modules: list[str]

    def name_of(self, path: str) -> str | None:
        """PEFT's name of our module `path`, or None when it is not inside transformers' model."""
        if not self.root:
            return path
        return path.removeprefix(self.root + ".") if path.startswith(self.root + ".") else None


def transformers_tree(model: nn.Module) -> TransformersTree | None:
    """The outermost module of `model` that is a transformers model, recognised as PEFT recognises one
    (a `config` with a `model_type`), with its modules' names; None when there is none."""
    for name, module in model.named_modules():
        if hasattr(getattr(module, "config", None), "model_type"):
            # A wrapper's name ends the path when compile or checkpointing wrapped the model itself.
            root = canonical_name(name + ".").removesuffix(".") if name else ""
            names = [canonical_name(inner) for inner, _ in module.named_modules() if inner]
            return TransformersTree(root, list(dict.fromkeys(names)))
    return None


def module_slices(
    adapter: StateDictAdapter,
    args: Any,
    base_shapes: Shapes,
    adapted: Iterable[str],
    tree: TransformersTree | None = None,
) -> tuple[dict[str, list[ModuleSlice]], list[str]]:
    """(per adapted layer path, the Hugging Face modules made of its weight; the names of the modules
    PEFT will match target_modules against). `base_shapes` are the model's tensors without the
    factors, as the full-weight export hands them to the adapter; `tree` is where ours holds
    transformers' own model, if it does."""
    if adapter.weights_stem != TRANSFORMERS_FILES.stem:
        raise ConfigError(
            f"export: a PEFT folder here is a transformers causal LM's adapter; this model's folders are "
            f"{adapter.weights_stem}.safetensors (diffusers), so export it merged instead"
        )
    slices: dict[str, list[ModuleSlice]] = {}
    weights: dict[str, str] = {}
    for path in adapted:
        name = tree.name_of(path) if tree is not None else None
        if name is None:
            weights[path + WEIGHT] = path
            continue
        out, inputs = base_shapes[path + WEIGHT]
        slices[path] = [ModuleSlice(name, torch.arange(out), torch.arange(inputs))]
    modules = list(tree.modules) if tree is not None else []
    if not weights:
        return slices, modules
    layouts = adapter.export_layouts(args, base_shapes)
    slices.update({path: [] for path in weights.values()})
    for hf_name, layout in layouts.items():
        for source in layout.sources:
            if source not in weights:
                continue
            if not hf_name.endswith(WEIGHT):
                raise ConfigError(f"export: {source} is written as {hf_name}, not a module's weight; export merged")
            rows, cols = _rows_and_columns(hf_name, layout, source)
            slices[weights[source]].append(ModuleSlice(hf_name.removesuffix(WEIGHT), rows, cols))
    unwritten = [path for path, parts in slices.items() if not parts]
    if unwritten:
        raise ConfigError(
            f"export: {unwritten[0]}.weight is in no Hugging Face tensor; nothing to attach its adapter to"
        )
    modules += [name.removesuffix(WEIGHT) for name in layouts if name.endswith(WEIGHT)]
    return slices, list(dict.fromkeys(modules))


def target_modules(adapted: Iterable[str], modules: Iterable[str]) -> list[str]:
    """PEFT's target_modules naming exactly `adapted`, in the folder's order (`modules`): a module's
    last name where every module of the folder that ends so is adapted (PEFT matches a plain name as a
    suffix), else the full names."""
    chosen = set(adapted)
    by_last: dict[str, list[str]] = {}
    for module in modules:
        by_last.setdefault(module.rpartition(".")[2], []).append(module)
    targets: list[str] = []
    for last, named in by_last.items():
        picked = [module for module in named if module in chosen]
        targets += [last] if picked == named else picked
    return targets


def peft_tensors(slices: Mapping[str, list[ModuleSlice]], factors: Factors) -> dict[str, torch.Tensor]:
    """The adapter file's tensors from our factors (whole, on the CPU)."""
    tensors: dict[str, torch.Tensor] = {}
    for path, parts in slices.items():
        lora_A, lora_B = factors[path]
        for part in parts:
            tensors[f"{PEFT_PREFIX}{part.module}.lora_A.weight"] = lora_A[:, part.cols]
            tensors[f"{PEFT_PREFIX}{part.module}.lora_B.weight"] = lora_B[part.rows]
    return tensors


def adapter_config(settings: LoRASettings, targets: list[str], base_model: str | None) -> dict[str, Any]:
    """adapter_config.json: PEFT's LoraConfig fields that say what the tensors mean (plain LoRA, scaled
    by alpha / r, no bias, no DoRA, weights [out, in]); PEFT fills in the rest with its defaults."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_peft_folder(
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    base_shapes: Shapes,
    factors: Factors,
    settings: LoRASettings,
    base_model: str | None = None,
    dtype: str | torch.dtype = "float32",
    tree: TransformersTree | None = None,
) -> Path:
    """One process: whole factors (layer path -> (A, B)) as a PEFT folder, written under a temporary
    name and renamed when complete; a non-empty `out` is refused. `tree`: where the model the factors
    belong to holds transformers' own model (`transformers_tree`), if it does."""
    out = Path(out)
    refuse_non_empty(out)
    slices, modules = module_slices(adapter, args, base_shapes, factors, tree)
    return _write(out, slices, modules, factors, settings, base_model, dtype)


def _write(
    out: Path,
    slices: Mapping[str, list[ModuleSlice]],
    modules: list[str],
    factors: Factors,
    settings: LoRASettings,
    base_model: str | None,
    dtype: str | torch.dtype,
) -> Path:
    from safetensors.torch import save_file

    target = export_dtype(dtype)
    tensors = {name: t.detach().to("cpu", target).contiguous() for name, t in peft_tensors(slices, factors).items()}
    adapted = [part.module for parts in slices.values() for part in parts]
    config = adapter_config(settings, target_modules(adapted, modules), base_model)
    temp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    temp.mkdir(parents=True)
    try:
        save_file(tensors, str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked before
        temp.rename(out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out


def export_peft_adapter(
    model: nn.Module,
    out: str | Path,
    adapter: StateDictAdapter,
    args: Any,
    base_model: str | None = None,
    dtype: str | torch.dtype = "float32",
) -> Path | None:
    """The live (possibly sharded) model's adapters as a PEFT folder. Every rank calls it (the factors
    are gathered); rank 0 writes and gets the folder, None elsewhere. `base_model` goes into
    adapter_config.json's base_model_name_or_path (the run's checkpoint.initial_load_path, a hub id)."""
    out = Path(out)
    refuse_non_empty(out)  # on every rank, so none is left waiting in a gather
    layers = adapted_layers(model)
    if not layers:
        raise ConfigError("export: the model has no LoRA adapters to write as a PEFT folder")
    settings = LoRASettings.of(layers)
    state = exportable_state(model)
    base_shapes = {name: tuple(value.shape) for name, value in state.items() if not is_lora_factor(name)}
    # On every rank, so that a refusal stops all of them.
    slices, modules = module_slices(adapter, args, base_shapes, layers, transformers_tree(model))
    distributed = dist.is_available() and dist.is_initialized()
    writes = not distributed or dist.get_rank() == 0
    factors = {}
    for path in layers:  # the same order on every rank
        lora_A, lora_B = gathered(state[f"{path}.lora_A"]), gathered(state[f"{path}.lora_B"])
        if writes:
            factors[path] = (lora_A.cpu(), lora_B.cpu())
    result = _write(out, slices, modules, factors, settings, base_model, dtype) if writes else None
    if distributed:
        dist.barrier()
    return result
