"""The sweep's folder steps (scripts/hf_sweep.py): an architecture starts from a folder transformers
wrote with `save_pretrained`, in the checkpoint format the Hub publishes (per-expert tensors, the
checkpoint's own names), as a user's downloaded folder would be.

- load: our model built from the folder's config (`--hf.config`, flavor "config") and loaded from it
  as a run loads `checkpoint.initial_load_path` holds exactly the tensors transformers'
  `from_pretrained` holds, and its logits are transformers' within 1e-5;
- export: our export of that model is the folder's tensors under the folder's names, and it loads
  in transformers and in our family to the same logits (1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from scripts import hf_parity as parity
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import load_config
from titan_tpu.models.hf.args import HFArgs, hf_args, model_class
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.hf.state_dict_adapter import HF_FAMILY_ADAPTER

LOGITS_TOLERANCE = 1e-5


def save_transformers_folder(args: HFArgs, folder: Path, seed: int = 0) -> Path:
    """transformers' own model of `args` (its own init), saved by its own `save_pretrained`."""
    cls = model_class(args.architecture, "hf.architecture")
    torch.manual_seed(seed)
    model = cls._from_config(type(args.config).from_dict(args.config.to_dict()), dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def from_folder(folder: Path, seq_len: int) -> HFCausalLM:
    """Our model of the folder's config, initialised with other weights than the folder's (so a
    tensor left unloaded shows), then loaded from the folder as a run loads it."""
    config = load_config(
        "llama3_debug",
        ["--model.name=hf", "--model.flavor=config", f"--hf.config={folder}", f"--training.seq_len={seq_len}"],
    )
    args = hf_args(config)
    model = parity.built_like_a_run(args, seq_len, seed=1)
    load_hf_weights(model, folder, HF_FAMILY_ADAPTER, model.args)
    return model.eval()


def transformers_from(folder: Path, architecture: str) -> nn.Module:
    # The class's own from_pretrained: AutoModelForCausalLM does not map some text configs of
    # multimodal families (Emu3TextConfig, MllamaTextConfig) to their causal LM.
    cls = model_class(architecture, "hf.architecture")
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def logits_gap(a: torch.Tensor, b: torch.Tensor) -> str | None:
    gap = float((a - b).abs().max())
    return None if gap <= LOGITS_TOLERANCE else f"logits differ by {gap:.1e}"


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@dataclass
class Loaded:
    """The load step's model, and transformers' logits of the folder on the sweep's tokens."""

    model: HFCausalLM
    expected: torch.Tensor


def check_load(folder: Path, architecture: str, tokens: torch.Tensor, seq_len: int) -> tuple[str, Loaded | None]:
    """The load step's verdict, and what the export step starts from when it passed."""
    model = from_folder(folder, seq_len)
    theirs = transformers_from(folder, architecture)
    their_state = theirs.state_dict()
    for name, value in model.state_dict().items():
        expected = their_state.get(name.removeprefix("hf."))
        if expected is None or not torch.equal(value, expected):
            return f"{name.removeprefix('hf.')} differs from transformers' load", None
    ids = tokens[:, :-1]
    with torch.no_grad():
        logits = theirs(input_ids=ids).logits
        gap = logits_gap(model(ids), logits)
    return (gap, None) if gap is not None else ("ok", Loaded(model, logits))


def check_export(loaded: Loaded, folder: Path, out: Path, tokens: torch.Tensor, seq_len: int) -> str:
    model = loaded.model
    export_model_to_hf(model, out, HF_FAMILY_ADAPTER, model.args)
    saved, exported = safetensors_of(folder), safetensors_of(out)
    if sorted(saved) != sorted(exported):
        missing, extra = sorted(saved.keys() - exported.keys()), sorted(exported.keys() - saved.keys())
        return f"names differ from save_pretrained's: missing {missing[:1]}, extra {extra[:1]}"
    changed = [name for name, value in saved.items() if not torch.equal(exported[name], value)]
    if changed:
        return f"{changed[0]} differs from save_pretrained's"
    ids = tokens[:, :-1]
    with torch.no_grad():
        theirs = transformers_from(out, model.args.architecture)(input_ids=ids).logits
        ours = from_folder(out, seq_len)(ids)
    gap = logits_gap(theirs, loaded.expected)
    if gap is not None:
        return f"in transformers: {gap}"
    gap = logits_gap(ours, loaded.expected)
    return f"in the hf family: {gap}" if gap is not None else "ok"
