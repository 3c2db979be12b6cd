"""Offline conversion between Hugging Face folders and titan_tpu checkpoints (one process, no GPU).

    # HF -> checkpoint: writes <checkpoint folder>/step-0 (weights only). A run with that folder and
    # --checkpoint.enable starts from these weights at step 0.
    python scripts/convert_checkpoint.py hf-to-dcp HF_FOLDER --config llama3_8b
    python scripts/convert_checkpoint.py hf-to-dcp HF_FOLDER --checkpoint DIR --model llama3 --flavor 8B

    # checkpoint -> HF: the newest complete step (or --step N); loads with
    # transformers.AutoModelForCausalLM.from_pretrained(HF_OUT).
    python scripts/convert_checkpoint.py dcp-to-hf HF_OUT --config llama3_8b [--step N] [--dtype bfloat16]
    python scripts/convert_checkpoint.py dcp-to-hf HF_OUT --checkpoint DIR --model llama3 --flavor 8B

    # A LoRA run's checkpoint (its adapters only): as a PEFT folder, which
    # peft.PeftModel.from_pretrained(base_model, PEFT_OUT) loads onto the base; or, with dcp-to-hf,
    # merged into the base of checkpoint.initial_load_path as a plain Hugging Face folder.
    python scripts/convert_checkpoint.py dcp-to-peft PEFT_OUT --config NAME [--step N] [--dtype bfloat16]
    python scripts/convert_checkpoint.py dcp-to-hf HF_OUT --config NAME [--step N]

Every model with a Hugging Face adapter converts the same way (--model llama3, qwen3, qwen3_moe,
flux); Qwen 3 MoE's per-expert HF tensors (`mlp.experts.K.*_proj.weight`) become one stacked tensor per
projection in the checkpoint and are split again on the way out. FLUX.1 reads a diffusers transformer
folder (a pipeline's `transformer/`: `diffusion_pytorch_model*.safetensors`) and writes one that
`diffusers.FluxTransformer2DModel.from_pretrained(HF_OUT)` loads:

    python scripts/convert_checkpoint.py dcp-to-hf HF_OUT --config flux_debug

With --config NAME (a train config, plus any --section.key=value overrides), the checkpoint
folder is <job.dump_folder>/<checkpoint.folder>, the model is [model] name/flavor and the export dtype
is checkpoint.export_dtype; --checkpoint, --model, --flavor and --dtype override them. With --config,
dcp-to-hf also copies the tokenizer (data.tokenizer's folder: tokenizer.json, tokenizer_config.json,
generation_config.json, ...; data.chat_template as chat_template.jinja), so a fine-tuned folder loads
in transformers with its chat template and chats.
hf-to-dcp holds the whole model in float32 host memory; dcp-to-hf reads about one output shard at a time.

LoRA conversions need the run's --config: its [lora] section and checkpoint.initial_load_path, checked
against what the checkpoint recorded as a resume checks them. The merged dcp-to-hf holds the whole
base in float32 host memory, as hf-to-dcp does; a run without initial_load_path trained on the model's
seeded random init, which no folder holds, so it has no merged export (dcp-to-peft writes its adapters).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

from titan_tpu.checkpoint import CheckpointManager, layout  # noqa: E402
from titan_tpu.checkpoint.hf_export import (  # noqa: E402
    checkpoint_model_tensors,
    export_checkpoint_to_hf,
    export_model_to_hf,
    is_lora_factor,
    read_checkpoint_model_tensors,
    refuse_non_empty,
)
from titan_tpu.checkpoint.hf_format import tied_repeats  # noqa: E402
from titan_tpu.checkpoint.hf_import import check_hf_config, load_hf_weights  # noqa: E402
from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.config.sections import CheckpointConfig  # noqa: E402
from titan_tpu.data.chat_tokenizer import tokenizer_export_files  # noqa: E402
from titan_tpu.device.dtype import DTYPES  # noqa: E402
from titan_tpu.lora.merge import merge_factors  # noqa: E402
from titan_tpu.lora.peft_export import (  # noqa: E402
    Factors,
    LoRASettings,
    transformers_tree,
    write_peft_folder,
)
from titan_tpu.metrics.progress import Progress  # noqa: E402
from titan_tpu.models.registry import get_model_spec  # noqa: E402
from titan_tpu.training.registered_names import check_registered_names  # noqa: E402
from titan_tpu.training.resume_settings import check_lora_base  # noqa: E402


def _spec_and_args(model: str, flavor: str, config: Any | None):  # type: ignore[no-untyped-def]
    """The family and its arguments: from the loaded config (its [model] overrides applied; the hf
    family reads its architecture from [hf]), or from --model and --flavor alone."""
    try:
        spec = get_model_spec(model)
        if config is not None and (config.model.name, config.model.flavor) == (model, flavor):
            args = spec.args_for(config)
        elif spec.args_from_config is not None:
            raise ConfigError(f"model {model}: its config sections name the model; give --config, not --model/--flavor")
        else:
            args = spec.flavor(flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if spec.state_dict_adapter is None:
        raise ConfigError(f"model {model} has no Hugging Face adapter")
    return spec, args


def hf_to_dcp(hf_folder: Path, checkpoint_folder: Path, model: str, flavor: str, config: Any | None) -> Path:
    spec, args = _spec_and_args(model, flavor, config)
    what = f"model {model} flavor {flavor}"
    check_hf_config(hf_folder, spec.state_dict_adapter, args, what)  # before allocating anything
    if layout.step_dir(checkpoint_folder, 0).exists():
        raise ConfigError(f"{layout.step_dir(checkpoint_folder, 0)} exists; it is never overwritten")
    with torch.device("meta"):
        module = spec.model_cls(args)
    module.to_empty(device="cpu")  # every weight is overwritten by the load; no init needed
    reading = Progress.starter("loading Hugging Face weights", "files")
    load_hf_weights(module, hf_folder, spec.state_dict_adapter, args, what=what, progress=reading)
    cfg = CheckpointConfig(enable=True, folder=checkpoint_folder.name)
    manager = CheckpointManager(cfg, checkpoint_folder.parent, model=module)
    manager.save(0, model_only=True)
    manager.close()
    return layout.step_dir(checkpoint_folder, 0)


def _step_folder(checkpoint_folder: Path, step: int | None) -> Path:
    """The newest complete step folder, or step `step`'s."""
    steps = layout.complete_steps(checkpoint_folder)
    if not steps:
        raise ConfigError(f"{checkpoint_folder}: no complete checkpoint (step-N folder with a manifest)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"--step {step}: not complete in {checkpoint_folder}; complete steps: {steps}")
    return layout.step_dir(checkpoint_folder, step)


def dcp_to_hf(
    checkpoint_folder: Path,
    out: Path,
    model: str,
    flavor: str,
    step: int | None,
    dtype: str,
    max_shard_bytes: int,
    tokenizer_files: dict[str, Path],
    config: Any | None,
) -> Path:
    spec, args = _spec_and_args(model, flavor, config)
    step_folder = _step_folder(checkpoint_folder, step)
    # What the folder holds from its metadata: either conversion checks every file's CRC-32 once.
    if any(is_lora_factor(name) for name in checkpoint_model_tensors(step_folder, data_files=False)):
        return _merged_lora_to_hf(step_folder, out, spec, args, dtype, max_shard_bytes, tokenizer_files, config)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in spec.model_cls(args).state_dict().items()}
    return export_checkpoint_to_hf(
        step_folder,
        out,
        spec.state_dict_adapter,
        args,
        shapes,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        progress=Progress.starter(f"writing Hugging Face folder {out}", "tensors"),
        extra_files=tokenizer_files,
    )


def _lora_run(step_folder: Path, config: Any | None, direction: str) -> tuple[Any, LoRASettings]:
    """The run's config, which a LoRA conversion needs, and its adapters' rank, alpha and dropout,
    checked against the checkpoint's record as a resume checks them (the same lora settings and base)."""
    if config is None:
        raise ConfigError(
            f"{direction}: {step_folder} holds LoRA adapters; give the run's --config NAME (its [lora] section and base)"
        )
    check_lora_base(str(step_folder), layout.read_manifest(step_folder).get("run_settings"), config)
    return config, LoRASettings(config.lora.rank, config.lora.alpha, config.lora.dropout)


def _base_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The flavor's tensors (of its model built on meta), as the live export hands them to the adapter:
    a tied head once."""
    repeats = tied_repeats(module)
    return {name: tuple(p.shape) for name, p in module.state_dict().items() if name not in repeats}


def _adapter_tensors(step_folder: Path, direction: str) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's LoRA factors (`<layer>.lora_A`, `.lora_B`) by name; refused when there are none."""
    tensors = {name: md for name, md in checkpoint_model_tensors(step_folder).items() if is_lora_factor(name)}
    if not tensors:
        raise ConfigError(
            f"{direction}: {step_folder} holds no LoRA adapters (no lora_A / lora_B tensors); dcp-to-hf converts it"
        )
    return tensors


def _read_factors(
    step_folder: Path,
    tensors: dict[str, TensorStorageMetadata],
    base_shapes: dict[str, tuple[int, ...]],
    rank: int,
    direction: str,
) -> Factors:
    """The adapters by layer path, (A [rank, in], B [out, rank]) of a weight of the flavor each."""
    paths = sorted({name.rsplit(".", 1)[0] for name in tensors})
    for path in paths:
        weight = base_shapes.get(f"{path}.weight")
        a, b = tensors.get(f"{path}.lora_A"), tensors.get(f"{path}.lora_B")
        if weight is None or a is None or b is None or len(weight) != 2:
            raise ConfigError(
                f"{direction}: {step_folder}'s adapter {path} does not fit the flavor (no such linear, or A or B missing)"
            )
        want_a, want_b = (rank, weight[1]), (weight[0], rank)
        if (tuple(a.size), tuple(b.size)) != (want_a, want_b):
            raise ConfigError(
                f"{direction}: {path}'s adapter is A {list(a.size)}, B {list(b.size)}; lora.rank and the flavor "
                f"give A {list(want_a)}, B {list(want_b)}"
            )
    read = read_checkpoint_model_tensors(step_folder, tensors)
    return {path: (read[f"{path}.lora_A"], read[f"{path}.lora_B"]) for path in paths}


def dcp_to_peft(
    checkpoint_folder: Path, out: Path, model: str, flavor: str, step: int | None, dtype: str, config: Any | None
) -> Path:
    spec, args = _spec_and_args(model, flavor, config)
    refuse_non_empty(out)
    step_folder = _step_folder(checkpoint_folder, step)
    tensors = _adapter_tensors(step_folder, "dcp-to-peft")
    run, settings = _lora_run(step_folder, config, "dcp-to-peft")
    with torch.device("meta"):
        module = spec.model_cls(args)
    shapes = _base_shapes(module)
    factors = _read_factors(step_folder, tensors, shapes, settings.rank, "dcp-to-peft")
    base = run.checkpoint.initial_load_path or None
    tree = transformers_tree(module)  # where the hf family's model holds transformers' own
    return write_peft_folder(out, spec.state_dict_adapter, args, shapes, factors, settings, base, dtype, tree)


def _merged_lora_to_hf(
    step_folder: Path,
    out: Path,
    spec: Any,
    args: Any,
    dtype: str,
    max_shard_bytes: int,
    tokenizer_files: dict[str, Path],
    config: Any | None,
) -> Path:
    """The adapters of `step_folder` merged into the run's base folder, written as a Hugging Face folder."""
    run, settings = _lora_run(step_folder, config, "dcp-to-hf")
    base = run.checkpoint.initial_load_path
    if not base:
        raise ConfigError(
            f"dcp-to-hf: {step_folder} holds a LoRA run's adapters only and the run had no "
            "checkpoint.initial_load_path: its base was the model's seeded random init, which no folder holds; "
            "write the adapters with dcp-to-peft"
        )
    refuse_non_empty(out)
    what = f"model {run.model.name} flavor {run.model.flavor}"
    check_hf_config(Path(base), spec.state_dict_adapter, args, what)  # before allocating anything
    tensors = _adapter_tensors(step_folder, "dcp-to-hf")
    with torch.device("meta"):
        module = spec.model_cls(args)
    factors = _read_factors(step_folder, tensors, _base_shapes(module), settings.rank, "dcp-to-hf")
    module.to_empty(device="cpu")  # every weight is overwritten by the load; no init needed
    reading = Progress.starter("loading the base's Hugging Face weights", "files")
    load_hf_weights(module, Path(base), spec.state_dict_adapter, args, what=what, progress=reading)
    merge_factors(module, factors, settings.scaling)
    folder = export_model_to_hf(module, out, spec.state_dict_adapter, args, dtype, max_shard_bytes, tokenizer_files)
    assert folder is not None  # one process: it writes
    return folder


def _resolve(opts: argparse.Namespace) -> tuple[Path, str, str, str, dict[str, Path], Any | None]:
    """(checkpoint folder, model, flavor, export dtype, tokenizer files, the loaded config)
    from the flags, defaulting to the config's; the tokenizer files (the config's data.tokenizer
    folder and data.chat_template) go into an exported folder beside the weights."""
    folder, model, flavor, dtype = opts.checkpoint, opts.model, opts.flavor, getattr(opts, "dtype", None)
    tokenizer: dict[str, Path] = {}
    config = None
    if opts.config is None and opts.overrides:
        raise ConfigError(f"{opts.overrides[0]}: unrecognised argument (overrides need --config)")
    if opts.config is not None:
        config = load_config(opts.config, opts.overrides)
        check_registered_names(config)
        folder = folder or Path(config.job.dump_folder) / config.checkpoint.folder
        model = model or config.model.name
        flavor = flavor or config.model.flavor
        dtype = dtype or config.checkpoint.export_dtype
        tokenizer = tokenizer_export_files(config.data.tokenizer, config.data.chat_template)
    missing = [flag for flag, value in (("--checkpoint", folder), ("--flavor", flavor)) if value is None]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} needed (or --config NAME to take them from a config)")
    return folder, model or "llama3", flavor, dtype or "float32", tokenizer, config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_dcp = sub.add_parser("hf-to-dcp", help="Hugging Face folder -> <checkpoint folder>/step-0")
    to_dcp.add_argument("hf_folder", type=Path)
    to_hf = sub.add_parser("dcp-to-hf", help="checkpoint step -> Hugging Face folder")
    to_hf.add_argument("out", type=Path)
    to_hf.add_argument("--step", type=int, default=None, help="default: the newest complete step")
    to_hf.add_argument("--dtype", choices=list(DTYPES), default=None)
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0)
    to_peft = sub.add_parser("dcp-to-peft", help="a LoRA run's checkpoint step -> PEFT adapter folder")
    to_peft.add_argument("out", type=Path)
    to_peft.add_argument("--step", type=int, default=None, help="default: the newest complete step")
    to_peft.add_argument("--dtype", choices=list(DTYPES), default=None)
    for p in (to_dcp, to_hf, to_peft):
        p.add_argument("--config", default=None, help="train config to take the defaults from")
        p.add_argument("--checkpoint", type=Path, default=None, help="the checkpoint folder (holds step-N/)")
        p.add_argument("--model", default=None, help="model family (registry name); default llama3")
        p.add_argument("--flavor", default=None, help="size, a flavor of that family")
    # Whatever argparse does not know is a --section.key=value override for --config.
    opts, overrides = parser.parse_known_args(argv)
    opts.overrides = [arg for arg in overrides if arg != "--"]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder, model, flavor, dtype, tokenizer, config = _resolve(opts)
        if opts.direction == "hf-to-dcp":
            result = hf_to_dcp(opts.hf_folder, folder, model, flavor, config)
        elif opts.direction == "dcp-to-peft":
            result = dcp_to_peft(folder, opts.out, model, flavor, opts.step, dtype, config)
        else:
            max_shard = int(opts.max_shard_gb * 2**30)
            result = dcp_to_hf(folder, opts.out, model, flavor, opts.step, dtype, max_shard, tokenizer, config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
