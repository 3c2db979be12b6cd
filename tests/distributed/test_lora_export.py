"""LoRA exports from a sharded model (FSDP 2, and TP 2 where the adapters of column- and row-wise
projections are split along different dims): the PEFT folder and the merged folder each rank's call
writes equal, tensor for tensor, what one process writes from the same state gathered by torch's own
full-state-dict path, and the PEFT folder on transformers' base model gives the sharded model's
logits within 1e-5. Catches a factor gathered with the wrong placement (B's rows of a colwise
projection, A's columns of a rowwise one), ranks gathering in different orders (a hang or a
mismatch), and a rank other than 0 writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.support.launch import torchrun
from tests.support.lora_models import adapt_block_linears
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.lora.merge import export_merged_to_hf
from titan_tpu.lora.peft_export import CONFIG_FILE, WEIGHTS_FILE, export_peft_adapter
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER as ADAPTER

WORKER = Path(__file__).with_name("lora_export_worker.py")
ARGS = QWEN3_FLAVORS["debug"]


def _same_tensors(got: Path, want: Path) -> None:
    got_tensors, want_tensors = load_file(got), load_file(want)
    assert sorted(got_tensors) == sorted(want_tensors)
    for name, tensor in want_tensors.items():
        assert torch.equal(got_tensors[name], tensor), name


@pytest.mark.slow
def test_sharded_exports_equal_one_process_exports(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base_model = Qwen3Model(ARGS)
    base_model.init_weights()
    base = export_model_to_hf(base_model, tmp_path / "base", ADAPTER, ARGS)
    assert base is not None
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    torchrun(2, WORKER, str(base), str(tmp_path), timeout=300)
    print(json.loads((tmp_path / "results.json").read_text())["timings_s"])

    for layout in ("fsdp2", "tp2"):
        sharded = tmp_path / layout
        state = torch.load(sharded / "state.pt", weights_only=True)
        assert all(state[name].abs().max() > 0 for name in state if name.endswith(".lora_B")), layout  # trained
        model = Qwen3Model(ARGS)
        adapt_block_linears(model)
        model.load_state_dict(state, strict=True)
        peft = export_peft_adapter(model, tmp_path / f"{layout}_peft", ADAPTER, ARGS, base_model=str(base))
        merged = export_merged_to_hf(model, tmp_path / f"{layout}_merged", ADAPTER, ARGS)
        assert peft is not None and merged is not None
        _same_tensors(sharded / "peft" / WEIGHTS_FILE, peft / WEIGHTS_FILE)
        assert (sharded / "peft" / CONFIG_FILE).read_text() == (peft / CONFIG_FILE).read_text()
        _same_tensors(sharded / "merged" / "model.safetensors", merged / "model.safetensors")
        with torch.no_grad():
            theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), sharded / "peft")(tokens)
        ours = torch.load(sharded / "logits.pt", weights_only=True)
        assert (theirs.logits - ours).abs().max() <= 1e-5, layout
