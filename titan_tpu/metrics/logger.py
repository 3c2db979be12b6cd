"""Where a step's record goes: the console, dump_folder/metrics.jsonl, TensorBoard and W&B.

Only rank 0 writes. Each JSON line is written whole and flushed, so a run that stops at any point
leaves a file of complete records.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from titan_tpu.config.sections import MetricsConfig
from titan_tpu.metrics.console import ConsoleView, duration

logger = logging.getLogger("titan_tpu")

# One JSON record per logged step, in the dump folder; charts and resumed runs read it back.
METRICS_FILE = "metrics.jsonl"


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    unit: str  # what the task counts: "tokens", "samples"
    items_per_sec: float  # per process: the items of its data-parallel group / model-parallel degree
    tflops: float  # achieved model TFLOP/s per process
    mfu: float | None  # percent of the device's peak; None when the peak is unknown
    memory_gib: float  # peak device memory (peak RSS on a CPU) since the previous record
    step_time_s: float
    extras: dict[str, float] = field(default_factory=dict)  # the task's own values (reward, accuracy)
    # For the console line only (metrics.jsonl keeps its keys): `step N/T`, the time left, and which
    # of the task's values the line shows.
    total_steps: int | None = None
    eta_s: float | None = None
    console: ConsoleView = field(default_factory=ConsoleView)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record: the throughput is named after the unit (`tokens_per_sec`)."""
        record: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            f"{self.unit}_per_sec": self.items_per_sec,
            "tflops": self.tflops,
            "mfu": self.mfu,
            "memory_gib": self.memory_gib,
            "step_time_s": self.step_time_s,
        }
        record.update(self.extras)
        return record

    def console_line(self) -> str:
        """The step's values for a person: `step N/T`, the loss, the device's numbers, the time per
        step and left, then the task's values; with `console.brief` only the task's chosen values,
        the throughput and the times, short enough for a terminal."""
        view = self.console
        total = f"/{self.total_steps}" if self.total_steps else ""
        head = [f"step {self.step:{len(total) - 1 if total else 6}d}{total}", f"loss {self.loss:8.4f}"]
        shown = view.shown if view.shown is not None else tuple((key, key) for key in self.extras)
        extras = [f"{label} {self.extras[key]:.4g}" for key, label in shown if key in self.extras]
        unit = {"tokens": "tok", "samples": "smp"}.get(self.unit, self.unit)
        rate = f"{unit}/s {self.items_per_sec:9.1f}"
        times = [f"{self.step_time_s:6.3f} s/step"]
        if self.eta_s is not None:
            times.append(f"eta {duration(self.eta_s)}")
        if view.brief:
            return " | ".join([*head, *extras, rate, *times])
        mfu = f"{self.mfu:5.1f}%" if self.mfu is not None else "  n/a"
        device = [f"TFLOP/s {self.tflops:7.3f}", f"mfu {mfu}", f"mem {self.memory_gib:6.2f} GiB"]
        optimizer = [f"grad_norm {self.grad_norm:7.3f}", f"lr {self.lr:.2e}"]
        return " | ".join([*head, *optimizer, rate, *device, *times, *extras])


class MetricsLogger:
    def __init__(self, cfg: MetricsConfig, dump_folder: Path, is_writer: bool, run_config: dict[str, Any]):
        self.is_writer = is_writer
        self._jsonl = None
        self._tensorboard = None
        self._wandb_run = None
        if not is_writer:
            return
        dump_folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(dump_folder / METRICS_FILE, "a", encoding="utf-8")
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(dump_folder / "tb"))
        if cfg.enable_wandb:
            import wandb

            # Offline unless the user has logged in or chosen a mode: a run must never hang on a network.
            logged_in = bool(os.environ.get("WANDB_API_KEY"))
            # A user's WANDB_MODE goes to wandb as it is: wandb.init refuses one it does not know.
            mode = cast(
                Literal["online", "offline", "disabled", "shared"],
                os.environ.get("WANDB_MODE", "online" if logged_in else "offline"),
            )
            self._wandb_run = wandb.init(project=cfg.wandb_project, dir=str(dump_folder), config=run_config, mode=mode)

    def log(self, record: StepRecord) -> None:
        if not self.is_writer:
            return
        logger.info(record.console_line())
        if record.console.note:
            logger.info("step %d: %s", record.step, record.console.note)
        assert self._jsonl is not None
        values = record.to_dict()
        self._jsonl.write(json.dumps(values) + "\n")
        self._jsonl.flush()
        scalars = {k: v for k, v in values.items() if k != "step" and v is not None}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, record.step)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=record.step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
