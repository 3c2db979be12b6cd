"""transformers -> us -> transformers: a random `LlamaForCausalLM`, `Qwen3ForCausalLM` or
`Qwen3MoeForCausalLM` saved with `save_pretrained` is loaded by the trainer (checkpoint.initial_load_path),
trained 0 steps, exported, and the logits of all three agree within 1e-5 (fp32); a bf16 export loads in
transformers too. Qwen 3 MoE's experts are one tensor each in the files and stacked in our model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.config import ConfigError, load_config
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER as ADAPTER
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER
from titan_tpu.training.trainer import Trainer

ARGS = LLAMA3_FLAVORS["debug"]
SEQ = 64


def random_hf_model(
    adapter=ADAPTER,  # type: ignore[no-untyped-def]
    args=ARGS,
    config_cls: type = LlamaConfig,
    model_cls: type[PreTrainedModel] = LlamaForCausalLM,
) -> PreTrainedModel:
    config = {k: v for k, v in adapter.to_hf_config(args).items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = model_cls(config_cls(**config, attn_implementation="eager")).eval()
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


def trainer_with(folder: Path, dump: Path, *extra: str, config_name: str = "llama3_debug") -> Trainer:
    config = load_config(
        config_name,
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


def assert_logits_match(label: str, ours: torch.Tensor, exported: torch.Tensor, expected: torch.Tensor) -> None:
    """Our logits (weights read from the folder) and the re-imported export's both equal the
    reference's within 1e-5 of the largest logit."""
    scale = expected.abs().max().item()
    loaded_diff, exported_diff = max_diff(ours, expected), max_diff(exported, expected)
    print(f"{label}: max |logit| {scale:.2f}; ours vs HF {loaded_diff:.2e}; exported vs HF {exported_diff:.2e}")
    assert loaded_diff <= 1e-5 * max(1.0, scale)
    assert exported_diff <= 1e-5 * max(1.0, scale)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_round_trip_logits(hf_folder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, tokens, expected = hf_folder
    trainer = trainer_with(folder, tmp_path / "run")
    try:
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(tokens)
        out = export_model_to_hf(trainer.model, tmp_path / "export", ADAPTER, ARGS, "float32")
    finally:
        trainer.close()
    assert out is not None
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert reloaded.dtype == torch.float32
    with torch.no_grad():
        exported = reloaded(input_ids=tokens).logits
    assert_logits_match("llama3", ours, exported, expected)


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


def test_flavor_mismatch_is_a_config_error(hf_folder, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Refused before the kernels are measured at the wrong flavor's shapes (once 28 s for a 1B)."""
    folder, _, _ = hf_folder

    def measuring(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("kernels measured before the folder was checked")

    monkeypatch.setattr("titan_tpu.training.trainer.choose_run_kernels", measuring)
    with pytest.raises(ConfigError, match=r"config.json does not match model llama3 flavor 1B: vocab_size"):
        trainer_with(folder, tmp_path / "run", "--model.flavor=1B", "--data.tokenizer=byte")


# (train config, adapter, flavor args, transformers config and model classes)
QWEN3 = {
    "qwen3": ("qwen3_debug", QWEN3_FLAVORS["debug"], Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": ("qwen3_moe_debug", QWEN3_MOE_FLAVORS["debug_moe"], Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


@pytest.mark.parametrize("family", list(QWEN3))
def test_qwen3_round_trip_logits(family: str, tmp_path: Path) -> None:
    config_name, args, config_cls, model_cls = QWEN3[family]
    hf = random_hf_model(QWEN3_STATE_DICT_ADAPTER, args, config_cls, model_cls)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="1MB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    trainer = trainer_with(tmp_path / "hf", tmp_path / "run", config_name=config_name)
    try:
        with torch.no_grad():
            output = trainer.model(tokens)
        ours = getattr(output, "logits", output)  # the MoE model also returns its router statistics
        out = export_model_to_hf(trainer.model, tmp_path / "export", QWEN3_STATE_DICT_ADAPTER, args, "float32")
    finally:
        trainer.close()
    assert out is not None
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is model_cls and reloaded.dtype == torch.float32
    with torch.no_grad():
        exported = reloaded(input_ids=tokens).logits
    assert_logits_match(family, ours, exported, expected)


def test_qwen3_moe_expert_count_mismatch_is_a_config_error(tmp_path: Path) -> None:
    """Refused by the trainer before the model is built, so no weight is read."""
    _, args, _, _ = QWEN3["qwen3_moe"]
    config = {**QWEN3_STATE_DICT_ADAPTER.to_hf_config(args), "num_experts": 4}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x00garbage, never to be read")
    match = r"config.json does not match model qwen3_moe flavor debug_moe: num_experts is 4, the flavor has 8"
    with pytest.raises(ConfigError, match=match):
        trainer_with(tmp_path / "hf", tmp_path / "run", config_name="qwen3_moe_debug")
