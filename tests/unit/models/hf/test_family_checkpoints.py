"""The hf family's weights in and out of Hugging Face folders: a folder transformers wrote loads into
our model (lazily, through the same reader as every family), our export loads back in transformers
with the same logits, and a training checkpoint converts to a folder that does too. Gemma 2 has a
tied head, which transformers writes once (as the embedding): exported the same way, loaded into
both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.support.paths import REPO
from tests.unit.models.hf.test_family import SEQ, built_like_a_run
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import ConfigError
from titan_tpu.models.hf.model import HFCausalLM
from titan_tpu.models.registry import get_model_spec

ROOT = REPO
ADAPTER = get_model_spec("hf").state_dict_adapter


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def their_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model(input_ids=ids).logits


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Gemma2ForCausalLM"])
def test_a_folder_transformers_wrote_loads_into_our_model(architecture: str, tmp_path: Path) -> None:
    """Catches a name mapped to the wrong tensor, and (Gemma 2) a tied head that the folder does not
    hold reported missing or left as allocated."""
    source = built_like_a_run(architecture).eval()
    source.hf.save_pretrained(tmp_path / "folder")
    ours = built_like_a_run(architecture, seed=7).eval()  # other weights until loaded
    ids = tokens(ours.args.vocab_size)
    assert not torch.allclose(ours(ids), source(ids))
    load_hf_weights(ours, tmp_path / "folder", ADAPTER, ours.args)
    torch.testing.assert_close(ours(ids), their_logits(tmp_path / "folder", ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Gemma2ForCausalLM"])
def test_our_export_loads_in_transformers_with_the_same_logits(architecture: str, tmp_path: Path) -> None:
    model = built_like_a_run(architecture).eval()
    export_model_to_hf(model, tmp_path / "out", ADAPTER, model.args)
    ids = tokens(model.args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(their_logits(tmp_path / "out", ids), model(ids), rtol=0, atol=1e-5)
    if model.args.tie_embeddings:
        from safetensors import safe_open

        with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()


def test_a_folder_of_another_size_is_refused_before_loading(tmp_path: Path) -> None:
    built_like_a_run("MistralForCausalLM").hf.save_pretrained(tmp_path / "folder")
    other = built_like_a_run("MistralForCausalLM", "--model.overrides={ num_hidden_layers = 3 }")
    with pytest.raises(ConfigError, match="num_hidden_layers is 2 there, 3 here"):
        load_hf_weights(other, tmp_path / "folder", ADAPTER, other.args)


def test_a_training_checkpoint_converts_to_a_folder_transformers_loads(tmp_path: Path) -> None:
    """train.py on hf_mistral_debug for 4 steps with a checkpoint, then scripts/convert_checkpoint.py
    dcp-to-hf --config: the folder's logits are the trained weights' (loaded back through our
    reader into a fresh model). Catches the converter building the flavor's model instead of the
    config's (an override lost) and a checkpoint name that does not map."""
    run = [
        "--config",
        "hf_mistral_debug",
        f"--job.dump_folder={tmp_path / 'run'}",
        "--training.steps=4",
        "--training.seq_len=32",
        "--training.dtype=float32",
        "--checkpoint.enable=true",
        "--checkpoint.interval=4",
        "--model.overrides={ num_hidden_layers = 3 }",
        "--metrics.log_freq=4",
    ]
    subprocess.run([sys.executable, "train.py", *run], cwd=ROOT, check=True, capture_output=True)
    convert = [
        sys.executable,
        "scripts/convert_checkpoint.py",
        "dcp-to-hf",
        str(tmp_path / "hf"),
        *run[:2],
        *run[2:3],
        "--model.overrides={ num_hidden_layers = 3 }",
    ]
    done = subprocess.run(convert, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert exported.config.num_hidden_layers == 3
    fresh = built_like_a_run("MistralForCausalLM", "--model.overrides={ num_hidden_layers = 3 }").eval()
    load_hf_weights(fresh, tmp_path / "hf", ADAPTER, fresh.args)
    ids = tokens(fresh.args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, fresh(ids), rtol=0, atol=1e-5)
        untrained = built_like_a_run("MistralForCausalLM", "--model.overrides={ num_hidden_layers = 3 }").eval()
        assert not torch.allclose(untrained(ids), fresh(ids), atol=1e-3)  # the checkpoint was trained
    assert isinstance(fresh, HFCausalLM)


def test_a_run_stopped_after_a_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    """A tiny Mistral trained 8 steps straight, and the same run stopped after its step-4 checkpoint
    (a dump folder holding only that) and restarted: steps 5-8 give the same losses bit for bit.
    Catches state a checkpoint of the hf family leaves out (the optimizer's, the data position's)
    and transformers' buffers not recomputed on resume."""
    import shutil

    from titan_tpu.config import load_config
    from titan_tpu.training.trainer import Trainer

    def train(dump: Path) -> dict[int, float]:
        config = load_config(
            "hf_mistral_debug",
            [
                f"--job.dump_folder={dump}",
                "--training.steps=8",
                "--training.seq_len=32",
                "--training.global_batch_size=4",
                "--training.dtype=float32",
                "--training.deterministic=true",
                "--checkpoint.enable=true",
                "--checkpoint.interval=4",
                "--metrics.log_freq=1",
                "--data.shuffle_buffer=16",
            ],
        )
        trainer = Trainer(config)
        try:
            return {record.step: record.loss for record in trainer.train()}
        finally:
            trainer.close()

    straight = train(tmp_path / "straight")
    (tmp_path / "resumed" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-4", tmp_path / "resumed" / "checkpoint" / "step-4")
    resumed = train(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]
    assert straight[8] < straight[1]


def test_a_folder_that_leaves_out_a_derived_field_is_accepted(tmp_path: Path) -> None:
    """A published config.json may omit what its class derives (Mistral 7B v0.1 has no head_dim):
    that is no disagreement. A field both give differently still is (the negative control)."""
    import json

    model = built_like_a_run("MistralForCausalLM")
    model.hf.save_pretrained(tmp_path / "folder")
    config_file = tmp_path / "folder" / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("head_dim", None)
    config_file.write_text(json.dumps(config))
    assert ADAPTER.check_hf_config(config, model.args) == []
    config["num_key_value_heads"] = 4
    assert ADAPTER.check_hf_config(config, model.args) == ["num_key_value_heads is 4 there, 2 here"]
