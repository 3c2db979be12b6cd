"""LoRA runs of the real trainer, one process, float32 and deterministic, on a base read from a Hugging
Face folder (checkpoint.initial_load_path): what the start-up says, what a checkpoint holds (the
adapters, never the base), a resume that equals the uninterrupted run (per-step gradients and the
final state, bit for bit) because the base is read from the folder again, and the refusals of a
resume on another base."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.support.lora_models import adapter_parameter_names
from tests.support.parity import EXACT, RunResult, compare, train_and_capture
from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.config import ConfigError, load_config
from titan_tpu.metrics.console import count
from titan_tpu.models.qwen3.args import QWEN3_FLAVORS
from titan_tpu.models.qwen3.model import Qwen3Model
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER
from titan_tpu.training.trainer import Trainer

SIZES = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "ffn_hidden_dim": 128}
ARGS = dataclasses.replace(QWEN3_FLAVORS["debug"], **SIZES)
RUN = [
    "--model.overrides={ " + ", ".join(f"{k} = {v}" for k, v in SIZES.items()) + " }",
    "--model.attention_block=0",
    "--training.seq_len=32",
    "--training.global_batch_size=2",
    "--training.dtype=float32",
    "--training.deterministic=true",
    "--optimizer.lr=1e-2",
    "--lr_scheduler.warmup_steps=1",
    "--metrics.log_freq=1",
    "--metrics.plot_loss=false",
    "--data.shuffle_buffer=16",
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--lora.enable=true",
    "--lora.rank=4",
    "--lora.alpha=8",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base unlike the seed's own init: a run that ignored the folder would train another model."""
    torch.manual_seed(123)
    model = Qwen3Model(dataclasses.replace(ARGS, max_seq_len=32))
    model.init_weights()
    folder = export_model_to_hf(model, tmp_path_factory.mktemp("base") / "base", QWEN3_STATE_DICT_ADAPTER, ARGS)
    assert folder is not None
    return folder


def trainer(dump: Path, base: Path, steps: int, *more: str) -> Trainer:
    options = [*RUN, f"--training.steps={steps}", f"--job.dump_folder={dump}", f"--checkpoint.initial_load_path={base}"]
    return Trainer(load_config("qwen3_debug", [*options, *more]))


def run(trainer: Trainer) -> tuple[RunResult, dict[int, dict[str, torch.Tensor]]]:
    """The run and every step's gradients (AdamW's step count -> name -> gradient)."""
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads[trainer.step + 1] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    trainer.optimizer.register_step_pre_hook(before_step)
    result = train_and_capture(trainer)
    trainer.close()
    return result, grads


class Lines(logging.Handler):
    """The messages logged while it is installed (caplog is per test; the run is per module)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def uninterrupted(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dump = tmp_path_factory.mktemp("uninterrupted")
    lines, logger = Lines(), logging.getLogger("titan_tpu")
    logger.addHandler(lines)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        result, grads = run(trainer(dump, base, 4))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(previous)
    return {"run": result, "grads": grads, "dump": dump, "lines": lines.lines}


def test_the_start_up_says_what_is_trained(uninterrupted: dict[str, Any]) -> None:
    """Catches a count of the whole model as trained, a total without the adapters or of one shard,
    or optimizer state counted for the base."""
    line = next(line for line in uninterrupted["lines"] if line.startswith("lora: "))
    trained = sum(t.numel() for k, t in uninterrupted["run"].state.items() if k.startswith("param/") and "lora_" in k)
    # 2 layers of 7 adapted linears, A [4, in] and B [out, 4]: rank 4 x (in + out) each; wq and wo are
    # 64 x 64, wk and wv 64 -> 32, w1, w2 and w3 64 x 128. Float32 moments, 8 bytes per element, and 28 steps.
    assert trained == 2 * 4 * (2 * 128 + 2 * 96 + 3 * 192)
    with torch.device("meta"):
        total = sum(p.numel() for p in Qwen3Model(ARGS).parameters()) + trained  # the base and its adapters
    assert line.startswith(f"lora: 8.19K of {count(total)} parameters trained ({100 * trained / total:.3g}%): ")
    assert "rank 4, alpha 8 on 14 linears (wq, wk, wv, wo, w1, w2, w3)" in line
    assert line.endswith(f"AdamW state {(8 * trained + 4 * 28) / 2**20:.3g} MiB on this process")


def test_a_checkpoint_holds_the_adapters_and_never_the_base(uninterrupted: dict[str, Any]) -> None:
    metadata = FileSystemReader(str(uninterrupted["dump"] / "checkpoint" / "step-4")).read_metadata()
    keys = metadata.state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    with torch.device("meta"):
        names = adapter_parameter_names(_adapted_meta_model())
    assert model_keys == set(names) and "layers.0.attention.wq.lora_A" in model_keys
    moments = {k for k in keys if k.startswith("optimizer.state.")}
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments)


def _adapted_meta_model() -> torch.nn.Module:
    from titan_tpu.distributed.parallelize import block_containers
    from titan_tpu.lora.apply import apply_lora

    model = Qwen3Model(ARGS)
    apply_lora(model, load_config("qwen3_debug", RUN).lora, block_containers(model), "the test model")
    return model


def test_resume_equals_the_uninterrupted_run(
    uninterrupted: dict[str, Any], base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps, a restart, two more: every gradient and the final state are the uninterrupted run's,
    bit for bit. Negative control: a resume that does not read the base again (the seed's init as the
    base under the restored adapters) differs."""
    first, _ = run(trainer(tmp_path, base, 2))
    resumed, grads = run(trainer(tmp_path, base, 4))
    assert resumed.steps == [3, 4]
    full, full_grads = uninterrupted["run"], uninterrupted["grads"]
    report = compare(
        RunResult(
            first.steps + resumed.steps,
            first.losses + resumed.losses,
            first.grad_norms + resumed.grad_norms,
            resumed.state,
        ),
        full,
        EXACT,
    )
    assert report.ok, report.failures[:5]
    for step in (3, 4):
        assert grads[step].keys() == full_grads[step].keys()
        assert all(torch.equal(grads[step][k], full_grads[step][k]) for k in grads[step]), step

    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    import titan_tpu.training.initial_state as initial_state

    reads = []
    monkeypatch.setattr(initial_state, "load_hf_weights", lambda *a, **k: reads.append(k))
    wrong, _ = run(trainer(tmp_path, base, 4))
    assert [read["frozen_only"] for read in reads] == [True]  # the base was asked for, and not read
    assert not compare(wrong, full.at(4, full.state), EXACT).ok


def test_a_resume_on_another_base_or_without_lora_is_refused(
    uninterrupted: dict[str, Any], base: Path, tmp_path: Path
) -> None:
    dump = uninterrupted["dump"]
    moved = tmp_path / "elsewhere"
    shutil.copytree(base, moved)
    with pytest.raises(ConfigError) as refused:
        trainer(dump, moved, 6)
    assert str(refused.value) == (
        f"checkpoint.initial_load_path: checkpoint {dump / 'checkpoint' / 'step-4'} holds LoRA adapters trained "
        f"with checkpoint.initial_load_path = {str(base)!r}, this run has {str(moved)!r}; set it back to resume "
        "them, or another job.dump_folder to start afresh"
    )
    with pytest.raises(ConfigError, match=r"^lora.enable: checkpoint .* holds a LoRA run's adapters only, not a whole"):
        trainer(dump, base, 6, "--lora.enable=false", "--lora.rank=16", "--lora.alpha=32")
    with pytest.raises(
        ConfigError, match=r"^lora.alpha: checkpoint .* trained with lora.alpha = 8.0, this run has 16.0"
    ):
        trainer(dump, base, 6, "--lora.alpha=16")


def test_the_seed_is_the_base_only_without_a_folder() -> None:
    from titan_tpu.training.resume_settings import check_lora_base, run_settings

    def config(*more: str) -> Any:
        return load_config("qwen3_debug", ["--lora.enable=true", *more])

    seeded = run_settings(config())
    check_lora_base("step-2", seeded, config())
    with pytest.raises(ConfigError, match=r"^training.seed: checkpoint step-2 holds LoRA adapters trained with "):
        check_lora_base("step-2", seeded, config("--training.seed=1"))
    on_folder = run_settings(config("--checkpoint.initial_load_path=/base"))
    check_lora_base("step-2", on_folder, config("--checkpoint.initial_load_path=/base", "--training.seed=1"))
    # A checkpoint that recorded no lora.enable (saved before LoRA) holds a whole model.
    check_lora_base("step-2", {"optimizer.lr": 1e-3}, load_config("qwen3_debug", []))
    with pytest.raises(ConfigError, match=r"^lora.enable: checkpoint step-2 holds a whole model, not LoRA adapters"):
        check_lora_base("step-2", {"optimizer.lr": 1e-3}, config())


def test_throughput_counts_no_frozen_weight_gradients(base: Path, tmp_path: Path) -> None:
    """A LoRA token costs the family's count less the frozen weights' gradients (2 N) plus 6 FLOPs per
    adapter parameter (titan_tpu/lora/flops.py). Catches MFU counted as full fine-tuning (6 N: the
    negative control, 1.3x too high here), the adapters left out, or the whole backward dropped."""
    run = trainer(tmp_path, base, 1)
    try:
        full = run.spec.flops_per_token(run.model_args, 32)
        two_n = run.spec.flops_per_token(run.model_args, 0) / 3
        adapters = 2 * 4 * (2 * 128 + 2 * 96 + 3 * 192)  # as counted in the start-up test above
        assert run.adapter_params == adapters
        assert run.flops_per_item == pytest.approx(full - two_n + 6 * adapters, rel=1e-12)
        assert run.flops_per_item < 0.8 * full
    finally:
        run.close()
