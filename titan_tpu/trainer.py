"""One training run: set up device, model, data and optimizer from a config, then loop.

The order of set-up follows DESIGN.md: device and process group, model on `meta`, parallelise,
materialise on the device, then optimizer, data and metrics. Nothing here names a device type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

import models
from titan_tpu.config import ConfigError, TrainConfig, to_toml
from titan_tpu.data.loader import build_dataloader
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.device import Device, select_device
from titan_tpu.distributed import process_group
from titan_tpu.distributed.data_parallel import average_gradients
from titan_tpu.metrics.logger import MetricsLogger, StepRecord
from titan_tpu.metrics.peak import peak_flops
from titan_tpu.optim import build_lr_scheduler, build_optimizer

logger = logging.getLogger("titan_tpu")


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss); the message names the step."""


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


class Trainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        self.process = process_group.process_info()
        self.device: Device = select_device(config.device.type, self.process.local_rank)
        process_group.init_process_group(self.device.backend, self.process)
        self.is_writer = self.process.rank == 0
        self.dump_folder = Path(config.job.dump_folder)
        if self.is_writer:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / "config.toml").write_text(to_toml(config), encoding="utf-8")

        training = config.training
        self.compute_dtype = torch.bfloat16 if training.dtype == "bfloat16" else torch.float32
        if self.compute_dtype == torch.bfloat16 and not self.device.supports_bfloat16():
            raise ConfigError(
                f"training.dtype = 'bfloat16' but {self.device.name()} has no bf16 support; "
                "use 'float32'"
            )
        seed_everything(training.seed, training.deterministic)

        self.dp_rank, self.dp_world = self.process.rank, self.process.world_size
        per_step = training.local_batch_size * self.dp_world
        if training.global_batch_size % per_step != 0:
            raise ConfigError(
                f"training.global_batch_size {training.global_batch_size} is not divisible by "
                f"local_batch_size {training.local_batch_size} x data-parallel degree "
                f"{self.dp_world} = {per_step}"
            )
        self.grad_accum_steps = training.global_batch_size // per_step

        self.spec = models.get_model_spec(config.model.name)
        # Rotary tables are sized by max_seq_len; published flavors allow 128K, a run needs seq_len.
        self.model_args = dataclasses.replace(
            self.spec.flavor(config.model.flavor), max_seq_len=training.seq_len
        )
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"data.tokenizer has {self.tokenizer.vocab_size} tokens but model "
                f"{config.model.name} {config.model.flavor} has vocab_size "
                f"{self.model_args.vocab_size}; pick a tokenizer or flavor that fits"
            )
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, training.steps)
        self.dataloader = build_dataloader(
            config.data,
            self.tokenizer,
            seq_len=training.seq_len,
            local_batch_size=training.local_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world,
            seed=training.seed,
        )
        self.step = 0
        self.flops_per_token = self.spec.flops_per_token(self.model_args, training.seq_len)
        self.peak_flops = peak_flops(self.device.type, self.device.name(), self.compute_dtype)
        self.metrics = MetricsLogger(
            config.metrics, self.dump_folder, self.is_writer, run_config=config_dict(config)
        )

    def _build_model(self) -> nn.Module:
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        model.to_empty(device=self.device.torch_device)
        with torch.no_grad():
            # Same seed on every rank: plain data parallelism needs identical replicas.
            torch.manual_seed(self.config.training.seed)
            model.init_weights(buffer_device=self.device.torch_device)
        model.train()
        return model

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns (loss, grad norm)."""
        device = self.device.torch_device
        loss_sum = torch.zeros((), device=device)
        for _ in range(self.grad_accum_steps):
            batch = next(batches)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with self._autocast():
                output = self.model(input_ids)
            # Every micro-batch holds the same number of tokens, so the mean of means is the mean.
            loss = self.spec.loss_fn(output, labels) / self.grad_accum_steps
            loss.backward()
            loss_sum += loss.detach()

        average_gradients(self.model, self.dp_world)
        loss_value = self._global_mean(loss_sum)
        if not math.isfinite(loss_value):
            raise TrainingStopped(
                f"step {self.step + 1}: loss is {loss_value}; stopping before the optimizer step "
                "(weights and checkpoints of earlier steps are untouched)"
            )
        max_norm = self.config.training.max_norm
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss_value, float(grad_norm)

    def _global_mean(self, value: torch.Tensor) -> float:
        if self.dp_world > 1:
            value = value.clone()
            torch.distributed.all_reduce(value)
            value /= self.dp_world
        return float(value)

    def train(self) -> list[StepRecord]:
        training = self.config.training
        log_freq = self.config.metrics.log_freq
        batches = iter(self.dataloader)
        records: list[StepRecord] = []
        tokens_per_step = self.grad_accum_steps * training.local_batch_size * training.seq_len
        self.device.synchronize()
        window_start, window_steps = time.perf_counter(), 0
        try:
            while self.step < training.steps:
                lr = self.lr_scheduler.get_last_lr()[0]
                loss, grad_norm = self.train_step(batches)
                self.step += 1
                window_steps += 1
                if self.step == 1 or self.step % log_freq == 0 or self.step == training.steps:
                    self.device.synchronize()
                    elapsed = time.perf_counter() - window_start
                    record = self._record(loss, grad_norm, lr, window_steps, elapsed, tokens_per_step)
                    self.metrics.log(record)
                    records.append(record)
                    window_start, window_steps = time.perf_counter(), 0
        finally:
            self.metrics.close()
        return records

    def _record(
        self, loss: float, grad_norm: float, lr: float, steps: int, elapsed: float, tokens_per_step: int
    ) -> StepRecord:
        tokens_per_sec = steps * tokens_per_step / elapsed
        flops_per_sec = tokens_per_sec * self.flops_per_token
        mfu = 100 * flops_per_sec / self.peak_flops if self.peak_flops else None
        return StepRecord(
            step=self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens_per_sec=tokens_per_sec,
            tflops=flops_per_sec / 1e12,
            mfu=mfu,
            memory_gib=self.device.peak_memory_gib(),
            step_time_s=elapsed / steps,
        )

    def close(self) -> None:
        process_group.destroy_process_group()


def config_dict(config: TrainConfig) -> dict[str, dict[str, object]]:
    return {name: dataclasses.asdict(section) for name, section in config.sections().items()}
