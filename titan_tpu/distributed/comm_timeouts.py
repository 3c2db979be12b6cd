"""Collective timeouts: a peer that stops (a hung host, a stopped or lost process) ends the job with one
line instead of hanging every other process forever.

A collective waits for its peers for a time set per process group. `[comm]` gives two: a long one while
the job starts (creating the groups, then the whole first step, which compiles and may load a
checkpoint, so ranks arrive at its collectives minutes apart) and a shorter one for every collective
after it. When a collective runs out of time, torch raises a RuntimeError with the backend's own
message; `CommTimeouts.raise_if_timeout` turns exactly that error into one line naming the rank and the
setting, and leaves every other error alone.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.config.sections import CommConfig

logger = logging.getLogger(__name__)

INIT_KEY = "comm.init_timeout_seconds"
TRAIN_KEY = "comm.train_timeout_seconds"

# What a timed-out collective raises in this torch: gloo "Timed out waiting 5000ms for recv operation
# to complete" (a RuntimeError), NCCL with blocking wait "Watchdog caught collective operation timeout".
_TIMEOUT_MESSAGE = re.compile(r"Timed out waiting \d+ms for (send|recv) operation|collective operation timeout")
# Backends whose timeout torch can change after creation; others keep the one they were created with.
_ADJUSTABLE_BACKENDS = {"gloo", "nccl"}


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message names the rank and the setting."""


def is_collective_timeout(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and _TIMEOUT_MESSAGE.search(str(error)) is not None


def mesh_groups(meshes: Iterable[DeviceMesh]) -> list[dist.ProcessGroup]:
    """The default group and every group the meshes hold (their sub-meshes and flattened meshes),
    each once."""
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("mesh_groups: the default process group is not initialised")
    groups = [world]
    for mesh in meshes:
        groups.extend(mesh.get_all_groups())
    unique: dict[int, dist.ProcessGroup] = {}
    for group in groups:
        unique.setdefault(id(group), group)
    return list(unique.values())


def set_timeout(groups: Iterable[dist.ProcessGroup], seconds: int) -> None:
    """Every collective issued on these groups from now on waits at most `seconds`.

    torch documents no public way that works on every group this project builds: the public
    `ProcessGroup.set_timeout` changes each backend of a group and raises on the first that cannot
    change its timeout (torch_tpu's `tpu_dist`), leaving the group's gloo backend changed or not
    depending on the order of an unordered map. `_set_pg_timeout` changes the gloo (CPU) and NCCL
    backends and leaves the others, which is what a job needs on every device type; TorchTitan uses
    it for the same switch. The acceptance test (tests/distributed/test_hung_collective.py) runs it
    for real, so a torch without it fails there.
    """
    timeout = datetime.timedelta(seconds=seconds)
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def fixed_timeout_backends(groups: Iterable[dist.ProcessGroup]) -> set[str]:
    """Backends of these groups that keep the timeout they were created with ("cpu:gloo,tpu:tpu_dist"
    -> {"tpu_dist"})."""
    names = set()
    for group in groups:
        for entry in str(dist.get_backend(group)).split(","):
            names.add(entry.rpartition(":")[2])
    return names - _ADJUSTABLE_BACKENDS


class CommTimeouts:
    """The job's two collective timeouts and which one applies now (init until `start_training`)."""

    def __init__(self, config: CommConfig, rank: int):
        self.config = config
        self.rank = rank
        self.key = INIT_KEY
        self.groups: list[dist.ProcessGroup] = []

    @property
    def seconds(self) -> int:
        return self.config.init_timeout_seconds if self.key == INIT_KEY else self.config.train_timeout_seconds

    def govern(self, meshes: Iterable[DeviceMesh]) -> None:
        """Give the default group and the meshes' groups the current timeout. DeviceMesh creates its
        sub-groups with torch's default (30 minutes for gloo), not the one the default group got."""
        if not dist.is_initialized():
            return
        self.groups = mesh_groups(meshes)
        set_timeout(self.groups, self.seconds)

    def govern_group(self, group: dist.ProcessGroup | None) -> None:
        """A group built after the meshes (the checkpoint manager's gloo group) gets the current
        timeout now and the train timeout at the switch, like the meshes' groups."""
        if group is None or not self.groups:
            return
        self.groups.append(group)
        set_timeout([group], self.seconds)

    def start_training(self) -> None:
        """After the first step: wait until every rank is here, then switch to the train timeout.
        Without the wait a rank still finishing the first step (its record, a checkpoint) under the
        long timeout would let the others' next collectives fail under the short one."""
        if not self.groups or self.key == TRAIN_KEY:
            return
        # A CPU tensor goes through gloo, which every group here has, whatever the accelerator.
        dist.all_reduce(torch.zeros(1), group=dist.group.WORLD)
        self.key = TRAIN_KEY
        set_timeout(self.groups, self.seconds)
        if self.rank == 0:
            logger.info("comm: collectives now wait at most %d s for their peers (%s)", self.seconds, self.key)
            fixed = fixed_timeout_backends(self.groups)
            if fixed:
                logger.info("comm: %s keeps %s for its own collectives", ", ".join(sorted(fixed)), INIT_KEY)

    def raise_if_timeout(self, error: BaseException) -> None:
        """Raise one clear CollectiveTimeout in place of a timed-out collective's error; return for
        any other error, which the caller re-raises unchanged."""
        if is_collective_timeout(error):
            raise CollectiveTimeout(
                f"rank {self.rank}: a collective did not complete within {self.key} = {self.seconds} s; "
                f"a peer process is stopped, hung or gone (raise {self.key} if a step, a checkpoint "
                "save or an evaluation legitimately takes longer)"
            ) from None
