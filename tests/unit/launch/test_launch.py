"""The launcher without starting anything: GKE variables -> torchrun's arguments, its one-line errors,
the DNS wait, and TorchTPU's launch variables on a TPU host (its check and function patched)."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from titan_tpu.config.errors import ConfigError
from titan_tpu.launch import __main__ as cli
from titan_tpu.launch import devices, dns
from titan_tpu.launch.command import LaunchOptions, torchrun_argv
from titan_tpu.launch.environment import ACCELERATOR_TYPE, CHIPS_PER_HOST_BOUNDS, PLACEMENT_VARIABLES, read_placement

SCRIPT = ("train.py", "--config", "llama3_debug", "--training.steps=3")


def options(**changes: Any) -> LaunchOptions:
    values: dict[str, Any] = dict(
        nproc_per_node=None, max_restarts=0, rdzv_port=None, dns_timeout_s=5.0, script=SCRIPT[0], script_args=SCRIPT[1:]
    )
    return LaunchOptions(**{**values, **changes})


@pytest.fixture(autouse=True)
def no_placement(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start from a machine without GKE variables, even when the tests run in a GKE pod."""
    for name in (*PLACEMENT_VARIABLES, ACCELERATOR_TYPE, CHIPS_PER_HOST_BOUNDS):
        monkeypatch.delenv(name, raising=False)
    yield


def test_outside_gke_is_one_local_host() -> None:
    placement = read_placement({})
    assert not placement.from_gke and placement.num_hosts == 1 and placement.node_rank == 0
    assert torchrun_argv(placement, options(max_restarts=2), nproc_per_node=2, node_rank=0) == [
        "--nnodes=1",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d-node-rank",
        "--rdzv-endpoint=localhost:0",  # any free port, as torchrun --standalone
        "--rdzv-id=localhost",
        "--rdzv-conf=is_host=true,node_rank=0",
        "--local-addr=localhost",
        "--max-restarts=2",
        *SCRIPT,
    ]


def test_single_slice_host() -> None:
    env = {
        "TPU_WORKER_HOSTNAMES": "job-0.job, job-1.job,job-2.job,job-3.job",
        "TPU_WORKER_ID": "2",
        "JOB_COMPLETION_INDEX": "2",
        "TPU_ACCELERATOR_TYPE": "v6e-16",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    }
    placement = read_placement(env)
    assert (placement.node_rank, placement.num_hosts, placement.chips_per_host) == (2, 4, 4)
    assert placement.describe() == ("GKE v6e-16 slice 0 of 1 (4 hosts x 4 chips), worker 2 (job-2.job): host 2 of 4")
    assert torchrun_argv(placement, options(max_restarts=3), nproc_per_node=4, node_rank=placement.node_rank) == [
        "--nnodes=4",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d-node-rank",
        "--rdzv-endpoint=job-0.job:29400",
        "--rdzv-id=job-0.job",
        "--rdzv-conf=is_host=false,node_rank=2",
        "--local-addr=job-2.job",
        "--max-restarts=3",
        *SCRIPT,
    ]


def test_completion_index_alone_gives_the_worker_id() -> None:
    placement = read_placement({"TPU_WORKER_HOSTNAMES": "a,b", "JOB_COMPLETION_INDEX": "1"})
    assert placement.worker_id == 1 and placement.hostname == "b"


@pytest.mark.parametrize(
    ("slice_id", "worker_id", "node_rank", "is_host"),
    [(0, 0, 0, "true"), (0, 3, 3, "false"), (1, 0, 4, "false"), (2, 3, 11, "false")],
)
def test_multislice_numbers_slices_then_hosts(slice_id: int, worker_id: int, node_rank: int, is_host: str) -> None:
    env = {
        "TPU_WORKER_HOSTNAMES": ",".join(f"js-slice-{slice_id}-{w}.js" for w in range(4)),
        "TPU_WORKER_ID": str(worker_id),
        "MEGASCALE_NUM_SLICES": "3",
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_COORDINATOR_ADDRESS": "js-slice-0-0.js:8080",
    }
    placement = read_placement(env)
    assert (placement.node_rank, placement.num_hosts, placement.hosts_per_slice) == (node_rank, 12, 4)
    argv = torchrun_argv(placement, options(rdzv_port=1234), nproc_per_node=4, node_rank=placement.node_rank)
    # Every slice meets at slice 0's first host, named the same way on all of them (the port of the
    # coordinator address is MegaScale's, not the rendezvous').
    assert argv[:7] == [
        "--nnodes=12",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d-node-rank",
        "--rdzv-endpoint=js-slice-0-0.js:1234",
        "--rdzv-id=js-slice-0-0.js",
        f"--rdzv-conf=is_host={is_host},node_rank={node_rank}",
        f"--local-addr=js-slice-{slice_id}-{worker_id}.js",
    ]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "2"}, "TPU_WORKER_ID=2 is out of range: .* 0 to 1"),
        ({"TPU_WORKER_HOSTNAMES": "a,b", "JOB_COMPLETION_INDEX": "5"}, "JOB_COMPLETION_INDEX=5 is out of range"),
        ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "one"}, "TPU_WORKER_ID='one' is not an integer"),
        ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "-1"}, "TPU_WORKER_ID=-1 is out of range"),
        ({"TPU_WORKER_HOSTNAMES": "", "TPU_WORKER_ID": "0"}, "TPU_WORKER_HOSTNAMES='' has an empty host name at .* 0"),
        ({"TPU_WORKER_HOSTNAMES": "a,,b", "TPU_WORKER_ID": "0"}, "empty host name at position 1"),
        ({"TPU_WORKER_ID": "0"}, "TPU_WORKER_HOSTNAMES is not set but TPU_WORKER_ID is"),
        ({"TPU_WORKER_HOSTNAMES": "a,b"}, "neither TPU_WORKER_ID nor JOB_COMPLETION_INDEX is set"),
        (
            {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1", "JOB_COMPLETION_INDEX": "0"},
            "TPU_WORKER_ID=1 but JOB_COMPLETION_INDEX=0: .* remove the override",
        ),
        (
            {"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "2"},
            "MEGASCALE_SLICE_ID=2 is out of range: MEGASCALE_NUM_SLICES=2 allows 0 to 1",
        ),
        ({"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "0"}, "MEGASCALE_NUM_SLICES=0 is out of range"),
        (
            {"TPU_WORKER_HOSTNAMES": "a", "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"},
            "MEGASCALE_NUM_SLICES=2 but MEGASCALE_COORDINATOR_ADDRESS is not set",
        ),
        ({"TPU_WORKER_HOSTNAMES": "a", "TPU_CHIPS_PER_HOST_BOUNDS": "2,x,1"}, "TPU_CHIPS_PER_HOST_BOUNDS='2,x,1'"),
    ],
)
def test_malformed_variables_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_placement(env)


def test_bad_variable_is_one_error_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "a,b")
    monkeypatch.setenv("TPU_WORKER_ID", "7")
    assert cli.launch(list(SCRIPT)) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: TPU_WORKER_ID=7 is out of range"), lines


def test_free_port_is_for_one_host_only() -> None:
    placement = read_placement({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"})
    with pytest.raises(ConfigError, match="--rdzv-port 0 .* one host only; this job has 2 hosts"):
        torchrun_argv(placement, options(rdzv_port=0), nproc_per_node=1, node_rank=0)


def test_node_rank_outside_the_job_is_refused() -> None:
    placement = read_placement({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0"})
    with pytest.raises(ConfigError, match="node rank 2 is out of range: the job has 2 host"):
        torchrun_argv(placement, options(), nproc_per_node=1, node_rank=2)


def test_script_and_its_arguments_pass_verbatim() -> None:
    parsed = cli.parse_args(
        [
            "--max-restarts",
            "2",
            "--nproc-per-node",
            "auto",
            "train.py",
            "--config",
            "x",
            "--max-restarts=5",
            "--rdzv-port",
            "1",
        ]
    )
    assert (parsed.max_restarts, parsed.nproc_per_node, parsed.rdzv_port) == (2, None, None)
    assert parsed.script == "train.py"
    assert parsed.script_args == ("--config", "x", "--max-restarts=5", "--rdzv-port", "1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0", "train.py"], "argument --nproc-per-node.*expected an integer >= 1, got 0"),
        (["--nproc-per-node", "many", "train.py"], "argument --nproc-per-node.*expected an integer, got 'many'"),
        (["--rdzv-port", "70000", "train.py"], "argument --rdzv-port.*from 0 to 65535, got 70000"),
        (["--dns-timeout", "-1", "train.py"], "argument --dns-timeout.*expected seconds >= 0"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


class FakeClock:
    """time.monotonic and time.sleep for the DNS wait: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def resolver(failures: int | None, calls: list[str]):  # type: ignore[no-untyped-def]
    """getaddrinfo that fails `failures` times (None: always) and then resolves."""

    def getaddrinfo(host: str, port: Any) -> list[Any]:
        calls.append(host)
        if failures is None or len(calls) <= failures:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 0))]

    return getaddrinfo


def test_dns_wait_retries_with_backoff_until_the_name_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, calls = FakeClock(), []
    monkeypatch.setattr(dns, "time", clock)
    monkeypatch.setattr(dns.socket, "getaddrinfo", resolver(2, calls))
    dns.wait_for_host("job-0.job", timeout_s=300)
    assert calls == ["job-0.job"] * 3 and clock.sleeps == [1.0, 2.0]


def test_dns_wait_gives_up_at_the_bound_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, calls = FakeClock(), []
    monkeypatch.setattr(dns, "time", clock)
    monkeypatch.setattr(dns.socket, "getaddrinfo", resolver(None, calls))
    with pytest.raises(dns.HostNotResolved) as error:
        dns.wait_for_host("job-0.job", timeout_s=100)
    # Backoff 1, 2, 4, ..., 30 (the cap), and the last sleep ends exactly at the bound.
    assert clock.sleeps == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 9.0] and clock.now == 100
    assert len(calls) == len(clock.sleeps) + 1
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("the rendezvous host 'job-0.job' did not resolve within 100 s (9 tries, last: ")


class FakeTorchTpu:
    """set_tpu_launch_env's stand-in: records its arguments and, like TorchTPU on a multi-host slice,
    writes NODE_RANK into the launcher's environment unless it is already set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.calls: list[dict[str, int]] = []
        self.node_rank: str | None = None

    def set_tpu_launch_env(self, **kwargs: int) -> None:
        self.calls.append(kwargs)
        if self.node_rank is not None and "NODE_RANK" not in os.environ:
            self.monkeypatch.setenv("NODE_RANK", self.node_rank)


@pytest.fixture
def tpu_host(monkeypatch: pytest.MonkeyPatch) -> FakeTorchTpu:
    """A host where TorchTPU sees 4 TPU devices."""
    fake = FakeTorchTpu(monkeypatch)

    def function(path: str):  # type: ignore[no-untyped-def]
        assert path == "torch.tpu.distributed.set_tpu_launch_env"
        return fake.set_tpu_launch_env

    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.setattr(devices, "visible_accelerator", lambda: "tpu")
    monkeypatch.setattr(devices, "processes_per_host", lambda accelerator: 4 if accelerator == "tpu" else 1)
    monkeypatch.setattr(devices, "torch_tpu_function", function)
    return fake


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


LOCAL_SLICE = {"TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1,127.0.0.1,127.0.0.1", "TPU_WORKER_ID": "1"}


def test_tpu_host_sets_torch_tpu_launch_env(monkeypatch: pytest.MonkeyPatch, tpu_host: FakeTorchTpu) -> None:
    set_env(monkeypatch, {"TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1", "TPU_WORKER_ID": "1"})
    tpu_host.node_rank = "1"
    argv = cli.prepare(options())
    assert tpu_host.calls == [{"nnodes": 2, "nproc_per_node": 4}]
    assert argv[:2] == ["--nnodes=2", "--nproc-per-node=4"]  # auto: one process per TPU device


def test_torchrun_gets_torch_tpus_node_rank(monkeypatch: pytest.MonkeyPatch, tpu_host: FakeTorchTpu) -> None:
    """Worker 1 of the host list sits at NODE_RANK 3 by its chips' coordinates: torchrun gets 3, so
    its global ranks 12-15 are the ones TorchTPU gave this host's slice-builder addresses."""
    set_env(monkeypatch, LOCAL_SLICE)
    tpu_host.node_rank = "3"
    argv = cli.prepare(options())
    assert "--rdzv-conf=is_host=false,node_rank=3" in argv
    assert argv[:3] == ["--nnodes=4", "--nproc-per-node=4", "--rdzv-backend=c10d-node-rank"]


def test_operator_set_node_rank_is_kept(monkeypatch: pytest.MonkeyPatch, tpu_host: FakeTorchTpu) -> None:
    """TorchTPU never overwrites NODE_RANK, and neither does the launcher."""
    set_env(monkeypatch, {**LOCAL_SLICE, "NODE_RANK": "0"})
    tpu_host.node_rank = "3"
    assert "--rdzv-conf=is_host=false,node_rank=0" in cli.prepare(options())


def test_tpu_multislice_gives_torch_tpu_the_slice(monkeypatch: pytest.MonkeyPatch, tpu_host: FakeTorchTpu) -> None:
    """TorchTPU checks nnodes against TPU_WORKER_HOSTNAMES, which lists this slice's hosts, and its
    NODE_RANK counts within the slice: host 0 of slice 1 at NODE_RANK 1 is host 3 of the job."""
    set_env(
        monkeypatch,
        {
            "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
            "TPU_WORKER_ID": "0",
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": "1",
            "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.1",
        },
    )
    tpu_host.node_rank = "1"
    argv = cli.prepare(options(nproc_per_node=2))
    assert tpu_host.calls == [{"nnodes": 2, "nproc_per_node": 2}]
    assert argv[:2] == ["--nnodes=4", "--nproc-per-node=2"]
    assert "--rdzv-conf=is_host=false,node_rank=3" in argv


@pytest.mark.parametrize(
    ("node_rank", "message"),
    [
        ("4", "error: NODE_RANK=4 is out of range: TPU_WORKER_HOSTNAMES lists 4 host(s), so 0 to 3"),
        ("x", "error: NODE_RANK='x' is not an integer; expected an integer >= 0"),
        (None, "error: TorchTPU's set_tpu_launch_env wrote no NODE_RANK for a slice of 4 hosts"),
    ],
)
def test_bad_torch_tpu_node_rank_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch,
    tpu_host: FakeTorchTpu,
    capsys: pytest.CaptureFixture[str],
    node_rank: str | None,
    message: str,
) -> None:
    set_env(monkeypatch, LOCAL_SLICE)
    tpu_host.node_rank = node_rank
    assert cli.launch(list(SCRIPT)) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_torch_tpu_refusal_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, tpu_host: FakeTorchTpu, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(**kwargs: int) -> None:
        raise ValueError("set_tpu_launch_env(): expected nnodes to match the number of hosts")

    monkeypatch.setattr(devices, "torch_tpu_function", lambda path: refuse)
    assert cli.launch(list(SCRIPT)) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "error: torch.tpu.distributed.set_tpu_launch_env: set_tpu_launch_env(): expected nnodes to match the "
        "number of hosts"
    ]


def test_cpu_host_runs_one_process_and_leaves_torch_tpu_alone(
    tpu_host: FakeTorchTpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same path without GKE variables or a TPU: one local host, one process."""
    monkeypatch.setattr(devices, "visible_accelerator", lambda: None)
    argv = cli.prepare(options())
    assert argv[:4] == [
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d-node-rank",
        "--rdzv-endpoint=localhost:0",
    ]
    assert tpu_host.calls == []


def test_cpu_hosts_take_their_place_in_the_host_list(tpu_host: FakeTorchTpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TorchTPU the rank is the host list's, whatever NODE_RANK the environment holds."""
    monkeypatch.setattr(devices, "visible_accelerator", lambda: None)
    set_env(monkeypatch, {**LOCAL_SLICE, "NODE_RANK": "3"})
    assert "--rdzv-conf=is_host=false,node_rank=1" in cli.prepare(options())


def test_this_cpu_host_sees_no_accelerator() -> None:
    """The real check on this machine (no TPU chip, no GPU): torchrun gets one process."""
    if (accelerator := devices.visible_accelerator()) is not None:
        pytest.skip(f"this host has a {accelerator}")
    assert devices.processes_per_host(None) == 1


def test_torchrun_runs_in_process_with_the_node_rank_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun finds the backend in this process's registry, and gets the arguments unchanged."""
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from titan_tpu.launch import rendezvous

    seen: list[tuple[list[str], object]] = []

    def record(argv: list[str]) -> None:
        seen.append((argv, rendezvous_handler_registry._registry.get("c10d-node-rank")))

    monkeypatch.setattr(torch.distributed.run, "main", record)
    assert cli.run_torchrun(["--nnodes=1", "train.py"]) == 0
    assert seen == [(["--nnodes=1", "train.py"], rendezvous.create_node_rank_handler)]


def test_failed_training_is_exit_status_1(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def fail(argv: list[str]) -> None:
        failure = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file="/nonexistent")
        raise ChildFailedError("train.py", {1: failure})

    monkeypatch.setattr(torch.distributed.run, "main", fail)
    assert cli.run_torchrun(["train.py"]) == 1
