"""A stopped peer ends the job: `train.py` under torchrun, one training process SIGSTOPped mid-run.

Two 2-process FSDP jobs of the Llama 3 debug model run side by side, both with a long
`comm.init_timeout_seconds`; one has `comm.train_timeout_seconds` = 5, the other a long one (the
negative control). Once both are training past their first step, rank 1 of each is stopped. The short
job's rank 0 must print the one clear line naming the setting and exit, and torchrun must end the job
with a non-zero status, while the long job is still running then: the timeout, and the switch to the
train timeout after the first step, are what ended it (without the switch the short job would wait out
its long init timeout too).

torch's elastic agent (2.13) answers the failed rank by sending SIGTERM to the stopped one, which cannot
act on it while stopped, and sends SIGKILL only after a fixed 30 s (`_stop_workers` ->
`_shutdown()`; `--shutdown-timeout` does not reach that path). The test checks that the agent has begun
that shutdown and then resumes the stopped process, so it acts on the pending SIGTERM at once instead
of the test idling for 30 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5
LONG_TIMEOUT_S = 300
# Startup of two jobs on a shared 2-core machine, then the timeout with room for a loaded host.
START_DEADLINE_S = 240
END_SLACK_S = 30
CLEAR_LINE = (
    f"rank 0: a collective did not complete within comm.train_timeout_seconds = {TIMEOUT_S} s; "
    "a peer process is stopped, hung or gone"
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")]


class Job:
    """One `torchrun train.py` in its own session, with its output in files."""

    def __init__(self, dump: Path, train_timeout_s: int):
        self.dump = dump
        dump.mkdir(parents=True)
        self.err_path = dump / "torchrun.err"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "train.py",
            "--config",
            "llama3_debug",
            "--training.seq_len=32",
            "--training.global_batch_size=4",
            "--parallelism.dp_shard=2",
            "--training.steps=100000",
            "--training.dtype=float32",
            "--metrics.log_freq=1",
            "--data.shuffle_buffer=16",
            f"--comm.init_timeout_seconds={LONG_TIMEOUT_S}",
            f"--comm.train_timeout_seconds={train_timeout_s}",
            f"--job.dump_folder={dump}",
        ]
        # The CPU path needs no TPU backend; without loading torch_tpu each process starts in a third
        # of the time and memory, which four processes on a shared 2-core machine notice.
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        with open(dump / "torchrun.out", "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        self.workers: dict[int, int] = {}

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def last_step(self) -> int:
        path = self.dump / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        # The writer may be half-way through a line; the complete ones are enough.
        steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
        return max(steps, default=0)

    def find_workers(self) -> dict[int, int]:
        """rank -> pid of the agent's worker processes, from /proc (torchrun starts each in its own session)."""
        try:
            children = [
                int(pid)
                for task in Path(f"/proc/{self.proc.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()
            ]
        except FileNotFoundError:  # the agent has exited
            return self.workers
        for pid in children:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            ranks = [int(v[5:]) for v in environ if v.startswith(b"RANK=")]
            if ranks:
                self.workers[ranks[0]] = pid
        return self.workers

    def kill(self) -> None:
        """Resume and kill the workers (their own sessions, so killing the agent's leaves them), then the agent."""
        if self.proc.poll() is None:
            self.find_workers()
        for pid in self.workers.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[tuple[Job, Job]]:
    short, long = Job(tmp_path / "short", TIMEOUT_S), Job(tmp_path / "long", LONG_TIMEOUT_S)
    try:
        yield short, long
    finally:
        short.kill()
        long.kill()


def wait_until(condition, deadline: float, what: str, *jobs: Job) -> None:
    while not condition():
        for job in jobs:
            assert job.proc.poll() is None, f"{what}: job ended early\n{job.stderr()[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: not within the deadline\n{jobs[0].stderr()[-4000:]}"
        time.sleep(0.1)


def test_stopped_peer_ends_the_job_with_one_clear_line(jobs: tuple[Job, Job]) -> None:
    short, long = jobs
    start = time.monotonic()
    # Step 2 is recorded only after every rank passed the switch to the train timeout (end of step 1).
    both_training = lambda: short.last_step() >= 2 and long.last_step() >= 2  # noqa: E731
    wait_until(both_training, start + START_DEADLINE_S, "both jobs training", short, long)
    started = time.monotonic()
    for job in (short, long):
        os.kill(job.find_workers()[1], signal.SIGSTOP)
    stopped = time.monotonic()

    wait_until(lambda: CLEAR_LINE in short.stderr(), stopped + TIMEOUT_S + END_SLACK_S, "clear line", short)
    reported = time.monotonic() - stopped
    # A collective cannot give up before its timeout: the line is the timeout's, not another failure's.
    assert reported >= TIMEOUT_S
    # The line stands alone: no traceback from the rank that timed out.
    assert "Traceback" not in short.stderr().split(CLEAR_LINE)[0]

    # The negative control, stopped at the same moment with the long timeout, is still waiting.
    assert long.proc.poll() is None and "did not complete within" not in long.stderr()

    # The agent saw rank 0 fail and is shutting the job down (SIGTERM to the stopped rank).
    wait_until(lambda: "closing signal SIGTERM" in short.stderr(), stopped + TIMEOUT_S + END_SLACK_S, "agent", short)
    os.kill(short.workers[1], signal.SIGCONT)
    returncode = short.proc.wait(timeout=END_SLACK_S)
    assert returncode != 0
    print(
        f"\nstartup {started - start:.1f}s; clear line {reported:.1f}s after SIGSTOP "
        f"(timeout {TIMEOUT_S}s); torchrun exit {returncode} {time.monotonic() - stopped:.1f}s after SIGSTOP"
    )
