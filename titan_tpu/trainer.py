"""One training run: set up device, model, data and optimizer from a config, then loop.

The order of set-up follows DESIGN.md: device and process group, model on `meta`, parallelise,
materialise on the device, then optimizer, data and metrics. Nothing here names a device type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
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
from torch.distributed.device_mesh import DeviceMesh

import models
from titan_tpu.checkpoint import CheckpointManager
from titan_tpu.checkpoint.hf import check_hf_config, load_hf_weights
from titan_tpu.config import ConfigError, TrainConfig, to_toml
from titan_tpu.data.loader import build_dataloader
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.device import Device, select_device
from titan_tpu.distributed import process_group
from titan_tpu.distributed.compile import compile_loss, resolve_backend
from titan_tpu.distributed.grad_utils import clip_grad_norm_, mean_over
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.distributed.tensor_parallel import loss_context, local_value
from titan_tpu.distributed.topology import build_rank_layout
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


def write_resolved_config(dump_folder: Path, text: str) -> None:
    """Write dump_folder/config.toml; a different one left by an earlier run in the same folder is
    kept as config.N.toml rather than overwritten."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    path = dump_folder / "config.toml"
    if path.exists() and path.read_text(encoding="utf-8") != text:
        previous = 1
        while (dump_folder / f"config.{previous}.toml").exists():
            previous += 1
        path.rename(dump_folder / f"config.{previous}.toml")
    path.write_text(text, encoding="utf-8")


def split_global_batch(global_batch: int, local_batch: int, dp_degree: int) -> tuple[int, int]:
    """(sequences per forward pass, micro-batches per step); local -1 means no accumulation."""
    if local_batch == -1:
        if global_batch % dp_degree != 0:
            raise ConfigError(
                f"training.global_batch_size {global_batch} is not divisible by the data-parallel "
                f"degree {dp_degree}"
            )
        return global_batch // dp_degree, 1
    per_step = local_batch * dp_degree
    if global_batch % per_step != 0:
        raise ConfigError(
            f"training.global_batch_size {global_batch} is not divisible by local_batch_size "
            f"{local_batch} x data-parallel degree {dp_degree} = {per_step}"
        )
    return local_batch, global_batch // per_step


class Trainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        self.process = process_group.process_info()
        self.device: Device = select_device(config.device.type, self.process.local_rank)
        process_group.init_process_group(self.device.backend, self.process)
        self.is_writer = self.process.rank == 0
        self.dump_folder = Path(config.job.dump_folder)
        if self.is_writer:
            write_resolved_config(self.dump_folder, to_toml(config))

        training = config.training
        self.compute_dtype = torch.bfloat16 if training.dtype == "bfloat16" else torch.float32
        if self.compute_dtype == torch.bfloat16 and not self.device.supports_bfloat16():
            raise ConfigError(
                f"training.dtype = 'bfloat16' but {self.device.name()} has no bf16 support; "
                "use 'float32'"
            )
        seed_everything(training.seed, training.deterministic)

        self.parallel = self._build_parallelism()
        self.dp_rank, self.dp_world = self.parallel.dp_coordinates()
        self.local_batch_size, self.grad_accum_steps = split_global_batch(
            training.global_batch_size, training.local_batch_size, self.dp_world
        )

        self.spec = models.get_model_spec(config.model.name)
        # Rotary tables are sized by max_seq_len; published flavors allow 128K, a run needs seq_len.
        attention_block = config.model.attention_block
        self.model_args = dataclasses.replace(
            self.spec.flavor(config.model.flavor),
            max_seq_len=training.seq_len,
            attention_block=attention_block if attention_block >= 0 else self.device.attention_block(),
        )
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"data.tokenizer has {self.tokenizer.vocab_size} tokens but model "
                f"{config.model.name} {config.model.flavor} has vocab_size "
                f"{self.model_args.vocab_size}; pick a tokenizer or flavor that fits"
            )
        if config.checkpoint.initial_load_path and self.spec.state_dict_adapter is not None:
            # Before the model is built: a mismatched folder should not cost a materialised 405B model.
            check_hf_config(
                Path(config.checkpoint.initial_load_path),
                self.spec.state_dict_adapter,
                self.model_args,
                f"model {config.model.name} flavor {config.model.flavor}",
            )
        self.model = self._build_model()
        self.loss_fn = self.spec.loss_fn
        if config.compile.enable and not self.parallel.loss_parallel_enabled:
            self.loss_fn = compile_loss(
                self.loss_fn, resolve_backend(config.compile.backend, self.device.type)
            )
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, training.steps)
        self.dataloader = build_dataloader(
            config.data,
            self.tokenizer,
            seq_len=training.seq_len,
            local_batch_size=self.local_batch_size,
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
        self.checkpointer = CheckpointManager(
            config.checkpoint,
            self.dump_folder,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            device_type=self.device.type,
        )
        if not config.checkpoint.create_seed_checkpoint:
            self._load_initial_state()

    def _load_initial_state(self) -> None:
        """Resume from the newest complete checkpoint (or checkpoint.load_step); without one, take the
        weights from checkpoint.initial_load_path when it is set (a Hugging Face folder)."""
        step = self.checkpointer.load()
        path = self.config.checkpoint.initial_load_path
        if step is not None:
            self.step = step
            if path and self.is_writer:
                logger.info("checkpoint: resumed at step %d, so initial_load_path is not used", step)
            return
        if path:
            model = self.config.model
            load_hf_weights(
                self.model,
                path,
                self.spec.state_dict_adapter,
                self.model_args,
                what=f"model {model.name} flavor {model.flavor}",
            )
            if self.is_writer:
                logger.info("checkpoint: initial weights from %s", path)

    def _build_parallelism(self) -> ParallelContext:
        """Degrees from [parallelism], validated against the process count, and the named meshes
        laid onto the interconnect (none for a single process)."""
        cfg = self.config.parallelism
        dims = ParallelDims.from_config(cfg, self.process.world_size)
        meshes: dict[str, DeviceMesh] = {}
        if self.is_writer:
            logger.info("parallelism: %s on %d process(es)", dims.describe(), dims.world_size)
        if dims.is_distributed:
            names, sizes = dims.mesh_axes()
            layout = build_rank_layout(
                self.device.type, names, sizes, self.process.rank, self.process.local_rank
            )
            meshes = dims.build_meshes(self.device.type, layout)
        return ParallelContext(dims, meshes, cfg.sequence_parallel, cfg.loss_parallel)

    def _build_model(self) -> nn.Module:
        """On meta, then TP/SP -> AC -> compile -> FSDP -> materialise + init (identical weights on
        every layout; see titan_tpu/distributed/parallelize.py)."""
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        return parallelize_model(
            model,
            self.spec.parallelize,
            self.parallel,
            self.config,
            self.device.torch_device,
            self.device.type,
            self.compute_dtype,
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        # Under FSDP the mixed-precision policy casts parameters to the compute dtype already.
        if self.compute_dtype == torch.float32 or self.parallel.dims.fsdp_enabled:
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
            # With loss parallel the logits are vocab-sharded: loss and backward run in its context.
            with loss_context(self.parallel.loss_parallel_enabled):
                loss = self.loss_fn(output, labels) / self.grad_accum_steps
                loss.backward()
            loss_sum += local_value(loss.detach())

        # FSDP reduced (averaged) the gradients over data parallelism during backward.
        loss_value = self._global_mean(loss_sum)
        if not math.isfinite(loss_value):
            raise TrainingStopped(
                f"step {self.step + 1}: loss is {loss_value}; stopping before the optimizer step "
                "(weights and checkpoints of earlier steps are untouched)"
            )
        max_norm = self.config.training.max_norm
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss_value, float(grad_norm)

    def _global_mean(self, value: torch.Tensor) -> float:
        return mean_over(value, self.parallel.meshes.get("dp") if self.dp_world > 1 else None)

    def train(self) -> list[StepRecord]:
        training = self.config.training
        log_freq = self.config.metrics.log_freq
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True)
            self.checkpointer.close()
            self.metrics.close()
            return []
        batches = iter(self.dataloader)
        records: list[StepRecord] = []
        tokens_per_step = self.grad_accum_steps * self.local_batch_size * training.seq_len
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
                self.checkpointer.maybe_save(self.step, last=self.step == training.steps)
        finally:
            self.checkpointer.close()
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
        # Free the last collectives' tensors now: left to interpreter shutdown, a gloo thread can still
        # be releasing one and the process aborts after a successful run.
        gc.collect()


def config_dict(config: TrainConfig) -> dict[str, dict[str, object]]:
    return {name: dataclasses.asdict(section) for name, section in config.sections().items()}
