"""What a restart may change when it resumes from a checkpoint, and the one line that says what it did.

A checkpoint restores the state of training: the weights, the optimizer's moments, the step, the
schedule's position, the data position and the RNG. The run's config decides the rest: the peak lr
and the other optimizer hyperparameters, the schedule's shape, the step count, the batch and the
clipping (titan_tpu/optim.py `apply_config_on_resume`), as in TorchTitan, where the schedule is built
from the config and only its position is restored. The data itself cannot change: the data loader
refuses another source, sequence length or tokenizer (its fingerprint).

Each checkpoint records the values below as its run had them (its manifest's `run_settings`), so the
restart can say which of them it changes. A LoRA checkpoint holds the adapters only: it records the base
they were trained on too, and a restart on another base is refused (`check_lora_base`).
"""

from __future__ import annotations

from typing import Any

from titan_tpu.config import ConfigError, TrainConfig

# The settings a restart may change, as section.key.
TRACKED = (
    "optimizer.lr",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.weight_decay",
    "lr_scheduler.warmup_steps",
    "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_ratio",
    "training.steps",
    "training.global_batch_size",
    "training.max_norm",
)


def run_settings(config: TrainConfig) -> dict[str, Any]:
    """The tracked values of this run and, for LoRA, what its adapters were trained on (`lora_base`),
    JSON-ready."""
    sections = config.sections()
    settings: dict[str, Any] = {}
    for name in TRACKED:
        section, key = name.split(".")
        settings[name] = getattr(sections[section], key)
    return {**settings, **lora_base(config)}


def lora_base(config: TrainConfig) -> dict[str, Any]:
    """What a LoRA checkpoint's adapters only make sense on, which a resume may not change: the frozen
    base (the Hugging Face folder of checkpoint.initial_load_path, or, without one, the seed of the
    model's own init) and the adapters' shape and scaling. Recorded by every run, LoRA or not."""
    lora = config.lora
    if not lora.enable:
        return {"lora.enable": False}
    path = config.checkpoint.initial_load_path
    return {
        "lora.enable": True,
        "checkpoint.initial_load_path": path,
        # The seed makes the base only when no folder does.
        "training.seed": None if path else config.training.seed,
        "lora.rank": lora.rank,
        "lora.alpha": lora.alpha,
        "lora.target_modules": list(lora.target_modules),
    }


def check_lora_base(folder: str, saved: dict[str, Any] | None, config: TrainConfig) -> None:
    """ConfigError (one line) when the checkpoint in `folder`, whose run recorded `saved`, holds
    adapters of another base than this run's, or this run and that one disagree on LoRA itself."""
    now, saved = lora_base(config), saved or {}
    # A checkpoint of a run before LoRA existed recorded no lora.enable: a whole model's.
    was_lora = bool(saved.get("lora.enable", False))
    if was_lora != now["lora.enable"]:
        if was_lora:
            raise ConfigError(
                f"lora.enable: checkpoint {folder} holds a LoRA run's adapters only, not a whole model; set "
                "lora.enable = true (with its base) to resume it, or another job.dump_folder to start afresh"
            )
        raise ConfigError(
            f"lora.enable: checkpoint {folder} holds a whole model, not LoRA adapters; set lora.enable = false to "
            "resume it, or another job.dump_folder to start a LoRA run (checkpoint.initial_load_path names its base)"
        )
    if not was_lora:
        return
    for key, value in now.items():
        if saved.get(key) != value:
            raise ConfigError(
                f"{key}: checkpoint {folder} holds LoRA adapters trained with {key} = {saved.get(key)!r}, this "
                f"run has {value!r}; set it back to resume them, or another job.dump_folder to start afresh"
            )


def changed_settings(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """`key old -> new` for each tracked value this run sets differently from the checkpoint's run
    (nothing for a checkpoint that recorded none)."""
    if not saved:
        return []
    return [
        f"{key} {saved[key]} -> {value}"
        for key, value in now.items()
        if key in TRACKED and key in saved and saved[key] != value
    ]


def check_steps_left(config: TrainConfig, step: int, folder: str) -> None:
    """A run cannot end before the step it resumes from."""
    steps = config.training.steps
    if steps < step:
        raise ConfigError(
            f"training.steps: {steps} is before step {step} of the checkpoint it resumes from ({folder}); set "
            f"training.steps above {step} to train further, or another job.dump_folder to start afresh"
        )


def resume_line(step: int, changes: list[str]) -> str:
    """The log line of a resume that changes tracked values."""
    return (
        f"checkpoint: resumed at step {step} with {', '.join(changes)} from this run's config: the schedule "
        "goes on from that step with them; weights, optimizer moments, data position and RNG are the "
        "checkpoint's"
    )
