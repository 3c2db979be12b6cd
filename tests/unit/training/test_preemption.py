"""Preemption on one process (titan_tpu/training/preemption.py): SIGTERM or SIGINT in the middle of a
step ends the run after that step's optimizer step, with a checkpoint of that step from which a
restart resumes bit for bit; a second signal does not cut the save short; with checkpoints off the
run still stops with the signal's status; a signal while an async save is in flight leaves the
previous checkpoint loadable and the save in flight is waited for. The same under FSDP 2, with the
signal reaching one rank and through titan-launch: tests/distributed/test_preemption.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.launch import fixed_kernels
from tests.support.parity import capture_states, full_state
from tests.support.trained_losses import trained_losses
from titan_tpu.checkpoint import CheckpointManager, layout, storage
from titan_tpu.config import ConfigError, load_config
from titan_tpu.training.preemption import SIGNALS, Preempted, PreemptionWatch
from titan_tpu.training.trainer import Trainer

STEPS = 6
STOP = 3  # the signal comes in the middle of this step
BASE = [
    "--training.seq_len=64",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--training.deterministic=true",
    "--metrics.log_freq=1",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1000",  # only the last step, which the preempted runs never reach
    "--checkpoint.keep_latest_k=0",
    f"--training.steps={STEPS}",
    *fixed_kernels("llama3_debug"),
]


@pytest.fixture
def handlers_kept() -> Iterator[None]:
    """The test process's handlers, whatever a failing test left installed."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def make_trainer(dump: Path, *overrides: str) -> Trainer:
    return Trainer(load_config("llama3_debug", [f"--job.dump_folder={dump}", *BASE, *overrides]))


def signal_during_step(trainer: Trainer, step: int, signum: int) -> None:
    """Send `signum` to this process during step `step`, after its backward, before its optimizer step."""
    forward_backward = trainer.forward_backward

    def and_signal() -> tuple[torch.Tensor, int]:
        result = forward_backward()
        if trainer.step == step - 1:
            os.kill(os.getpid(), signum)
        return result

    trainer.forward_backward = and_signal  # type: ignore[method-assign]


def train_until_stopped(trainer: Trainer) -> Preempted:
    try:
        with pytest.raises(Preempted) as stopped:
            trainer.train()
    finally:
        trainer.close()
    return stopped.value


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    differing = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differing, f"{what}: {differing[:5]} differ"


pytestmark = pytest.mark.usefixtures("one_thread", "handlers_kept")  # one_thread: tests/support/one_thread.py


def test_sigterm_saves_the_step_in_progress_and_the_restart_resumes_bitwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: no handler (the run dies mid-step, no checkpoint), a flag never acted on (the run trains
    on), a save taken before the step's optimizer step (the checkpoint would hold step 2's state,
    which the negative control shows differs from step 3's), a resume that is not exact (weights,
    AdamW state, later losses), a second signal that aborts the save, handlers left installed."""
    straight = make_trainer(tmp_path / "straight")
    states = capture_states(straight, (STOP - 1, STOP, STEPS))
    _, straight_losses = trained_losses(straight)
    assert sorted(straight_losses) == list(range(1, STEPS + 1))

    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    dump = tmp_path / "preempted"
    root = dump / "checkpoint"
    trainer = make_trainer(dump)
    signal_during_step(trainer, STOP, signal.SIGTERM)
    # A second signal (Ctrl-C) while the preemption save writes its files.
    write_data = storage.ChecksummingWriter.write_data

    def interrupted_write(self: Any, plan: Any, planner: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return write_data(self, plan, planner)

    monkeypatch.setattr(storage.ChecksummingWriter, "write_data", interrupted_write)
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        stopped = train_until_stopped(trainer)
    assert (stopped.code, stopped.signum, stopped.step) == (128 + signal.SIGTERM, signal.SIGTERM, STOP)
    assert stopped.checkpoint == root / f"step-{STOP}"
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
    assert layout.complete_steps(root) == [STOP]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preempted at step")]
    assert line.startswith(f"preempted at step {STOP} by SIGTERM: checkpoint saved in {root / f'step-{STOP}'} in ")
    assert line.endswith("restart the same command to resume") and "checkpoint.preemption_grace_s = 30" in line
    assert "SIGINT received again: already saving the checkpoint, which goes on" in capfd.readouterr().err
    monkeypatch.undo()

    resumed = make_trainer(dump)
    assert resumed.step == STOP
    # Negative control: step 3's optimizer step changed every parameter's state, so a checkpoint
    # written before it could not pass the check below.
    assert not any(torch.equal(states[STOP - 1][k], states[STOP][k]) for k in states[STOP] if k.startswith("param/"))
    assert_same_state(full_state(resumed.model, resumed.optimizer), states[STOP], "loaded checkpoint vs step 3")
    final = capture_states(resumed, (STEPS,))
    _, resumed_losses = trained_losses(resumed)
    assert resumed_losses == {step: straight_losses[step] for step in range(STOP + 1, STEPS + 1)}
    assert_same_state(final[STEPS], states[STEPS], "resumed vs uninterrupted, after the last step")


def test_without_checkpoints_sigint_stops_after_the_step_with_its_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Catches SIGINT ending the run mid-step (KeyboardInterrupt), a run that trains on, and one that
    ends with status 0 or claims a checkpoint when checkpoint.enable = false."""
    trainer = make_trainer(tmp_path, "--checkpoint.enable=false")
    signal_during_step(trainer, 2, signal.SIGINT)
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        stopped = train_until_stopped(trainer)
    assert (stopped.code, stopped.step, stopped.checkpoint) == (128 + signal.SIGINT, 2, None)
    assert trainer.step == 2 and not (tmp_path / "checkpoint").exists()
    messages = [r.getMessage() for r in caplog.records]
    assert "preempted at step 2 by SIGINT: no checkpoint was written because checkpoint.enable = false" in "\n".join(
        messages
    )


def test_sigterm_during_an_async_save_keeps_the_previous_checkpoint_and_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Async saves every 2 steps; step 4's stalls in the background after writing its data files; SIGTERM
    comes in step 5. The preemption save must wait for step 4's before saving step 5. Meanwhile the
    folder is copied as it is: what a SIGKILL at the end of the grace period would leave. Catches a
    save in flight made visible before it is complete (the copy would hold a step-4), a copy that
    does not load, and a preemption that drops the save in flight, does not save its own step, or
    says it saved before the save was committed."""
    dump, killed = tmp_path / "run", tmp_path / "killed"
    preemption_save = threading.Event()
    save = CheckpointManager.save

    def noting_save(self: CheckpointManager, step: int, model_only: bool = False, blocking: bool = False) -> bool:
        if blocking:
            preemption_save.set()
        return save(self, step, model_only, blocking)

    write_data = storage.ChecksummingWriter.write_data

    def stalling_write(self: Any, plan: Any, planner: Any) -> Any:
        future = write_data(self, plan, planner)
        if Path(self.path).name.startswith(".step-4.tmp-"):  # DCP's background thread
            assert preemption_save.wait(120), "the preemption save never started"
            time.sleep(0.2)  # the training thread is waiting for this save by now
            shutil.copytree(dump, killed)
        return future

    monkeypatch.setattr(CheckpointManager, "save", noting_save)
    monkeypatch.setattr(storage.ChecksummingWriter, "write_data", stalling_write)
    trainer = make_trainer(dump, "--checkpoint.async_mode=async", "--checkpoint.interval=2")
    signal_during_step(trainer, 5, signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        stopped = train_until_stopped(trainer)
    monkeypatch.undo()
    assert stopped.step == 5
    said = [r.getMessage() for r in caplog.records]
    order = [
        next(i for i, line in enumerate(said) if line.startswith(start))
        for start in (
            f"checkpoint: saved {dump / 'checkpoint' / 'step-4'} ",
            f"checkpoint: saved {dump / 'checkpoint' / 'step-5'} ",
            "preempted at step 5 by SIGTERM: checkpoint saved in",
        )
    ]
    assert order == sorted(order), said
    assert layout.complete_steps(dump / "checkpoint") == [2, 4, 5]
    assert layout.complete_steps(killed / "checkpoint") == [2]
    assert list((killed / "checkpoint").glob(".step-4.tmp-*/*.distcp"))
    restarted = make_trainer(killed)  # checks every file against its manifest before loading
    try:
        assert restarted.step == 2
        assert not list((killed / "checkpoint").glob(".step-4.tmp-*"))  # the killed save's leftovers
    finally:
        restarted.close()


def test_handlers_only_note_the_first_signal_and_are_restored(capfd: pytest.CaptureFixture[str]) -> None:
    """Catches a handler that raises (KeyboardInterrupt) or does more than note the signal, a later
    signal replacing the first, and handlers that are not put back."""
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    watch = PreemptionWatch(30, is_writer=True)
    watch.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert watch.received == signal.SIGTERM
        assert watch.agreed_signal() == signal.SIGTERM  # one process: its own
    finally:
        watch.restore()
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
    err = capfd.readouterr().err
    assert "SIGTERM received: stopping after the step in progress" in err
    assert "SIGINT received again: already stopping after the step in progress" in err


def test_a_step_longer_than_the_grace_period_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    watch = PreemptionWatch(0.05, is_writer=True)
    with caplog.at_level(logging.WARNING, logger="titan_tpu"):
        for _ in range(3):
            assert watch.agreed_signal() == 0
            time.sleep(0.1)
    warnings = [r.getMessage() for r in caplog.records if "preemption_grace_s = 0.05 s" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("preemption: a step took")


def test_grace_period_below_one_second_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.preemption_grace_s: must be >= 1 \(seconds\), got 0"):
        load_config("llama3_debug", ["--checkpoint.preemption_grace_s=0"])


ABANDON = """
import os, signal, sys
from titan_tpu.training.preemption import PreemptionWatch
watch = PreemptionWatch(30, is_writer=False)
watch.install()
if sys.argv[1] == "signal":
    os.kill(os.getpid(), signal.SIGTERM)  # noted, as during a collective that then fails
watch.abandon()
print("still running")
"""


@pytest.mark.parametrize(("case", "returncode"), [("signal", -signal.SIGTERM), ("none", 0)])
def test_a_failure_leaving_the_loop_ends_the_process_on_a_noted_signal(case: str, returncode: int) -> None:
    """When one process fails, torchrun's agent sends SIGTERM to the others, whose clean-up may wait on
    the failed peer: a noted signal must end them at once, as it did before the watch (it used to
    keep them until the agent's SIGKILL, a restart 60 s slower in the two-host kill test). Without a
    signal, abandon() only puts the handlers back."""
    done = subprocess.run([sys.executable, "-c", ABANDON, case], capture_output=True, text=True, timeout=60)
    assert done.returncode == returncode, done.stderr[-2000:]
    assert ("still running" in done.stdout) == (case == "none")
