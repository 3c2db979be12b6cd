"""A dry run of one config at one world size, rank by rank (titan_tpu/dryrun/__init__.py says what)."""

from __future__ import annotations

import copy
import resource
import time
import warnings

import torch.distributed as dist

from titan_tpu.config import TrainConfig
from titan_tpu.dryrun.report import RankReport, rank_report
from titan_tpu.dryrun.step import PIPELINE_NOT_STEPPED, StepTrace, simulate_step
from titan_tpu.dryrun.trainer import DryRunTrainer
from titan_tpu.training.registered_names import check_registered_names


class LayoutRejected(RuntimeError):
    """Set-up stopped: the config's checks or torch refused the layout at this world size."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def _notes(config: TrainConfig, trace: StepTrace) -> list[str]:
    notes = [
        f"one micro-batch of the step's {trace.micro_batches_per_step}: each of the others repeats its "
        "forward, backward and FSDP collectives"
        if trace.stepped
        else PIPELINE_NOT_STEPPED,
        "kernels: each 'auto' kernel at its fallback, not measured",
        "rank placement: row-major; on TPU the topology-aware placement needs the chips and is not simulated",
    ]
    if config.compile.enable:
        notes.append(
            "compile: set in the config, not simulated: the step runs eagerly (placements and "
            "collectives are those of the eager step)"
        )
    if trace.routed:
        notes.append(
            "routing: every expert gets the same share of the tokens (the planner's even "
            "assumption); skewed routing is not simulated"
        )
    return notes


def dry_run_rank(config: TrainConfig, config_name: str, world: int, rank: int) -> RankReport:
    """Set up and step simulated rank `rank` of `world`; LayoutRejected when set-up fails."""
    # The trainer sets its collective timeouts on every group; the fake backend has none to set.
    warnings.filterwarnings("ignore", message="Set timeout is now only supported")
    simulated = copy.deepcopy(config)
    simulated.compile.enable = False  # noted in the report: the fake step runs eagerly
    names = check_registered_names(simulated)
    start = time.perf_counter()
    try:
        try:
            trainer = DryRunTrainer(simulated, names, rank, world)
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as error:
            raise LayoutRejected(
                f"{config_name} at {world} ranks: set-up failed on rank {rank}: {_first_line(error)}"
            ) from error
        setup_s = time.perf_counter() - start
        try:
            trace = simulate_step(trainer)
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as error:
            raise LayoutRejected(
                f"{config_name} at {world} ranks: the step failed on rank {rank}: {_first_line(error)}"
            ) from error
        modules = trainer.pipeline.modules if trainer.pipeline is not None else [trainer.model]
        offloaded = trainer.parallel.dims.fsdp_enabled and config.parallelism.fsdp_cpu_offload
        report = rank_report(
            config_name,
            world,
            rank,
            trainer.parallel.dims.describe(),
            setup_s,
            trace,
            modules,
            offloaded,
            _peak_rss_gib(),
            _notes(config, trace),
        )
        trainer.close()
        return report
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
