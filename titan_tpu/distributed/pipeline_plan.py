"""Which decoder layers each pipeline stage holds, and which stages each pp rank runs.

The rule: the model's `n_layers` split into stages of `parallelism.pp_layers_per_stage` consecutive
layers (default: evenly, one stage per pp rank, or two per rank with an interleaved schedule); the
embedding goes with the first stage, the final norm and the head with the last. Stage s runs on pp
rank s mod pp (the looped placement interleaved schedules expect: rank r holds stages r, r + pp, ...).
What does not divide is refused with one line. Each pp rank's local batch is split into
`parallelism.pp_microbatches` micro-batches (default: the number of stages, the fewest with which
1F1B keeps every stage busy in its steady state).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.pipeline_parallel import MULTI_STAGE_SCHEDULES
from titan_tpu.config.sections import ParallelismConfig


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    pp: int
    stage_layers: tuple[tuple[int, ...], ...]  # the layer indices of each stage, in order
    microbatches: int

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.n_stages, self.pp))


def stages_per_rank(schedule: str) -> int:
    """The stages each pp rank runs by default: two for the schedules that run several."""
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def plan_pipeline(cfg: ParallelismConfig, n_layers: int, local_batch_size: int) -> PipelinePlan:
    """The stages and micro-batches of a run with `cfg.pp` > 1, or a ConfigError naming what does
    not divide."""
    pp, schedule = cfg.pp, cfg.pp_schedule
    per_rank = stages_per_rank(schedule)
    if cfg.pp_layers_per_stage == -1:
        n_stages = pp * per_rank
        if n_layers % n_stages != 0:
            raise ConfigError(
                f"parallelism.pp = {pp} with pp_schedule {schedule} needs {n_stages} stages, which do not "
                f"split the model's {n_layers} layers evenly; set parallelism.pp_layers_per_stage to a "
                f"divisor of {n_layers}"
            )
        layers = n_layers // n_stages
    else:
        layers = cfg.pp_layers_per_stage
        if n_layers % layers != 0:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage = {layers} does not divide the model's {n_layers} layers"
            )
        n_stages = n_layers // layers
        if per_rank == 1 and n_stages != pp:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage = {layers} makes {n_stages} stages, but pp_schedule "
                f"{schedule} runs one stage per pp rank ({pp}); use {n_layers // pp} or Interleaved1F1B"
            )
        if per_rank > 1 and (n_stages % pp != 0 or n_stages < 2 * pp):
            raise ConfigError(
                f"parallelism.pp_layers_per_stage = {layers} makes {n_stages} stages, but pp_schedule "
                f"{schedule} needs a multiple of pp = {pp}, at least {2 * pp} (several stages per rank)"
            )
    microbatches = n_stages if cfg.pp_microbatches == -1 else cfg.pp_microbatches
    if local_batch_size % microbatches != 0:
        raise ConfigError(
            f"parallelism.pp_microbatches = {microbatches} does not divide the {local_batch_size} samples "
            "each data-parallel rank takes per step (training.global_batch_size / data-parallel degree)"
        )
    if schedule == "1F1B" and microbatches < n_stages:
        raise ConfigError(
            f"parallelism.pp_microbatches = {microbatches}: pp_schedule 1F1B needs at least one "
            f"micro-batch per stage ({n_stages})"
        )
    rounds = max(1, microbatches // pp)
    if per_rank > 1 and microbatches % rounds != 0:
        raise ConfigError(
            f"parallelism.pp_microbatches = {microbatches}: pp_schedule {schedule} runs them in rounds of "
            f"pp = {pp}, so it must be a multiple of {rounds} (or at most {pp})"
        )
    stage_layers = tuple(tuple(range(s * layers, (s + 1) * layers)) for s in range(n_stages))
    return PipelinePlan(schedule, pp, stage_layers, microbatches)
