"""One training run: set up device, mesh, task, model and optimizer from a config, then loop.

Set-up follows the flow in docs/architecture.md: device and process group, mesh, the training task,
model on `meta`, parallelise, materialise, optimizer, the task's data, metrics, checkpoints. The loop
is the same for every kind of training; what differs (batches, loss, FLOPs per item, evaluation)
comes from the task (titan_tpu/tasks). Nothing here names a device type.

Values that need a device-to-host copy (the loss, the gradient norm, the non-finite check) are read
on logging steps and before a checkpoint only, so an accelerator is never stalled by the host in
between. A non-finite loss is caught at the next such step: before the optimizer step when that
step logs, and always before a checkpoint of the poisoned state could be written.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from pathlib import Path

import torch
from torch import nn

from titan_tpu.autotune.for_run import choose_run_kernels
from titan_tpu.checkpoint import CheckpointManager
from titan_tpu.checkpoint.hf_import import check_hf_config
from titan_tpu.config import ResolvedConfig, TrainConfig, write_resolved_config
from titan_tpu.config.batch import split_global_batch
from titan_tpu.config.sections import CheckpointConfig
from titan_tpu.device import Device, dtype_name, host_peak_flops, resolve_compute_dtype, select_device
from titan_tpu.device.peak import peak_covering
from titan_tpu.distributed import process_group
from titan_tpu.distributed.comm_timeouts import CommTimeouts
from titan_tpu.distributed.grad_utils import clip_grad_norm_
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.parallelize import block_containers, parallelize_model
from titan_tpu.distributed.pipeline import PipelineRunner, build_pipeline
from titan_tpu.distributed.topology import build_rank_layout
from titan_tpu.lora.apply import apply_lora
from titan_tpu.lora.flops import lora_training_flops_per_token
from titan_tpu.metrics.logger import MetricsLogger, StepRecord
from titan_tpu.metrics.mfu import mfu_percent, task_flops_per_sec, with_task_mfu
from titan_tpu.metrics.plot import write_run_loss_chart
from titan_tpu.metrics.profiler import StepProfiler
from titan_tpu.metrics.progress import Progress
from titan_tpu.optim import build_lr_scheduler, build_optimizer
from titan_tpu.protocols.tunable import KernelShape
from titan_tpu.tasks.base import TaskContext, TrainingTask
from titan_tpu.tasks.registry import task_class
from titan_tpu.training.forward_backward import accumulated_forward_backward, pipeline_forward_backward
from titan_tpu.training.initial_state import load_initial_state, model_name
from titan_tpu.training.preemption import Preempted, PreemptionWatch
from titan_tpu.training.record_window import RecordWindow, is_eval_step, is_record_step, mean_over_data_parallel
from titan_tpu.training.registered_names import RegisteredNames, check_registered_names
from titan_tpu.training.resume_settings import run_settings
from titan_tpu.training.run_report import count_parameters, start_report
from titan_tpu.training.seeding import seed_everything

logger = logging.getLogger("titan_tpu")


class TrainingStopped(RuntimeError):
    """The run cannot go on (a non-finite loss); the message names the step."""


class Trainer:
    # "auto" kernels are measured on the device; a subclass that has none to measure on (the dry run,
    # titan_tpu/dryrun) takes their fallbacks.
    measure_kernels = True

    def __init__(
        self,
        config: TrainConfig,
        names: RegisteredNames | None = None,
        process: process_group.ProcessInfo | None = None,
    ):
        """`names`: the config's names as the entry point already checked them (train.py does, before
        logging starts); without them the trainer checks them itself. `process`: this process's rank
        and world size, torchrun's (the environment's) unless given (the dry run simulates one)."""
        self.config = config  # as loaded, never written: what the run decides goes into self.resolved
        self.registered = names or check_registered_names(config)
        self.process = process or process_group.process_info()
        self.comm = CommTimeouts(config.comm, self.process.rank)
        try:
            self._setup_device()
            self._setup_parallelism()
            self._setup_task()
            self._setup_model()
            self._setup_optimizer()
            # A task reads the model's arguments; with several pipeline stages per rank, from the first.
            self.task.setup(self.model if self.pipeline is None else self.pipeline.modules[0])
            self._setup_metrics()
            self._setup_checkpointing()
        except RuntimeError as error:
            self.comm.raise_if_timeout(error)
            raise

    # ------------------------------------------------------------------------------ set-up steps

    def _setup_device(self) -> None:
        """Device, process group, compute dtype and seeds; the resolved config is written here."""
        config = self.config
        self.device: Device = select_device(config.device.type, self.process.local_rank)
        self.model_device = self.device.torch_device  # where the model is materialised
        process_group.init_process_group(self.device.backend, self.process, timeout_s=self.comm.seconds)
        self.is_writer = self.process.rank == 0
        self.dump_folder = Path(config.job.dump_folder)
        self.compute_dtype = resolve_compute_dtype(config.training.dtype, self.device)
        dtype, registered = dtype_name(self.compute_dtype), self.registered
        self.resolved = ResolvedConfig(config, dtype, registered.model_overrides, registered.task)
        if self.is_writer:
            logger.info("device: %s, compute dtype %s", self.device.name(), self.resolved.compute_dtype)
            write_resolved_config(self.dump_folder, self.resolved)
        seed_everything(config.training.seed, config.training.deterministic)

    def _setup_parallelism(self) -> None:
        """Degrees from [parallelism], validated against the process count; the named meshes laid
        onto the interconnect (none for a single process); this rank's share of the global batch."""
        cfg, training = self.config.parallelism, self.config.training
        dims = ParallelDims.from_config(cfg, self.process.world_size)
        meshes = {}
        if self.is_writer:
            logger.info("parallelism: %s on %d process(es)", dims.describe(), dims.world_size)
        if dims.is_distributed:
            names, sizes = dims.mesh_axes()
            layout = build_rank_layout(self.device.type, names, sizes, self.process.rank)
            meshes = dims.build_meshes(self.device.type, layout)
        self.comm.govern(meshes.values())
        self.parallel = ParallelContext(dims, meshes, cfg.sequence_parallel, cfg.loss_parallel)
        self.dp_rank, self.dp_world = self.parallel.dp_coordinates()
        self.local_batch_size, self.grad_accum_steps = split_global_batch(
            training.global_batch_size, training.local_batch_size, self.dp_world
        )

    def _setup_task(self) -> None:
        """The training task (what is trained and how a batch becomes a loss) and the model
        arguments it fits to the run."""
        config = self.config
        self.spec = self.registered.spec
        context = TaskContext(
            config=config,
            spec=self.spec,
            device=self.device.torch_device,
            compute_dtype=self.compute_dtype,
            parallel=self.parallel,
            dp_rank=self.dp_rank,
            dp_world=self.dp_world,
            local_batch_size=self.local_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            dump_folder=self.dump_folder,
            is_writer=self.is_writer,
        )
        self.task: TrainingTask = task_class(self.registered.task)(context)
        args = self.task.model_args(self.spec.args_for(config))
        initial = config.checkpoint.initial_load_path
        if initial and self.spec.state_dict_adapter is not None:
            # Before the kernels are measured at the model's shapes and the model is built: a mismatched
            # folder should cost neither a measurement nor a materialised 405B model.
            check_hf_config(Path(initial), self.spec.state_dict_adapter, args, model_name(config))
        dims = self.parallel.dims
        shape = KernelShape(
            self.device.torch_device,
            self.compute_dtype,
            self.local_batch_size,
            config.training.seq_len,
            autocast=self.task.ctx.uses_autocast,
            document_mask=config.data.document_mask,
            eager_loss=self.task.chunked_loss and not self.parallel.loss_parallel_enabled,
            tp=dims.tp,
            ep=dims.ep,
            splash_op=self.device.splash_attention_op(),
        )
        # The kernels "auto" left to measurement, what each became and the candidates' times.
        self.model_args, self.kernels = choose_run_kernels(
            self.spec.tunables, args, shape, self.device, config, self.is_writer, measure=self.measure_kernels
        )

    def _setup_model(self) -> None:
        """On meta, then TP/SP -> AC -> compile -> FSDP -> materialise + init (identical weights on
        every layout; see titan_tpu/distributed/parallelize.py)."""
        config = self.config
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        self.parameter_count = count_parameters(model)  # of the whole model, before a layout splits it
        # LoRA's adapters go in on meta, before the plan, AC, compile and FSDP see the linears.
        self.lora_targets: list[str] = []
        if config.lora.enable:
            self.lora_targets = apply_lora(
                model, config.lora, block_containers(model), model_name(config), base_dtype=self.compute_dtype
            )
        # On meta, whole tensors: what a token's adapters cost (lora/flops.py).
        self.adapter_params = count_parameters(model, trained_only=True) if config.lora.enable else 0
        self.pipeline: PipelineRunner | None = None
        self.model: nn.Module
        if self.parallel.dims.pp_enabled:
            # This rank's stages only (titan_tpu/distributed/pipeline.py); the task's loss runs on the last.
            self.model, self.pipeline = build_pipeline(
                model,
                self.spec,
                self.parallel,
                config,
                self.model_device,
                self.compute_dtype,
                self.local_batch_size,
                self.task.pipeline_loss,
            )
            return
        self.model = parallelize_model(
            model,
            self.spec.parallelize,
            self.parallel,
            config,
            self.model_device,
            self.compute_dtype,
        )

    def _setup_optimizer(self) -> None:
        # What the optimizer steps (a LoRA run's adapters only) and every step clips: listed once here.
        self.trained_params = [param for param in self.model.parameters() if param.requires_grad]
        self.optimizer = build_optimizer(self.model, self.config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.lr_scheduler, self.config.training.steps)
        self.step = 0

    def _setup_metrics(self) -> None:
        """FLOPs per item for MFU; the peak of the dtypes this run computes in; the sinks.

        Every process of a data-parallel group processes the same items when tp (or another
        non-data-parallel axis) is > 1, so per-process throughput divides by that degree."""
        self.flops_per_item = self.task.flops_per_item()
        if self.config.lora.enable and self.task.unit == "tokens":
            # The frozen weights' gradients are not computed (titan_tpu/lora/flops.py).
            full = self.spec.flops_per_token(self.model_args, self.config.training.seq_len)
            at_no_context = self.spec.flops_per_token(self.model_args, 0)
            lora = lora_training_flops_per_token(full, at_no_context, self.adapter_params)
            self.flops_per_item -= full - lora
        self.model_parallel_degree = self.process.world_size // self.dp_world
        self.peak_flops = host_peak_flops(self.device, self.compute_dtype)
        resolved = self.resolved.effective()
        run_config = {name: dataclasses.asdict(section) for name, section in resolved.sections().items()}
        self.metrics = MetricsLogger(self.config.metrics, self.dump_folder, self.is_writer, run_config=run_config)
        self.profiler = StepProfiler(self.config.profiling, self.dump_folder, self.process.rank, self.device.type)

    def _checkpoint_manager(self, cfg: CheckpointConfig) -> CheckpointManager:
        """The run's checkpoint manager over its model, optimizer, schedule and data state."""
        return CheckpointManager(
            cfg,
            self.dump_folder,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.task.data_state(),
            device_type=self.device.type,
            pipeline_stages=self.pipeline is not None,
            run_settings=run_settings(self.config),
            trainable_only=self.config.lora.enable,  # a LoRA run saves its adapters; the base is rebuilt
        )

    def _setup_checkpointing(self) -> None:
        config = self.config
        self.checkpointer = self._checkpoint_manager(config.checkpoint)
        self.comm.govern_group(self.checkpointer.process_group)
        if not config.checkpoint.create_seed_checkpoint:
            self.step = load_initial_state(
                config,
                self.checkpointer,
                self.model,
                self.optimizer,
                self.lr_scheduler,
                self.spec,
                self.model_args,
                self.is_writer,
            )

    # ------------------------------------------------------------------------------------ loop

    def forward_backward(self) -> tuple[torch.Tensor, int]:
        """Loss and gradients of one optimizer step (titan_tpu/training/forward_backward.py): the step's mean
        loss (a device tensor, this rank's) and the items this rank trained on."""
        if self.pipeline is not None:
            return pipeline_forward_backward(self.model, self.pipeline, self.task)
        loss_parallel = self.parallel.loss_parallel_enabled
        device = self.device.torch_device
        return accumulated_forward_backward(self.model, self.task, self.grad_accum_steps, loss_parallel, device)

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step the optimizer and the schedule; returns the gradient norm before clipping (a
        device tensor)."""
        # With pp > 1 each rank holds its stages' gradients; the norm is taken over every stage's.
        pp_mesh = self.parallel.pp_mesh if self.parallel.dims.pp_enabled else None
        grad_norm = clip_grad_norm_(self.trained_params, self.config.training.max_norm, pp_mesh=pp_mesh)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return grad_norm

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One step as `train()` takes it (the same forward/backward, optimizer step, step count and
        collective timeouts), without its records, checkpoints or finite-loss check: the public way
        in for benchmarks that time steps themselves (scripts/bench.py). Returns (loss, grad norm)
        as device tensors, so nothing waits for the device, and the items trained on this rank."""
        loss, items = self.forward_backward()
        grad_norm = self.optimizer_step()
        self.step += 1
        self.comm.start_training()
        return loss, grad_norm, items

    def _read_losses(self, losses: list[torch.Tensor], first_step: int) -> list[float]:
        """The losses of steps `first_step`, `first_step + 1`, ..., averaged over data-parallel (and
        context-parallel) ranks: one reduction and one device-to-host read. A sum over ranks is
        finite only when every rank's loss is, so the same read stops the run at the first
        non-finite step."""
        means = mean_over_data_parallel(losses, self.parallel)
        for offset, value in enumerate(means):
            if not math.isfinite(value):
                raise TrainingStopped(
                    f"step {first_step + offset}: loss is {value} (mean over data-parallel ranks); stopped "
                    f"before the optimizer step of step {self.step + 1}, no checkpoint of this state was "
                    "written (checkpoints of earlier steps are untouched)"
                )
        return means

    def train(self) -> list[StepRecord]:
        training = self.config.training
        if self.config.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, model_only=True)
            self.checkpointer.close()
            self.metrics.close()
            return []
        self.report = start_report(self)  # the start-up line; the clock of the eta and the last line
        records: list[StepRecord] = []
        window = RecordWindow()
        self.device.synchronize()
        self.device.reset_peak_memory()
        window.reset()
        # The first step compiles every block (minutes on a large model): say so, and how long it took.
        compiling = None
        if self.config.compile.enable and self.is_writer:
            compiling = Progress("first step, compiling", 1, "step")
        # SIGTERM/SIGINT: the step in progress ends, is saved, and the run exits (training/preemption.py).
        preemption = PreemptionWatch(self.config.checkpoint.preemption_grace_s, self.is_writer)
        preemption.install()
        try:
            while self.step < training.steps:
                step = self.step + 1
                record_now = is_record_step(step, self.config)
                saving = self.checkpointer.will_save(step, last=step == training.steps)
                # The groups' lr, which a resume sets (the schedule's `get_last_lr` keeps the saved one).
                lr = float(self.optimizer.param_groups[0]["lr"])
                with self.profiler.step(step):
                    loss, items = self.forward_backward()
                    window.add(loss, items)
                    if record_now or saving:
                        # Before the optimizer step: a non-finite loss of this step never reaches the
                        # weights, and one of an earlier step of the window never reaches a checkpoint.
                        mean_loss = self._read_losses(window.losses, first_step=step - window.steps + 1)[-1]
                    grad_norm = self.optimizer_step()
                if compiling is not None:
                    self.device.synchronize()  # the time of the compile and the step, not of queueing them
                    compiling.advance()
                    compiling.finish()
                    compiling = None
                self.step = step
                if record_now:
                    record = self._record(mean_loss, grad_norm, lr, window)
                    self.metrics.log(record)
                    records.append(record)
                    self.device.reset_peak_memory()
                    window.reset()
                self.checkpointer.maybe_save(self.step, last=self.step == training.steps)
                if self.step < training.steps and (signum := preemption.agreed_signal()):
                    if window.steps:  # losses not read yet: a non-finite one never reaches the checkpoint
                        self._read_losses(window.losses, first_step=step - window.steps + 1)
                    preemption.stop(signum, self.step, self.checkpointer, saved=saving)
                self.comm.start_training()
        except BaseException as error:
            if not isinstance(error, Preempted):
                preemption.abandon()  # a signal from now on ends the process, as torchrun expects
            if isinstance(error, RuntimeError):
                self.comm.raise_if_timeout(error)
            raise
        finally:
            self.profiler.close()
            try:
                self.checkpointer.close()
                self.metrics.close()
            finally:
                preemption.restore()  # after the last save is committed, which a signal must not cut short
        chart = self._draw_loss_chart() if self.is_writer and self.config.metrics.plot_loss else None
        if self.is_writer:
            logger.info(self.report.final_line(self.step, records, chart))
        return records

    def _draw_loss_chart(self) -> Path | None:
        """dump_folder/loss.png from the run's metrics.jsonl; a chart that cannot be drawn never fails
        a run that has finished training."""
        try:
            path = write_run_loss_chart(self.dump_folder, self.process.world_size)
        except Exception as error:  # whatever matplotlib or a damaged metrics file raises
            logger.warning("metrics: loss chart not drawn (%s)", error)
            return None
        logger.info("metrics: loss chart in %s", path)
        return path

    def rates(self, items: int, seconds: float) -> tuple[float, float]:
        """(items/s, model FLOP/s) per process for `items` trained by this rank in `seconds`: the
        processes of one model-parallel group train on the same items, so each claims its share."""
        items_per_sec = items / self.model_parallel_degree / seconds
        return items_per_sec, items_per_sec * self.flops_per_item

    def _record(self, mean_loss: float, grad_norm: torch.Tensor, lr: float, window: RecordWindow) -> StepRecord:
        """The step's record; waits for the device, reads the grad norm, and runs the task's
        evaluation when it is due."""
        self.device.synchronize()
        elapsed = time.perf_counter() - window.start
        extras: dict[str, float] = dict(self.task.step_metrics())
        if is_eval_step(self.step, self.config):
            # Outside the timed window: evaluation is not training throughput.
            extras.update(self.evaluate())
        items_per_sec, flops_per_sec = self.rates(window.items, elapsed)
        # The peak must cover the work the task timed itself too (GRPO's rollouts), which can run faster.
        fastest = max([flops_per_sec, *task_flops_per_sec(extras)])
        self.peak_flops = peak_covering(self.peak_flops, fastest, self.device.type, self.compute_dtype)
        return StepRecord(
            step=self.step,
            loss=mean_loss,
            grad_norm=float(grad_norm),
            lr=lr,
            unit=self.task.unit,
            items_per_sec=items_per_sec,
            tflops=flops_per_sec / 1e12,
            mfu=mfu_percent(flops_per_sec, self.peak_flops),
            memory_gib=self.device.peak_memory_gib(),
            step_time_s=elapsed / window.steps,
            extras=with_task_mfu(extras, self.peak_flops),
            total_steps=self.config.training.steps,
            eta_s=self.report.eta_s(self.step),
            console=self.task.console_view(mean_loss, extras),
        )

    def evaluate(self) -> dict[str, float]:
        """The task's evaluation of the model as it is now, in the run's precision."""
        with self.task.ctx.autocast():
            return self.task.evaluate(self.model, self.step)

    def close(self) -> None:
        self.task.close()
        process_group.destroy_process_group()
        # Free the last collectives' tensors now: left to interpreter shutdown, a gloo thread can still
        # be releasing one and the process aborts after a successful run.
        gc.collect()
