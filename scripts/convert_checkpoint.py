"""Offline conversion between Hugging Face folders and titan_tpu checkpoints (one process, no GPU).

    # HF -> checkpoint: writes <checkpoint folder>/step-0 (weights only). A run with that folder and
    # --checkpoint.enable starts from these weights at step 0.
    python scripts/convert_checkpoint.py hf-to-dcp HF_FOLDER --config llama3_8b
    python scripts/convert_checkpoint.py hf-to-dcp HF_FOLDER --checkpoint DIR --model llama3 --flavor 8B

    # checkpoint -> HF: the newest complete step (or --step N); loads with
    # transformers.AutoModelForCausalLM.from_pretrained(HF_OUT).
    python scripts/convert_checkpoint.py dcp-to-hf HF_OUT --config llama3_8b [--step N] [--dtype bfloat16]
    python scripts/convert_checkpoint.py dcp-to-hf HF_OUT --checkpoint DIR --model llama3 --flavor 8B

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

from titan_tpu.checkpoint import CheckpointManager, layout  # noqa: E402
from titan_tpu.checkpoint.hf_export import export_checkpoint_to_hf  # noqa: E402
from titan_tpu.checkpoint.hf_import import check_hf_config, load_hf_weights  # noqa: E402
from titan_tpu.config import ConfigError, load_config  # noqa: E402
from titan_tpu.config.sections import CheckpointConfig  # noqa: E402
from titan_tpu.data.chat_tokenizer import tokenizer_export_files  # noqa: E402
from titan_tpu.device.dtype import DTYPES  # noqa: E402
from titan_tpu.metrics.progress import Progress  # noqa: E402
from titan_tpu.models.registry import get_model_spec  # noqa: E402
from titan_tpu.training.registered_names import check_registered_names  # noqa: E402


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
    steps = layout.complete_steps(checkpoint_folder)
    if not steps:
        raise ConfigError(f"{checkpoint_folder}: no complete checkpoint (step-N folder with a manifest)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"--step {step}: not complete in {checkpoint_folder}; complete steps: {steps}")
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in spec.model_cls(args).state_dict().items()}
    return export_checkpoint_to_hf(
        layout.step_dir(checkpoint_folder, step),
        out,
        spec.state_dict_adapter,
        args,
        shapes,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        progress=Progress.starter(f"writing Hugging Face folder {out}", "tensors"),
        extra_files=tokenizer_files,
    )


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
    for p in (to_dcp, to_hf):
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
