"""Run model-written Python in a separate, bounded process: `run_python(code, limits) -> SandboxResult`.

The trainer never runs the code itself. Each run gets a fresh temporary folder (its current folder,
deleted afterwards) holding the code as main.py and sandbox_child.py, and a new process of this
interpreter, `python -I -S -B` (no site-packages, no PYTHON* variables, no bytecode written), with an
environment of PATH alone, in a session of its own. What bounds it:

- from here: the wall-clock limit and the output's hard stop kill the whole process group (SIGKILL);
  the output (stdout and stderr, as a terminal interleaves them) is read as it comes, and the first
  `max_output_bytes` of it are kept;
- the network: a new, empty network namespace (`unshare -rn`, where the host lets this user create
  one: probed once per process), so that there is no interface but a down loopback to reach;
- in the child (sandbox_child.py): a seccomp filter that refuses process creation, exec and sockets to
  the kernel; CPU time, address space, file size, open files and RLIMIT_NPROC limits; an audit hook
  that refuses the network, other processes and writing outside the folder with a clear message.

The result says which layers held (`network_isolation`, `process_isolation`), since the namespace and
seccomp depend on the host. What stays open: the program can read whatever this user can read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass(frozen=True)
class SandboxLimits:
    """wall_seconds: the run is killed after this much real time (timed_out);
    cpu_seconds: CPU time (RLIMIT_CPU), killed by SIGXCPU past it (timed_out too);
    memory_mb: address space (RLIMIT_AS); past it allocations fail with MemoryError (memory_exceeded);
    max_output_bytes: the output kept and shown; output_stop_bytes: the output past which the run is
    killed (output_stopped); max_file_mb: the largest file it may write (RLIMIT_FSIZE);
    max_open_files: RLIMIT_NOFILE; network_namespace: run in a new network namespace where the host
    allows one (where it does not, the seccomp filter and the audit hook still refuse sockets)."""

    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 256
    max_output_bytes: int = 16 * 1024
    output_stop_bytes: int = 1024 * 1024
    max_file_mb: int = 16
    max_open_files: int = 64
    network_namespace: bool = True

    def __post_init__(self) -> None:
        numbers = {name: value for name, value in vars(self).items() if name != "network_namespace"}
        bad = [f"{name}={value}" for name, value in numbers.items() if not value > 0]
        if bad:
            raise ValueError(f"sandbox limits must be positive: {', '.join(bad)}")
        if self.output_stop_bytes < self.max_output_bytes:
            raise ValueError(
                f"output_stop_bytes={self.output_stop_bytes} must be at least max_output_bytes={self.max_output_bytes}"
            )


@dataclass(frozen=True)
class SandboxResult:
    """output: stdout and stderr as printed, the first max_output_bytes of it; exit_status: the exit code,
    or minus the signal that ended the process (subprocess's convention); timed_out: stopped by the wall
    clock or the CPU time; output_truncated: it printed more than was kept; output_stopped: killed for
    printing more than output_stop_bytes; memory_exceeded: an allocation failed (MemoryError)."""

    output: str
    exit_status: int
    limits: SandboxLimits
    timed_out: bool = False
    output_truncated: bool = False
    output_stopped: bool = False
    memory_exceeded: bool = False
    network_isolation: tuple[str, ...] = ()  # among "namespace", "seccomp", "audit hook"
    process_isolation: tuple[str, ...] = ()  # among "seccomp", "rlimit", "audit hook"

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and not (self.timed_out or self.output_stopped)

    def as_tool_text(self) -> str:
        """What the model reads: the output, then the exit status and why the run was stopped."""
        lines = [self.output.rstrip("\n")] if self.output.strip() else []
        if self.output_truncated:
            lines.append(f"[output cut: only the first {self.limits.max_output_bytes} bytes are shown]")
        if self.exit_status < 0:
            lines.append(f"exit status: killed by {_signal_name(-self.exit_status)}")
        else:
            lines.append(f"exit status: {self.exit_status}")
        if self.timed_out:
            lines.append(f"stopped: time limit of {self.limits.wall_seconds:g} s")
        if self.output_stopped:
            lines.append(f"stopped: output over {self.limits.output_stop_bytes} bytes")
        if self.memory_exceeded:
            lines.append(f"stopped: memory limit of {self.limits.memory_mb} MiB")
        return "\n".join(lines)


def run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run `code` under `limits` (see the module's docstring); never raises for what the code does."""
    folder = Path(tempfile.mkdtemp(prefix="titan_tpu_sandbox_"))
    status_read, status_write = os.pipe()
    try:
        (folder / "main.py").write_text(code, encoding="utf-8")
        shutil.copyfile(_CHILD, folder / _CHILD.name)
        namespace = limits.network_namespace and _network_namespace_works()
        command = [
            *(["unshare", "-rn"] if namespace else []),
            sys.executable,
            *("-I", "-S", "-B", "-u", "-X", "utf8", _CHILD.name, "main.py", str(status_write)),
            *map(str, (limits.cpu_seconds, limits.memory_mb << 20, limits.max_file_mb << 20, limits.max_open_files)),
        ]
        process = subprocess.Popen(
            command,
            cwd=folder,
            env={"PATH": os.environ.get("PATH", os.defpath)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(status_write,),
        )
        os.close(status_write)
        status_write = -1
        try:
            output, total, timed_out, output_stopped = _read_output(process, limits)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the group's leader is not reaped yet: its id is still ours
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
        status = _read_status(status_read).splitlines()
        if not status and not (timed_out or output_stopped):
            raise RuntimeError(
                f"the sandbox did not start ({command[0]} exited {process.returncode}): {output[:2000]!r}"
            )
    finally:
        os.close(status_read)
        if status_write >= 0:
            os.close(status_write)
        shutil.rmtree(folder, ignore_errors=True)
    seccomp = "seccomp" in status  # a line of its own: "no seccomp" where the filter could not be installed
    return SandboxResult(
        output=bytes(output).decode("utf-8", errors="replace"),
        exit_status=process.returncode,
        limits=limits,
        timed_out=timed_out or process.returncode == -signal.SIGXCPU,
        output_truncated=total > limits.max_output_bytes,
        output_stopped=output_stopped,
        memory_exceeded="memory error" in status,
        network_isolation=(*(["namespace"] if namespace else []), *(["seccomp"] if seccomp else []), "audit hook"),
        process_isolation=(
            *(["seccomp"] if seccomp else []),
            *(["rlimit"] if os.geteuid() != 0 else []),  # RLIMIT_NPROC does not bind root
            "audit hook",
        ),
    )


def _read_output(process: subprocess.Popen[bytes], limits: SandboxLimits) -> tuple[bytearray, int, bool, bool]:
    """Read until the program exits, the wall clock runs out or the output passes the hard stop: (the
    output kept, the bytes printed, timed out, stopped for its output). The process is left unreaped."""
    assert process.stdout is not None
    deadline = time.monotonic() + limits.wall_seconds
    kept, total = bytearray(), 0
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return kept, total, True, False
            if not selector.select(left):
                continue
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            total += len(chunk)
            kept += chunk[: max(0, limits.max_output_bytes - len(kept))]
            if total > limits.output_stop_bytes:
                return kept, total, False, True
    # The output closed; wait for the exit without reaping, so that the group can still be killed.
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return kept, total, True, False
        time.sleep(0.005)
    return kept, total, False, False


def _read_status(fd: int) -> str:
    """What sandbox_child.py reported (its lines are few and short: they are all in the pipe by now)."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks).decode("utf-8", errors="replace")


@functools.cache
def _network_namespace_works() -> bool:
    """Whether this user may create a user and network namespace here (`unshare -rn`); containers often
    forbid it. Probed once per process: the answer does not change while it runs."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "-rn", sys.executable, "-I", "-S", "-c", ""], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
