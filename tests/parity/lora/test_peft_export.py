"""LoRA export against peft and transformers: a model of ours loaded from a folder transformers saved
(Qwen 3; through the hf family Qwen 2, with its attention biases, and HRM, whose folder fuses
projections its modules keep apart), every linear of its blocks adapted and trained 3 steps (B far
from 0, scaling alpha / r = 2), then

- our PEFT folder, loaded by `peft.PeftModel.from_pretrained` onto transformers' model of the base
  folder, holds exactly the adapter tensors PEFT creates (none missing, none unexpected) and gives
  our logits within 1e-5 (fp32);
- our merged folder, loaded by transformers' from_pretrained, gives the same logits, and holds the
  base folder's tensor names, no factor;
- with a state-dict adapter that writes Qwen 3's query heads in another order inside each key/value
  group (and the output projection's columns to match; the same function), both still match, which
  they do only if B's rows and A's columns follow the folder's order.

Negative controls, each of which must move the logits by far more than the tolerance: lora_alpha
written as r (the scaling left out of the PEFT folder), the merge without the scaling, and B's rows
left in our order under the head permutation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.support.hf_saved import saved_folder
from tests.support.lora_models import ALPHA, RANK, adapt_block_linears, train_adapters
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import load_config
from titan_tpu.lora import merge, peft_export
from titan_tpu.lora.merge import export_merged_to_hf
from titan_tpu.lora.peft_export import export_peft_adapter
from titan_tpu.models.hf.args import hf_args
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.hf.state_dict_adapter import HF_FAMILY_ADAPTER
from titan_tpu.models.qwen3.args import Qwen3Args
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER, Qwen3StateDictAdapter
from titan_tpu.protocols.state_dict_adapter import Shapes
from titan_tpu.protocols.tensor_layout import BlockLayout

TOLERANCE = 1e-5
WRONG = 1e-3  # a negative control must miss by at least this much
QWEN3 = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=128,
    ffn_hidden_dim=96,
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_seq_len=64,
)
TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))


class Case:
    """A base folder transformers saved, our model of it with trained adapters, and its logits."""

    def __init__(self, base: Path, model: nn.Module, adapter: Any, args: Any) -> None:
        self.base, self.model, self.adapter, self.args = base, model, adapter, args
        with torch.no_grad():
            self.logits = model(TOKENS)


def _random_qwen3_folder(folder: Path) -> Path:
    config = {k: v for k, v in QWEN3_STATE_DICT_ADAPTER.to_hf_config(QWEN3).items() if k not in ("architectures",)}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**config))
    with torch.no_grad():  # O(1) logits, far from the tiny default init
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param) if "norm" in name else torch.randn_like(param) / 8)
    model.save_pretrained(folder)
    return folder


def _qwen3_from(folder: Path) -> Qwen3Model:
    with torch.device("meta"):
        model = Qwen3Model(QWEN3)
    model.to_empty(device="cpu")
    model.init_weights()  # the rotary tables; every weight is then read from the folder
    load_hf_weights(model, folder, QWEN3_STATE_DICT_ADAPTER, QWEN3)
    return model.eval()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Case:
    base = _random_qwen3_folder(tmp_path_factory.mktemp("qwen3") / "base")
    model = _qwen3_from(base)
    adapt_block_linears(model)
    train_adapters(model, QWEN3.vocab_size)
    return Case(base, model, QWEN3_STATE_DICT_ADAPTER, QWEN3)


def _hf_family(architecture: str, folder: Path) -> Case:
    base = saved_folder(architecture, folder)
    args = hf_args(load_config("llama3_debug", ["--model.name=hf", "--model.flavor=config", f"--hf.config={base}"]))
    with torch.device("meta"):
        model = HFCausalLM(args)
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_weights(model, base, HF_FAMILY_ADAPTER, args)
    adapt_block_linears(model)
    train_adapters(model, args.config.vocab_size)
    return Case(base, model, HF_FAMILY_ADAPTER, args)


@pytest.fixture(scope="module")
def qwen2_hf_family(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """Attention biases, which stay the base's (PEFT's bias "none")."""
    case = _hf_family("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2") / "base")
    assert case.model.get_submodule("hf.model.layers.0.self_attn.q_proj").bias is not None
    return case


@pytest.fixture(scope="module")
def hrm_hf_family(tmp_path_factory: pytest.TempPathFactory) -> Case:
    """A folder that fuses what transformers' modules split (`mlp.gate_up_proj` for gate_proj and
    up_proj): PEFT's names are the modules', which the hf family's model has as its own."""
    case = _hf_family("HrmTextForCausalLM", tmp_path_factory.mktemp("hrm") / "base")
    assert "model.L_module.layers.0.mlp.gate_up_proj.weight" in load_file(case.base / "model.safetensors")
    return case


def _transformers(folder: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _peft_logits(base: Path, adapters: Path) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(_transformers(base), adapters).eval()
    created = {name.replace(".default", "") for name, _ in model.named_parameters() if ".lora_" in name}
    written = set(load_file(adapters / peft_export.WEIGHTS_FILE))
    assert created == written, (sorted(created - written)[:3], sorted(written - created)[:3])
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", ["qwen3", "qwen2_hf_family", "hrm_hf_family"])
def test_the_peft_folder_loads_in_peft_with_our_logits(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    case: Case = request.getfixturevalue(name)
    out = export_peft_adapter(case.model, tmp_path / "adapter", case.adapter, case.args, base_model=str(case.base))
    assert out is not None
    config = json.loads((out / peft_export.CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA, str(case.base))
    diff = _diff(_peft_logits(case.base, out), case.logits)
    print(f"{name}: max |logit| {case.logits.abs().max():.2f}, peft vs ours {diff:.2e}")
    assert diff <= TOLERANCE

    # Negative control: the scaling left out (alpha = r, so alpha / r = 1 instead of 2).
    config["lora_alpha"] = config["r"]
    (out / peft_export.CONFIG_FILE).write_text(json.dumps(config))
    assert _diff(_peft_logits(case.base, out), case.logits) > WRONG


@pytest.mark.parametrize("name", ["qwen3", "qwen2_hf_family", "hrm_hf_family"])
def test_the_merged_folder_loads_in_transformers_with_our_logits(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case: Case = request.getfixturevalue(name)
    out = export_merged_to_hf(case.model, tmp_path / "merged", case.adapter, case.args)
    assert out is not None
    assert set(load_file(out / "model.safetensors")) == set(load_file(case.base / "model.safetensors"))
    with torch.no_grad():
        diff = _diff(_transformers(out)(input_ids=TOKENS).logits, case.logits)
    print(f"{name}: merged vs ours {diff:.2e}")
    assert diff <= TOLERANCE

    # Negative control: the merge without the scaling.
    unscaled = merge.merged_weight
    monkeypatch.setattr(merge, "merged_weight", lambda w, a, b, scaling: unscaled(w, a, b, 1.0))
    wrong = export_merged_to_hf(case.model, tmp_path / "unscaled", case.adapter, case.args)
    assert wrong is not None
    with torch.no_grad():
        assert _diff(_transformers(wrong)(input_ids=TOKENS).logits, case.logits) > WRONG


class HeadsReordered(Qwen3StateDictAdapter):
    """Qwen 3's folder with the query heads of each key/value group in reverse order (the output
    projection's input columns reordered to match): the same function, and a row permutation of
    q_proj (a column permutation of o_proj) that an export must carry into B (A)."""

    def export_layouts(self, args: Qwen3Args, shapes: Shapes) -> dict[str, BlockLayout]:
        layouts = super().export_layouts(args, shapes)
        group = args.n_heads // args.n_kv_heads
        order = [g * group + k for g in range(args.n_kv_heads) for k in reversed(range(group))]
        for i in range(args.n_layers):
            for ours, theirs, dim in (("wq", "q_proj", 0), ("wo", "o_proj", 1)):
                whole = BlockLayout.whole(
                    f"layers.{i}.attention.{ours}.weight", shapes[f"layers.{i}.attention.{ours}.weight"]
                )
                blocks = [whole.narrow(dim, h * args.head_dim, args.head_dim) for h in order]
                layouts[f"model.layers.{i}.self_attn.{theirs}.weight"] = BlockLayout.cat(blocks, dim)
        return layouts


def test_a_reordered_layout_is_carried_into_the_factors(
    qwen3: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = HeadsReordered()
    base = export_model_to_hf(_qwen3_from(qwen3.base), tmp_path / "base", adapter, QWEN3)
    assert base is not None
    with torch.no_grad():  # the reordered base is the same function as ours without adapters
        base_logits = _transformers(base)(input_ids=TOKENS).logits
        assert _diff(base_logits, _qwen3_from(qwen3.base)(TOKENS)) <= TOLERANCE
    adapters = export_peft_adapter(qwen3.model, tmp_path / "adapter", adapter, QWEN3)
    assert adapters is not None
    assert _diff(_peft_logits(base, adapters), qwen3.logits) <= TOLERANCE
    merged = export_merged_to_hf(qwen3.model, tmp_path / "merged", adapter, QWEN3)
    assert merged is not None
    with torch.no_grad():
        assert _diff(_transformers(merged)(input_ids=TOKENS).logits, qwen3.logits) <= TOLERANCE

    # Negative control: B's rows and A's columns in our order, as if the layout had been ignored.
    select = peft_export._rows_and_columns
    monkeypatch.setattr(peft_export, "_rows_and_columns", lambda *a: tuple(index.sort().values for index in select(*a)))
    ignored = export_peft_adapter(qwen3.model, tmp_path / "ignored", adapter, QWEN3)
    assert ignored is not None
    assert _diff(_peft_logits(base, ignored), qwen3.logits) > WRONG
