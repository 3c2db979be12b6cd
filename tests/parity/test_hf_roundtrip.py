"""transformers -> us -> transformers: a random `LlamaForCausalLM` saved with `save_pretrained` is loaded
by the trainer (checkpoint.initial_load_path), trained 0 steps, exported, and the logits of all three
agree within 1e-5 (fp32); a bf16 export loads in transformers too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from models.llama3 import LLAMA3_FLAVORS
from models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.checkpoint.hf import export_model_to_hf
from titan_tpu.config import ConfigError, load_config
from titan_tpu.trainer import Trainer

ARGS = LLAMA3_FLAVORS["debug"]
SEQ = 64


def random_hf_model() -> LlamaForCausalLM:
    config = {k: v for k, v in ADAPTER.to_hf_config(ARGS).items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager")).eval()
    with torch.no_grad():
        # Far from the tiny default init, so that every mapping mistake shows in the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    folder = tmp_path_factory.mktemp("hf") / "llama"
    model = random_hf_model()
    # Small shards, so the index + several safetensors path is the one exercised.
    model.save_pretrained(folder, max_shard_size="1MB")
    assert (folder / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return folder, tokens, logits


def trainer_with(folder: Path, dump: Path, *extra: str) -> Trainer:
    config = load_config(
        "llama3_debug",
        [
            f"--job.dump_folder={dump}",
            f"--checkpoint.initial_load_path={folder}",
            f"--training.seq_len={SEQ}",
            "--training.dtype=float32",
            "--training.global_batch_size=2",
            *extra,
        ],
    )
    return Trainer(config)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_round_trip_logits(hf_folder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, tokens, expected = hf_folder
    trainer = trainer_with(folder, tmp_path / "run")
    try:
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(tokens)
        loaded_diff = max_diff(ours, expected)
        out = export_model_to_hf(trainer.model, tmp_path / "export", ADAPTER, ARGS, "float32")
    finally:
        trainer.close()
    assert out is not None
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert reloaded.dtype == torch.float32
    with torch.no_grad():
        exported = reloaded(input_ids=tokens).logits
    exported_diff = max_diff(exported, expected)
    scale = expected.abs().max().item()
    print(f"max |logit| {scale:.2f}; ours vs HF {loaded_diff:.2e}; exported vs HF {exported_diff:.2e}")
    assert loaded_diff <= 1e-5 * max(1.0, expected.abs().max().item())
    assert exported_diff <= 1e-5 * max(1.0, expected.abs().max().item())


def test_bfloat16_export_loads(hf_folder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, tokens, expected = hf_folder
    trainer = trainer_with(folder, tmp_path / "run")
    try:
        out = export_model_to_hf(trainer.model, tmp_path / "export", ADAPTER, ARGS, "bfloat16")
    finally:
        trainer.close()
    assert out is not None
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto", attn_implementation="eager").eval()
    assert reloaded.dtype == torch.bfloat16
    with torch.no_grad():
        logits = reloaded(input_ids=tokens).logits
    # bf16 weights and compute: a loose bound, this checks the format rather than the precision.
    rel = max_diff(logits, expected) / expected.abs().max().item()
    print(f"bf16 export: max relative logit diff {rel:.3f}")
    assert rel < 0.1


def test_flavor_mismatch_is_a_config_error(hf_folder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, _, _ = hf_folder
    with pytest.raises(ConfigError, match=r"config.json does not match model llama3 flavor 1B: vocab_size"):
        trainer_with(folder, tmp_path / "run", "--model.flavor=1B", "--data.tokenizer=byte")
