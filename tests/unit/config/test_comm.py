"""[comm] collective timeouts: the settings and their checks, the init timeout reaching the process group,
the switch to the train timeout after the first step (read back from the group itself), and a
timed-out collective turned into one line while every other error passes through unchanged.

The trainer runs here in a real one-process gloo group (a collective never waits in it); the
multi-process behaviour, a stopped peer ending the job, is tests/distributed/test_hung_collective.py.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import train
from titan_tpu.config import ConfigError, help_text, load_config
from titan_tpu.distributed import comm_timeouts
from titan_tpu.distributed.comm_timeouts import CollectiveTimeout, is_collective_timeout
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.distributed.process_group import ProcessInfo
from titan_tpu.training.trainer import Trainer

INIT_S, TRAIN_S = 77, 33
SMALL = [
    "--config",
    "llama3_debug",
    "--training.seq_len=32",
    "--training.global_batch_size=2",
    "--training.steps=3",
    "--model.overrides.n_layers=1",
    f"--comm.init_timeout_seconds={INIT_S}",
    f"--comm.train_timeout_seconds={TRAIN_S}",
]
# What gloo raised when a peer stopped, copied from a run of this torch.
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "5000ms for recv operation to complete"
)


def world_timeout() -> datetime.timedelta:
    """The timeout the default group's gloo backend applies to its next collective."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture
def init_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The trainer's process-group creation, recorded and made real in a one-process gloo group."""
    calls: list[float] = []

    def init_one_process(backend: str, info: ProcessInfo, timeout_s: float) -> None:
        calls.append(timeout_s)
        dist.init_process_group(
            backend,
            init_method=f"file://{tmp_path / 'store'}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    monkeypatch.setattr("titan_tpu.training.trainer.process_group.init_process_group", init_one_process)
    try:
        yield calls
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def small_args(tmp_path: Path) -> list[str]:
    return [*SMALL, f"--job.dump_folder={tmp_path / 'run'}"]


# ------------------------------------------------------------------------------------ settings


def test_defaults_and_help() -> None:
    comm = load_config("llama3_debug", []).comm
    assert (comm.init_timeout_seconds, comm.train_timeout_seconds) == (600, 300)
    text = help_text()
    assert "[comm]" in text
    assert "init_timeout_seconds (int, default 600)" in text and "train_timeout_seconds (int, default 300)" in text


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("--comm.init_timeout_seconds=0", "error: comm.init_timeout_seconds: must be > 0 seconds, got 0"),
        ("--comm.train_timeout_seconds=-5", "error: comm.train_timeout_seconds: must be > 0 seconds, got -5"),
        (
            "--comm.train_timeout_seconds=5m",
            "error: command line: comm.train_timeout_seconds: got '5m', expected an integer",
        ),
        (
            "--comm.timeout=5",
            "error: command line: comm.timeout: unknown key in [comm]; valid keys: "
            "init_timeout_seconds, train_timeout_seconds",
        ),
    ],
)
def test_bad_values_get_one_line(arg: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main(["--config", "llama3_debug", arg]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [expected]


def test_good_values_load() -> None:
    comm = load_config("llama3_debug", ["--comm.init_timeout_seconds=1", "--comm.train_timeout_seconds=5"]).comm
    assert (comm.init_timeout_seconds, comm.train_timeout_seconds) == (1, 5)
    with pytest.raises(ConfigError):  # the same path rejects 0, so the check above is not vacuous
        load_config("llama3_debug", ["--comm.train_timeout_seconds=0"])


# ------------------------------------------------------------------------------ the two timeouts


def test_mesh_groups_cover_sub_and_flattened_meshes() -> None:
    # DeviceMesh creates its groups with torch's default timeout, so each must be in the governed list.
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        meshes = ParallelDims(dp_replicate=2, dp_shard=4, tp=2, ep=1, world_size=16).build_meshes("cpu")
        groups = comm_timeouts.mesh_groups(meshes.values())
        axes = ("tp", "dp_shard", "dp_replicate", "dp")
        expected = {id(dist.group.WORLD)} | {id(meshes[name].get_group()) for name in axes}
        assert {id(g) for g in groups} == expected and len(groups) == len(expected) == 5
        # A backend torch cannot re-time keeps its creation timeout, and the log says so.
        assert comm_timeouts.fixed_timeout_backends(groups) == {"fake"}
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ the clear line


@pytest.mark.parametrize(
    "error, expected",
    [
        (RuntimeError(GLOO_TIMEOUT), True),
        (RuntimeError("Timed out waiting 300000ms for send operation to complete"), True),
        (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4123"), False),
        (RuntimeError("CUDA out of memory"), False),
        (ValueError(GLOO_TIMEOUT), False),
    ],
)
def test_collective_timeouts_are_recognised_precisely(error: BaseException, expected: bool) -> None:
    assert is_collective_timeout(error) is expected


def failing_step(n: int, error: Exception, seen: list[float]):
    """Trainer.forward_backward that notes the group's timeout at every step and raises at step n."""
    original = Trainer.forward_backward

    def forward_backward(self: Trainer) -> tuple[torch.Tensor, int]:
        seen.append(world_timeout().total_seconds())
        if len(seen) == n:
            raise error
        return original(self)

    return forward_backward


def test_init_timeout_until_the_first_step_ends_then_one_line_naming_the_train_timeout(
    tmp_path: Path, init_calls: list[float], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[float] = []
    monkeypatch.setattr(Trainer, "forward_backward", failing_step(3, RuntimeError(GLOO_TIMEOUT), seen))
    assert train.main(small_args(tmp_path)) == 1
    assert init_calls == [INIT_S]
    # Step 1 (compilation, loading, the first record) ran under the init timeout, later ones under the
    # train timeout, which the clear line names.
    assert seen == [INIT_S, TRAIN_S, TRAIN_S]
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: rank 0: a collective did not complete within comm.train_timeout_seconds = {TRAIN_S} s; a peer "
        "process is stopped, hung or gone (raise comm.train_timeout_seconds if a step, a checkpoint save or an "
        "evaluation legitimately takes longer)"
    ]


def raising(error: Exception):
    def setup_step(self: Trainer) -> None:
        raise error

    return setup_step


def test_timed_out_set_up_names_the_init_timeout(
    tmp_path: Path, init_calls: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first set-up step after the process group exists (mesh creation is collective).
    monkeypatch.setattr(Trainer, "_setup_parallelism", raising(RuntimeError(GLOO_TIMEOUT)))
    with pytest.raises(
        CollectiveTimeout,
        match=f"^rank 0: a collective did not complete within comm.init_timeout_seconds = {INIT_S} s;",
    ):
        Trainer(load_config(None, small_args(tmp_path)[2:]))


def test_other_errors_pass_through_unchanged(
    tmp_path: Path, init_calls: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    lost_peer = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4123")
    monkeypatch.setattr(Trainer, "forward_backward", failing_step(2, lost_peer, []))
    with pytest.raises(RuntimeError) as raised:
        train.main(small_args(tmp_path))
    assert raised.value is lost_peer


def group_timeout(group: dist.ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_a_group_built_after_the_meshes_switches_with_them(tmp_path: Path) -> None:
    # The checkpoint manager's gloo group is created after the meshes; left out, it would keep torch's
    # 30-minute default and a hang inside a checkpoint's broadcast would not end in time.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        timeouts = comm_timeouts.CommTimeouts(load_config("llama3_debug", SMALL[2:]).comm, rank=0)
        timeouts.govern([])
        late = dist.new_group(backend="gloo")
        assert group_timeout(late) == 1800  # torch's default: what the group would keep
        timeouts.govern_group(late)
        assert group_timeout(late) == INIT_S
        timeouts.start_training()
        assert group_timeout(late) == TRAIN_S == group_timeout(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
