"""GRPO's push to a vLLM engine (titan_tpu/tasks/grpo/engines.py `export_for_engine`) from a LoRA
model: the folder the servers reload holds the merged weights, W + alpha / r * B A for each adapted
projection and the base's other tensors, under the base folder's names, with no factor. No server is
needed: the folder's tensors are compared with the adapted model's own.

Bugs caught: the base weights pushed without the adapters (the engine would sample from the base
model while the trainer scores the adapted one; the adapted weights differ from the base by far more
than the tolerance, checked), the scaling left out, the factors written into the folder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.support.lora_models import adapt_block_linears, train_adapters
from titan_tpu.models.common.lora import lora_layers
from titan_tpu.models.qwen3.args import Qwen3Args
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.tasks.grpo.engines import export_for_engine

ARGS = Qwen3Args(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, ffn_hidden_dim=48, max_seq_len=32
)


def test_a_lora_model_is_pushed_merged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Qwen3Model(ARGS)
    model.init_weights()
    adapt_block_linears(model)
    train_adapters(model, ARGS.vocab_size)
    export_for_engine(model, tmp_path / "push", ADAPTER, ARGS, "float32")

    pushed = load_file(tmp_path / "push" / "model.safetensors")
    expected = {name: t for name, t in model.state_dict().items() if not name.endswith((".lora_A", ".lora_B"))}
    for path, layer in lora_layers(model):
        base = expected[f"{path}.weight"]
        expected[f"{path}.weight"] = base + layer.alpha / layer.rank * (layer.lora_B @ layer.lora_A).detach()
        assert (expected[f"{path}.weight"] - base).abs().max() > 1e-3  # a base-only push would show
    hf_expected = ADAPTER.to_hf(expected)
    assert sorted(pushed) == sorted(hf_expected)
    for name, tensor in hf_expected.items():
        torch.testing.assert_close(pushed[name], tensor, rtol=0, atol=1e-6, msg=name)
