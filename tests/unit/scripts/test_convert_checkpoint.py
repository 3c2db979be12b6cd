"""scripts/convert_checkpoint.py: HF -> checkpoint step-0 -> HF gives back the same tensors (fp32 and
bf16, sharded output; Llama 3 and Qwen 3 MoE with its stacked experts, and a Mixtral folder transformers
saved through the hf family), never overwrites, and refuses a checkpoint that does not fit the flavor."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.hf_saved import PUBLISHED_MOE, saved_folder
from tests.support.paths import REPO
from titan_tpu.checkpoint import layout
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.storage import read_metadata_file
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3MoeModel
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER

ROOT = REPO
_spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
assert _spec is not None and _spec.loader is not None
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def test_hf_to_checkpoint_to_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = LLAMA3_FLAVORS["debug"]
    with torch.device("meta"):
        model = Llama3Model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    original = export_model_to_hf(model, tmp_path / "hf", ADAPTER, args)
    assert original is not None

    ckpt = tmp_path / "run" / "checkpoint"
    # The checkpoint folder, model and flavor from a train config (its dump folder overridden).
    from_config = ["--config", "llama3_debug", f"--job.dump_folder={tmp_path / 'run'}"]
    assert convert.main(["hf-to-dcp", str(original), *from_config]) == 0
    assert layout.complete_steps(ckpt) == [0]
    assert layout.read_manifest(ckpt / "step-0")["components"] == ["model"]
    # Converting again would overwrite step-0: refused.
    assert convert.main(["hf-to-dcp", str(original), "--checkpoint", str(ckpt), "--flavor", "debug"]) == 2
    assert "never overwritten" in capsys.readouterr().err

    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"out_{dtype}"
        argv = ["dcp-to-hf", str(out), "--checkpoint", str(ckpt), "--flavor", "debug", "--dtype", dtype]
        argv += ["--max-shard-gb", "0.002"]
        assert convert.main(argv) == 0
        assert (out / "model.safetensors.index.json").is_file()
        got, want = read_folder(out), read_folder(original)
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor.to(getattr(torch, dtype))), name

    # The config's export_dtype is the default.
    out = tmp_path / "out_config"
    assert convert.main(["dcp-to-hf", str(out), *from_config, "--checkpoint.export_dtype=bfloat16"]) == 0
    assert all(t.dtype == torch.bfloat16 for t in read_folder(out).values())

    assert convert.main(["dcp-to-hf", str(tmp_path / "x"), "--checkpoint", str(ckpt), "--flavor", "1B"]) == 2
    assert "does not fit the flavor" in capsys.readouterr().err
    assert convert.main(["dcp-to-hf", str(tmp_path / "x")]) == 2
    assert "--checkpoint and --flavor needed" in capsys.readouterr().err


def test_moe_experts_stack_into_the_checkpoint_and_back(tmp_path: Path) -> None:
    """qwen3_moe: per-expert HF tensors become one stacked tensor per projection in the checkpoint and
    are split again on the way out."""
    args = QWEN3_MOE_FLAVORS["debug_moe"]
    with torch.device("meta"):
        model = Qwen3MoeModel(args)
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    model.init_weights()
    original = export_model_to_hf(model, tmp_path / "hf", QWEN3_STATE_DICT_ADAPTER, args)
    assert original is not None
    ckpt = tmp_path / "run" / "checkpoint"
    flags = ["--checkpoint", str(ckpt), "--model", "qwen3_moe", "--flavor", "debug_moe"]
    assert convert.main(["hf-to-dcp", str(original), *flags]) == 0
    saved = read_metadata_file(ckpt / "step-0" / ".metadata").state_dict_metadata
    w1 = saved["model.layers.0.feed_forward.experts.w1"]
    assert tuple(w1.size) == (args.num_experts, args.moe_hidden_dim, args.dim)
    assert not any(".experts.0." in key for key in saved)

    out = tmp_path / "out"
    assert convert.main(["dcp-to-hf", str(out), *flags, "--max-shard-gb", "0.002"]) == 0
    got, want = read_folder(out), read_folder(original)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in want
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_a_published_moe_folder_converts_to_a_checkpoint_and_back_to_its_own_names(tmp_path: Path) -> None:
    """The hf family: a Mixtral folder as transformers saves it (one tensor per expert under
    `block_sparse_moe`) becomes transformers' fused runtime tensors in the checkpoint and comes back
    under the folder's own names, tensor for tensor."""
    original = saved_folder(PUBLISHED_MOE["mixtral"], tmp_path / "mixtral")
    flags = [
        "--config",
        "llama3_debug",
        "--model.name=hf",
        "--model.flavor=config",
        f"--hf.config={original}",
        f"--job.dump_folder={tmp_path / 'run'}",
    ]
    assert convert.main(["hf-to-dcp", str(original), *flags]) == 0
    saved = read_metadata_file(tmp_path / "run" / "checkpoint" / "step-0" / ".metadata").state_dict_metadata
    assert "model.hf.model.layers.0.mlp.experts.gate_up_proj" in saved
    assert not any("block_sparse_moe" in key for key in saved)

    out = tmp_path / "out"
    assert convert.main(["dcp-to-hf", str(out), *flags]) == 0
    got, want = read_folder(out), read_folder(original)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in want
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
