"""Save, resume and retire checkpoints of a training run (see layout.py for the folder).

Every rank calls the same methods at the same steps. Decisions that must agree (which step to load,
whether a save is skipped, whether a save failed) are made on rank 0 and broadcast over a dedicated gloo
group, which is also the group DCP's own collectives run on, so an async save's background collectives
never interleave with training's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from titan_tpu.checkpoint import layout
from titan_tpu.checkpoint.state import (
    ModelState,
    ObjectState,
    OptimizerState,
    PerRankObjectState,
    RNGState,
    TrainState,
    check_model_fits,
    has_positional_param_groups,
)
from titan_tpu.checkpoint.storage import (
    METADATA_FILE,
    ChecksummingWriter,
    Damage,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_files,
    describe_error,
    fsync_dir,
    quiet_single_process,
    read_metadata_file,
    referenced_files,
)
from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import CheckpointConfig

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Owns `<dump_folder>/<checkpoint.folder>`: `load()` once before training, `maybe_save(step)`
    after every step, `close()` at the end (waits for an async save to be committed)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        dump_folder: Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        dataloader: Any | None = None,
        device_type: str = "cpu",
        pipeline_stages: bool = False,
        run_settings: dict[str, Any] | None = None,
        trainable_only: bool = False,
    ) -> None:
        """`pipeline_stages`: `model` holds this rank's pipeline stages only (parallelism.pp > 1).
        `trainable_only`: the model's frozen parameters are neither saved nor loaded (`ModelState`).
        `run_settings`: the run's values a restart may change (titan_tpu/training/resume_settings.py),
        recorded in each manifest; `resumed_settings` is the loaded checkpoint's (None before a load,
        or for a checkpoint that recorded none)."""
        self.cfg = cfg
        self.root = Path(dump_folder) / cfg.folder
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.device_type = device_type
        self.pipeline_stages = pipeline_stages
        self.trainable_only = trainable_only
        self.train_state = TrainState()
        self.run_settings = run_settings
        self.resumed_settings: dict[str, Any] | None = None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.active = cfg.enable or cfg.create_seed_checkpoint
        self.last_save_blocked_s = 0.0
        self._pending: concurrent.futures.Future | None = None
        self._pending_step = -1
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stager: BlockingAsyncStager | None = None
        self._pg: dist.ProcessGroup | None = None
        self.run_id = "0"
        if not self.active:
            return
        if self.distributed and self.world_size > 1:
            # Collective: every rank builds its manager at the same point of set-up.
            self._pg = dist.new_group(backend="gloo")
        self.run_id = self._broadcast(secrets.token_hex(4) if self.rank == 0 else None)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for path in layout.clean_stale(self.root):
                logger.info("checkpoint: removed %s, left by a save or deletion that never ended", path)
            for path in layout.incomplete_step_dirs(self.root):
                logger.warning("checkpoint: %s has no %s; it is ignored", path, layout.MANIFEST)
        self._barrier()
        if cfg.async_mode == "async":
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
            self._stager = BlockingAsyncStager()

    def _say(self, level: int, message: str, *args: Any) -> None:
        """Log once per job (every rank reaches the same decisions)."""
        if self.rank == 0:
            logger.log(level, message, *args)

    # -- collectives over the checkpoint group (no-ops in one process) ------------------------------

    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._pg)
        return out

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The manager's own gloo group (None for a single process or with checkpoints off), so the
        job's collective timeouts can govern it too."""
        return self._pg

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self._pg)

    # -- what is saved --------------------------------------------------------------------------

    def _model_state(self) -> ModelState:
        return ModelState(self.model, trainable_only=self.trainable_only)

    def stateful(self, model_only: bool = False) -> dict[str, Any]:
        """What a save writes, by name: the Stateful objects whose `state_dict()`s it stores."""
        states: dict[str, Any] = {"model": self._model_state()}
        if model_only:
            return states
        if self.optimizer is not None:
            states["optimizer"] = OptimizerState(self.model, self.optimizer)
        if self.lr_scheduler is not None:
            states["lr_scheduler"] = ObjectState(self.lr_scheduler)
        if self.dataloader is not None:
            states["dataloader"] = PerRankObjectState(self.dataloader, self.rank)
        states["rng"] = RNGState(self.rank, self.device_type)
        states["train_state"] = self.train_state
        return states

    # -- save -----------------------------------------------------------------------------------

    def will_save(self, step: int, last: bool = False) -> bool:
        """Whether `maybe_save(step, last)` saves: a multiple of checkpoint.interval, or the last step."""
        return self.cfg.enable and step > 0 and (step % self.cfg.interval == 0 or last)

    def maybe_save(self, step: int, last: bool = False) -> bool:
        """Save when `step` is a multiple of checkpoint.interval, or it is the last step."""
        return self.save(step) if self.will_save(step, last) else False

    def save(self, step: int, model_only: bool = False, blocking: bool = False) -> bool:
        """Save `step` (async when configured, except model-only and `blocking` saves, which return once
        it is committed); False when skipped because a complete checkpoint of that step already exists
        (it is never overwritten). An async save in flight is waited for first."""
        self._wait_pending()
        final = layout.step_dir(self.root, step)
        exists = self._broadcast(final.exists() if self.rank == 0 else None)
        if exists:
            self._say(
                logging.WARNING,
                "checkpoint: %s already exists; not overwriting it, the save of step %d is skipped",
                final,
                step,
            )
            return False
        start = time.perf_counter()
        self.train_state.step = step
        states = self.stateful(model_only)
        state_dict = {name: state.state_dict() for name, state in states.items()}
        temp = layout.temp_dir(self.root, step, self.run_id)
        writer = ChecksummingWriter(temp)
        extra = {"world_size": self.world_size, "components": sorted(states), "model_only": model_only}
        if self.run_settings is not None and not model_only:
            extra["run_settings"] = self.run_settings
        no_dist = not self.distributed
        if self._executor is not None and not model_only and not blocking:
            with quiet_single_process():
                response = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    process_group=self._pg,
                    async_stager=self._stager,
                    no_dist=no_dist,
                )
            upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
            self._pending = self._executor.submit(self._finish, upload, step, temp, final, extra, start)
            self._pending_step = step
            self.last_save_blocked_s = time.perf_counter() - start
            return True
        error: BaseException | None = None
        try:
            with quiet_single_process():
                dcp.save(state_dict, storage_writer=writer, process_group=self._pg, no_dist=no_dist)
            self._finish(None, step, temp, final, extra, start)
        except (Exception, CheckpointException) as e:  # every rank hears of it below
            error = e
        self.last_save_blocked_s = time.perf_counter() - start
        self._raise_if_any_failed(error, step)
        return True

    def _finish(
        self,
        upload: concurrent.futures.Future | None,
        step: int,
        temp: Path,
        final: Path,
        extra: dict[str, Any],
        start: float,
    ) -> None:
        if upload is not None:
            upload.result()
        if self.rank != 0:
            return
        layout.commit(temp, final, step, extra)
        deleted = layout.apply_retention(self.root, self.cfg.keep_latest_k, step, self.run_id)
        logger.info(
            "checkpoint: saved %s in %.2f s%s",
            final,
            time.perf_counter() - start,
            f"; deleted step {', '.join(map(str, deleted))} (keep_latest_k={self.cfg.keep_latest_k})"
            if deleted
            else "",
        )

    def _raise_if_any_failed(self, error: BaseException | None, step: int) -> None:
        failed = self._gather(None if error is None else describe_error(error))
        problems = [(rank, msg) for rank, msg in enumerate(failed) if msg is not None]
        if problems:
            rank, msg = problems[0]
            raise RuntimeError(
                f"checkpoint: saving step {step} failed on rank {rank}: {msg}; "
                f"the checkpoints saved before are untouched"
            ) from error

    def _wait_pending(self) -> None:
        """Wait for the async save in flight (and its commit); every rank learns if it failed."""
        if self._pending is None:
            return
        error: BaseException | None = None
        try:
            self._pending.result()
        except (Exception, CheckpointException) as e:
            error = e
        self._pending = None
        self._raise_if_any_failed(error, self._pending_step)

    def wait(self) -> None:
        """Block until an async save in flight is written and committed (every rank calls it)."""
        self._wait_pending()

    def close(self) -> None:
        """Wait for an async save in flight to be written and committed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- load -----------------------------------------------------------------------------------

    def load(self, check_settings: Callable[[Path, dict[str, Any] | None], None] | None = None) -> int | None:
        """Load the checkpoint chosen by checkpoint.load_step (-1: the newest complete one).

        Returns its step, or None when there is nothing to load (or checkpointing is off). A model-only
        checkpoint (seed, converted weights) sets the weights and leaves everything else as built.
        `check_settings(folder, its run settings)` may refuse the chosen checkpoint (ConfigError) before
        anything of it is read.
        """
        if not self.cfg.enable:
            return None
        step, newer, moved = self._choose_intact()
        if newer:
            self._say(
                logging.WARNING,
                "checkpoint: loading step %d although step %s exist; saves of steps that already "
                "exist will be skipped, never overwritten",
                step,
                ", ".join(map(str, newer)),
            )
        if step is None:
            if moved:
                names = ", ".join(path.name for path in moved)
                self._say(
                    logging.WARNING,
                    "checkpoint: no intact checkpoint left in %s (moved aside: %s); starting fresh",
                    self.root,
                    names,
                )
            else:
                self._say(logging.INFO, "checkpoint: nothing to resume in %s; starting fresh", self.root)
            return None
        folder = layout.step_dir(self.root, step)
        if check_settings is not None:
            check_settings(folder, layout.read_manifest(folder).get("run_settings"))
        metadata = read_metadata_file(folder / ".metadata")
        states = self._states_to_load(folder, metadata)
        state_dict = {name: state.state_dict() for name, state in states.items()}
        try:
            with quiet_single_process():
                dcp.load(
                    state_dict,
                    storage_reader=SafeFileSystemReader(folder),
                    planner=SafeLoadPlanner(),
                    process_group=self._pg,
                    no_dist=not self.distributed,
                )
            for name, state in states.items():
                state.load_state_dict(state_dict[name])
        except ConfigError:
            raise
        except (Exception, CheckpointException) as e:
            raise ConfigError(f"checkpoint {folder}: could not be loaded: {describe_error(e)}") from e
        loaded_step = self.train_state.step if "train_state" in states else step
        if loaded_step != step:
            raise ConfigError(f"checkpoint {folder}: records step {loaded_step}, its folder says {step}")
        self.train_state.step = step
        self.resumed_settings = layout.read_manifest(folder).get("run_settings")
        self._say(logging.INFO, "checkpoint: loaded %s (%s)", folder, ", ".join(states))
        return step

    def _choose_intact(self) -> tuple[int | None, list[int], list[Path]]:
        """The step to load: checkpoint.load_step's, or the newest complete one whose files pass their
        check, the damaged ones newer than it moved aside first (checkpoint.on_damage = "fallback");
        with the complete steps after it and the folders moved aside."""
        moved: list[Path] = []
        while True:
            choice = layout.choose_step(self.root, self.cfg.load_step) if self.rank == 0 else None
            step, error, newer = self._broadcast(choice)
            if error is not None:
                raise ConfigError(error)
            if step is None:
                return None, newer, moved
            folder = layout.step_dir(self.root, step)
            damage = self._verify(folder)
            if damage is None:
                return step, newer, moved
            if self.cfg.load_step != -1 or self.cfg.on_damage == "stop":
                others = ", ".join(str(s) for s in layout.complete_steps(self.root) if s != step) or "none"
                fallback = ' or checkpoint.on_damage = "fallback"' if self.cfg.load_step == -1 else ""
                raise ConfigError(
                    f"{damage}; pick another with --checkpoint.load_step{fallback} (other complete: {others})"
                )
            moved.append(self._move_aside(folder, damage))
            self._say(
                logging.WARNING,
                "checkpoint: %s; moved it to %s (kept, never loaded) and trying the one before",
                damage,
                moved[-1],
            )

    def _verify(self, folder: Path) -> Damage | None:
        """Sizes and CRC-32s of every file against the manifest, the files split between the ranks:
        the first rank's damage found, the same on every rank, or None."""
        damage = self._check(folder)
        found = [d for d in self._gather(damage) if d is not None]
        return found[0] if found else None

    def _check(self, folder: Path) -> Damage | None:
        try:
            files = layout.read_manifest(folder)["files"]
        except ConfigError as e:
            return Damage("manifest", str(e))
        metadata_damage = check_files(folder, files, [METADATA_FILE]) if self.rank == 0 else None
        names = sorted(files)
        mine = [name for i, name in enumerate(names) if i % self.world_size == self.rank]
        damage = metadata_damage or check_files(folder, files, mine)
        if damage is None and self.rank == 0:
            unlisted = referenced_files(read_metadata_file(folder / METADATA_FILE)) - set(files)
            if unlisted:
                message = f"checkpoint {folder}: file {sorted(unlisted)[0]} is not in its {layout.MANIFEST}"
                damage = Damage("unlisted", message)
        return damage

    def _move_aside(self, folder: Path, damage: Damage) -> Path:
        """Rename a damaged checkpoint out of the loadable names (rank 0), with a note of what was found;
        the new path, on every rank."""
        aside = None
        if self.rank == 0:
            aside = layout.damaged_dir(self.root, int(folder.name.removeprefix("step-")), damage.why)
            folder.rename(aside)
            fsync_dir(self.root)
            (aside / layout.DAMAGE_NOTE).write_text(
                f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {damage}\n", encoding="utf-8"
            )
        aside = self._broadcast(aside)
        self._barrier()
        return aside

    def _states_to_load(self, folder: Path, metadata: Metadata) -> dict[str, Any]:
        keys = metadata.state_dict_metadata
        # The union over ranks: with pipeline parallelism each rank holds only its stages' tensors.
        shapes = {k: tuple(v.shape) for k, v in self._model_state().state_dict().items()}
        check_model_fits(folder, {k: s for rank in self._gather(shapes) for k, s in rank.items()}, keys)
        states: dict[str, Any] = {"model": self._model_state()}

        def has(prefix: str) -> bool:
            return any(k.startswith(prefix + ".") for k in keys)

        skipped = []
        if self.optimizer is not None:
            if has("optimizer"):
                flat = not has_positional_param_groups(keys)
                if not flat and self.pipeline_stages:
                    raise ConfigError(
                        f"checkpoint {folder} keeps the optimizer's param groups by position (saved by an "
                        "older titan_tpu), which a pipeline stage cannot match to its parameters; resume it "
                        "with parallelism.pp = 1 once, and the next checkpoint loads under any pp"
                    )
                states["optimizer"] = OptimizerState(self.model, self.optimizer, flat=flat)
            else:
                skipped.append("optimizer")
        if self.lr_scheduler is not None:
            if "lr_scheduler.state" in keys:
                states["lr_scheduler"] = ObjectState(self.lr_scheduler)
            else:
                skipped.append("lr_scheduler")
        if self.dataloader is not None:
            # The data loader's state is the same on every rank (a global position), so any rank's
            # will do when this run has ranks the saving run did not.
            for source in (self.rank, 0):
                if f"dataloader.rank_{source}" in keys:
                    states["dataloader"] = PerRankObjectState(self.dataloader, source)
                    break
            else:
                skipped.append("dataloader")
        saved_world = layout.read_manifest(folder).get("world_size")
        if f"rng.rank_{self.rank}" in keys and saved_world == self.world_size:
            states["rng"] = RNGState(self.rank, self.device_type)
        elif has("rng"):
            self._say(
                logging.INFO,
                "checkpoint: RNG states not restored (saved by %s ranks, now %d)",
                saved_world,
                self.world_size,
            )
        if "train_state.step" in keys:
            states["train_state"] = self.train_state
        if not has("optimizer"):
            self._say(logging.INFO, "checkpoint %s holds weights only (seed or converted)", folder)
        elif skipped:
            self._say(logging.WARNING, "checkpoint %s: has no state for %s", folder, ", ".join(skipped))
        return states
