"""Preemption: SIGTERM or SIGINT during training ends the run after the step in progress, with a
checkpoint of that step.

GKE sends SIGTERM to a pod before it preempts, evicts or deletes it, and SIGKILL
`terminationGracePeriodSeconds` later (30 s unless set; scripts/gke/render_jobset.py sets it to
checkpoint.preemption_grace_s). torchrun's agent (titan-launch runs it) passes the signal on to the
training processes; Ctrl-C in a terminal sends SIGINT to all of them.

While `Trainer.train()` runs, the handlers only note the first signal and when it came: a handler
runs between two bytecodes of the main thread, which may be inside a collective, a save or logging.
After every step's optimizer step every rank calls `agreed_signal()`: one MAX all-reduce of that
signal's number, a CPU int on the default group (gloo on every backend; about 0.4 ms between two
processes on a 2-core CPU), so ranks the signal reached at different moments stop after the same
step. They save that step synchronously (an async save in flight is waited for first), rank 0 says
where in one line, and every rank raises `Preempted`: a SystemExit whose status is 128 + the
signal's number, as a shell reports a process a signal ended, so a launcher or JobSet sees that the
run did not finish. A second signal during the save is noted and does not interrupt it.

What cannot be helped: the step in progress has to end before anything is saved. When it and the
save take longer than the grace period, SIGKILL ends the run mid-save and a restart resumes from
the checkpoint before (a save becomes visible only when complete, titan_tpu/checkpoint/layout.py).
The time from the signal to the saved checkpoint is logged against checkpoint.preemption_grace_s,
and a warning says so once when a step alone takes longer than it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from titan_tpu.checkpoint import CheckpointManager, layout

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The status of a process that ends on signal `signum` after handling it (143 for SIGTERM)."""
    return 128 + signum


class Preempted(SystemExit):
    """The run stopped on a signal after its step was saved (`checkpoint` is None when checkpointing
    is off). Uncaught, it ends the process with status 128 + the signal's number."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        super().__init__(exit_status(signum))
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint


class PreemptionWatch:
    """`install()` before the loop, `agreed_signal()` on every rank after every step, `stop()` when
    that is not 0, `restore()` when the loop is over (the handlers found before come back), or
    `abandon()` when a failure leaves it."""

    def __init__(self, grace_s: float, is_writer: bool) -> None:
        self.grace_s = grace_s
        self.is_writer = is_writer
        self._signum = 0
        self._received_at = 0.0
        self._saving = False
        self._stopped = False
        self._previous: dict[int, Any] = {}
        self._last_check: float | None = None
        self._warned_slow_step = False

    # -- handlers ---------------------------------------------------------------------------------

    def install(self) -> None:
        """Catch SIGTERM and SIGINT. Python runs handlers in the main thread only and installs them only
        from there; a trainer driven from another thread is left with the handlers it had."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _put_back(self) -> None:
        for sig, handler in self._previous.items():
            # None: a handler not set from Python; the default is the closest Python can put back.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def restore(self) -> None:
        self._put_back()
        if self._signum and not self._stopped and self.is_writer:
            logger.info(
                "preemption: %s came after the last step's check; the run ends as it was going to",
                signal.Signals(self._signum).name,
            )

    def abandon(self) -> None:
        """A failure is leaving the loop: put the handlers back, and end the process at once on a signal
        already noted, as it would have ended without the watch. When one process fails, torchrun's
        agent stops the others with SIGTERM; noted and kept for the end of a step that never comes,
        it would leave them in their clean-up (which may wait on the failed peer) until SIGKILL, and
        delay the restart by the agent's shutdown timeout."""
        signum = self._signum if not self._stopped else 0
        self._put_back()
        if signum:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only note it: this may run inside a collective, a save or a logging call of the main thread.
        # One os.write (no logging lock, no buffer) tells a person at the terminal what happens next.
        name = signal.Signals(signum).name
        if not self._signum:
            self._signum = signum
            self._received_at = time.monotonic()
            note = f"{name} received: stopping after the step in progress, which is then saved"
        elif self._saving:
            note = f"{name} received again: already saving the checkpoint, which goes on (SIGKILL ends it at once)"
        else:
            note = f"{name} received again: already stopping after the step in progress"
        if self.is_writer:
            try:
                os.write(2, f"preemption: {note}\n".encode())
            except OSError:
                pass

    @property
    def received(self) -> int:
        """The first signal this process received (0: none yet)."""
        return self._signum

    # -- at the end of every step -----------------------------------------------------------------

    def agreed_signal(self) -> int:
        """The signal every rank stops for after this step, or 0 to go on: the largest of the ranks'
        first signals. Every rank calls it after every step, at the same point of the loop."""
        self._note_step_time()
        signum = self._signum
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([signum], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signum

    def _note_step_time(self) -> None:
        """Warn once when the time between two checks (one step, with its evaluation, logging and
        checkpoint) is longer than the grace period: a signal then could not be acted on in time."""
        now = time.monotonic()
        last, self._last_check = self._last_check, now
        if last is None or self._warned_slow_step or now - last <= self.grace_s:
            return
        self._warned_slow_step = True
        if self.is_writer:
            logger.warning(
                "preemption: a step took %.1f s (its evaluation, logging and checkpoint included), longer "
                "than checkpoint.preemption_grace_s = %g s: a preempted run would be killed before the "
                "step in progress ends and is saved, and resume from the checkpoint before it",
                now - last,
                self.grace_s,
            )

    def stop(self, signum: int, step: int, checkpointer: CheckpointManager, saved: bool) -> NoReturn:
        """After the optimizer step of `step`: save it (`saved`: its regular save has run, so wait for
        that one), say where in one line, and raise Preempted. Every rank calls it."""
        self._stopped = self._saving = True
        name = signal.Signals(signum).name
        start = time.monotonic()
        # This rank's own signal, or the moment the ranks agreed when the signal reached another rank.
        since = self._received_at or start
        if not checkpointer.cfg.enable:
            self._say(
                logging.WARNING,
                f"preempted at step {step} by {name}: no checkpoint was written because checkpoint.enable = "
                "false; a restart begins again at step 0",
            )
            raise Preempted(signum, step, None)
        folder = layout.step_dir(checkpointer.root, step)
        if saved:
            checkpointer.wait()
            written = True
        else:
            written = checkpointer.save(step, blocking=True)
        now = time.monotonic()
        if not written:
            # The manager has said why (a checkpoint of that step from another history); it is kept.
            self._say(
                logging.WARNING,
                f"preempted at step {step} by {name}: not saved, since {folder} already exists and is never "
                "overwritten; a restart resumes from the newest complete checkpoint",
            )
            raise Preempted(signum, step, None)
        self._say(
            logging.WARNING,
            f"preempted at step {step} by {name}: checkpoint saved in {folder} in {now - start:.1f} s "
            f"({now - since:.1f} s after the signal; checkpoint.preemption_grace_s = {self.grace_s:g}); restart "
            "the same command to resume",
        )
        if now - since > self.grace_s:
            self._say(
                logging.WARNING,
                f"preemption: the step in progress and its save took {now - since:.1f} s, longer than "
                f"checkpoint.preemption_grace_s = {self.grace_s:g} s; on GKE SIGKILL would have ended the run "
                "mid-save (the checkpoint before would be resumed): raise the grace period, which "
                "render_jobset.py writes into the pods",
            )
        raise Preempted(signum, step, folder)

    def _say(self, level: int, message: str) -> None:
        if self.is_writer:
            logger.log(level, message)
