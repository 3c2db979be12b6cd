"""A preempted pod, from the launcher's side: the signal's exit status and no restart when torchrun's
agent stops on SIGTERM, a SIGTERM before training starts, and the grace period the JobSet gives the
trainer's pods (from checkpoint.preemption_grace_s). The launcher passing a real SIGTERM on to two
training processes, which save and stop: tests/distributed/test_preemption.py."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.support.jobset_manifest import pod_of, validate_manifest
from tests.support.paths import REPO
from titan_tpu.launch import __main__ as cli
from titan_tpu.launch.jobset import JobSetRequest, config_grace_period_s, render_jobset

REQUEST = JobSetRequest(
    name="llama3-8b",
    accelerator="tpu-v6e-slice",
    topology="4x4",
    slices=1,
    image="img:1",
    config="llama3_8b",
    dump_folder="gs://my-bucket/run",
)


@pytest.fixture
def handlers_kept() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    level = logging.getLogger("titan_tpu").level
    yield
    signal.signal(signal.SIGTERM, before)
    logging.getLogger("titan_tpu").setLevel(level)


def test_agent_stopped_by_a_signal_is_its_status_and_no_restart(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun's agent raises SignalException once it has sent the signal on to the training processes
    and waited for them. Catches a traceback and status 1 instead of 143, which a JobSet cannot tell
    from a crash."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing import SignalException

    def preempted(argv: list[str]) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "main", preempted)
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        assert cli.run_torchrun(["train.py"]) == 128 + signal.SIGTERM
    said = "launch: SIGTERM: the training processes were sent it to save and stop; not restarting them"
    assert said in caplog.text


@pytest.mark.usefixtures("handlers_kept")
def test_sigterm_before_training_starts_ends_the_launcher_with_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before torchrun's agent installs its handlers (the DNS wait, the rendezvous) the launcher has its
    own: as a container's first process it would otherwise ignore SIGTERM and wait for SIGKILL."""

    def waiting_for_dns(argv: list[str]) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    monkeypatch.setattr(cli, "launch", waiting_for_dns)
    started = time.monotonic()
    with pytest.raises(SystemExit) as ended:
        cli.main()
    assert ended.value.code == 128 + signal.SIGTERM and time.monotonic() - started < 4


def test_trainer_pods_get_the_grace_period() -> None:
    """Catches a misspelled or misplaced field (the Kubernetes schema is strict) and an agent that
    would SIGKILL the training processes after its own 30 s while the pod still had time."""
    for grace, request in ((30, REQUEST), (120, JobSetRequest(**{**REQUEST.__dict__, "grace_period_s": 120}))):
        manifest, _ = render_jobset(request)
        validate_manifest(manifest)
        pod = pod_of(manifest["spec"]["replicatedJobs"][0])["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        (container,) = pod["containers"]
        assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(grace)} in container["env"]


def test_grace_period_comes_from_the_config_and_its_overrides() -> None:
    assert config_grace_period_s("llama3_8b", ()) == 30
    assert config_grace_period_s("llama3_8b", ("--checkpoint.preemption_grace_s=90",)) == 90


def _cli() -> Any:
    spec = importlib.util.spec_from_file_location("render_jobset", REPO / "scripts/gke/render_jobset.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGV = ["--accelerator", "tpu-v6e-slice", "--topology", "4x4", "--image", "img:1", "--config", "llama3_8b"]


def test_cli_writes_the_configs_grace_period(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ARGV, "--dump-folder", "gs://my-bucket/run", "--checkpoint.preemption_grace_s=75"]
    assert _cli().main(argv) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert pod_of(manifest["spec"]["replicatedJobs"][0])["spec"]["terminationGracePeriodSeconds"] == 75


def test_cli_refuses_a_grace_period_below_a_second(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ARGV, "--dump-folder", "gs://my-bucket/run", "--checkpoint.preemption_grace_s=0"]
    assert _cli().main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: checkpoint.preemption_grace_s: must be >= 1")
