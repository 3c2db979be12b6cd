"""The first code of a sandboxed run, in the child process, before the model's program (see sandbox.py).

sandbox.py copies this file into the run's temporary folder and starts it as
`python -I -S -B -u -X utf8 sandbox_child.py main.py STATUS_FD CPU_S MEMORY_B FILE_B OPEN_FILES`. It is
a script of the standard library alone: it must not import titan_tpu, which is not on the child's path.
In this order, it

1. installs a seccomp filter (Linux x86_64 and aarch64) that makes the kernel refuse the system calls
   that create processes or threads (clone, clone3, fork, vfork), replace the program (execve,
   execveat), open sockets (socket) or trace other processes (ptrace). This holds for root too, which
   RLIMIT_NPROC does not bind; it is reported on STATUS_FD, since on another architecture or kernel it
   may be missing;
2. sets the resource limits: CPU time, address space, file size, open files, and RLIMIT_NPROC = 0 (a
   second layer against fork for a user other than root);
3. installs an audit hook (PEP 578) that refuses, with a message that names the sandbox, what a Python
   program does to reach the network or other programs (any socket event, os.system, os.exec*,
   os.fork, os.forkpty, os.posix_spawn, subprocess.Popen, importing _posixsubprocess, whose fork_exec
   raises no audit event, any ctypes event, os.kill, setrlimit), changing permissions or owners, and
   writing files outside the run's folder. An audit hook is not a security boundary (Python code can
   be written around it); the kernel layers above are. The hook turns what they refuse with a bare
   errno into a clear message, and it is the only layer where they are not available;
4. runs main.py as `__main__`, prints an uncaught exception's traceback without this file's frames,
   and reports a MemoryError on STATUS_FD.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
import sys
import traceback
from typing import Any

# (AUDIT_ARCH_*, the system call numbers to refuse) per machine, from the kernel's unistd tables.
_SYSCALLS = {
    # clone, fork, vfork, execve, execveat, clone3, socket, ptrace
    "x86_64": (0xC000003E, (56, 57, 58, 59, 322, 435, 41, 101)),
    # clone, execve, execveat, clone3, socket, ptrace (no fork or vfork there)
    "aarch64": (0xC00000B7, (220, 221, 281, 435, 198, 117)),
}
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI numbers: refused whole

_REFUSED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "resource.setrlimit",
        "resource.prlimit",
        "os.chmod",
        "os.chown",
        "os.chflags",
        "os.lchmod",
        "os.lchown",
        "os.lchflags",
    }
)
_REFUSED_PREFIXES = ("socket.", "ctypes.")
_REFUSED_IMPORTS = frozenset({"_posixsubprocess"})
# Events that change the file system: (position of a path it changes, position of the dir_fd argument a
# relative path is taken from, if any) for each path.
_WRITES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
    "shutil.rmtree": ((0, 1),),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def deny_syscalls() -> bool:
    """Install the seccomp filter; False where this machine or kernel has none to offer."""
    arch, numbers = _SYSCALLS.get(platform.machine(), (0, ()))
    if not numbers:
        return False
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM

    def statement(code: int, k: int) -> bytes:
        return struct.pack("HBBI", code, 0, 0, k)

    def jump(code: int, k: int, if_true: int, if_false: int) -> bytes:
        return struct.pack("HBBI", code, if_true, if_false, k)

    load, ret, jeq, jge = 0x20, 0x06, 0x15, 0x35  # BPF_LD|W|ABS, BPF_RET|K, BPF_JMP|JEQ|K, BPF_JMP|JGE|K
    program = [
        statement(load, 4),  # seccomp_data.arch
        jump(jeq, arch, 1, 0),
        statement(ret, deny),  # a system call of another ABI (i386 on x86_64)
        statement(load, 0),  # seccomp_data.nr
        jump(jge, _X32_SYSCALL_BIT, len(numbers) + 1, 0),
        *(jump(jeq, number, len(numbers) - i, 0) for i, number in enumerate(numbers)),
        statement(ret, allow),
        statement(ret, deny),
    ]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(b"".join(program))
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        return False
    fprog = Program(len(program), ctypes.addressof(code))
    return bool(libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) == 0)


def set_limits(cpu_seconds: int, memory_bytes: int, file_bytes: int, open_files: int) -> None:
    """Soft and hard limits alike, so that the program cannot raise them back (never above the limit the
    host already sets). Past the CPU time the kernel sends SIGXCPU (a second later SIGKILL); past the
    address space an allocation fails (MemoryError); past the file size a write fails (Python ignores
    SIGXFSZ); RLIMIT_NPROC = 0 makes fork fail for any user but root."""
    for limit, value in (
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_NOFILE, open_files),
        (resource.RLIMIT_NPROC, 0),
    ):
        host = resource.getrlimit(limit)[1]
        hard = value + 1 if limit == resource.RLIMIT_CPU else value
        if host != resource.RLIM_INFINITY:
            value, hard = min(value, host), min(hard, host)
        resource.setrlimit(limit, (value, hard))


def install_guard(folder: str) -> None:
    """The audit hook: see the module's docstring. A path counts as inside the folder when it resolves
    there, symbolic links followed (a relative one from its dir_fd, as shutil.rmtree passes them)."""
    folder = os.path.realpath(folder)

    def inside(path: Any, dir_fd: Any = None) -> bool:
        if isinstance(path, int):  # a descriptor, opened (and checked) before
            return True
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        real = os.path.realpath(path)
        return real == folder or real.startswith(folder + os.sep)

    def guard(event: str, args: tuple[Any, ...]) -> None:
        if event in _REFUSED_EVENTS or event.startswith(_REFUSED_PREFIXES):
            raise PermissionError(f"{event} is not allowed in this sandbox")
        if event == "import" and args[0] in _REFUSED_IMPORTS:
            raise ImportError(f"{args[0]} (starting processes) is not allowed in this sandbox")
        if event == "open" and args[2] & _WRITE_FLAGS and args[0] is not None and not inside(args[0]):
            raise PermissionError(f"writing {args[0]!r} is not allowed in this sandbox: only the current folder")
        if event in _WRITES and not all(
            inside(args[path], None if dir_fd is None else args[dir_fd]) for path, dir_fd in _WRITES[event]
        ):
            raise PermissionError(f"{event} outside the current folder is not allowed in this sandbox")

    sys.addaudithook(guard)


def run(path: str, status_fd: int) -> int:
    """Run the program as `__main__`; its exit status. A MemoryError is reported on status_fd too."""
    with open(path, encoding="utf-8") as file:
        source = file.read()
    sys.argv = [path]
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    try:
        exec(compile(source, path, "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as error:
        namespace.clear()  # frees what filled the memory, so that the traceback can be printed
        if isinstance(error, MemoryError):
            _report(status_fd, "memory error")
        # The traceback without this file's frames (run, the audit hook): they are no business of the model's.
        report = traceback.TracebackException.from_exception(error)
        here = os.path.abspath(__file__)
        report.stack = traceback.StackSummary.from_list(
            [f for f in report.stack if os.path.abspath(f.filename) != here]
        )
        print("".join(report.format()), end="", file=sys.stderr)
        return 1
    return 0


def _report(status_fd: int, line: str) -> None:
    try:
        os.write(status_fd, line.encode() + b"\n")
    except OSError:  # the program closed it
        pass


def main(argv: list[str]) -> None:
    path, status_fd = argv[1], int(argv[2])
    cpu_seconds, memory_bytes, file_bytes, open_files = map(int, argv[3:7])
    _report(status_fd, "seccomp" if deny_syscalls() else "no seccomp")
    set_limits(cpu_seconds, memory_bytes, file_bytes, open_files)
    install_guard(os.getcwd())
    status = run(path, status_fd)
    sys.stdout.flush()
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv)
