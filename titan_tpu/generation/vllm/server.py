"""A vLLM server the run starts and stops itself: its own process group, in the engine's own
environment, serving a Hugging Face folder, with its output in a log file beside the run's outputs.

The server is started without a tokenizer (prompts and completions are token ids) and, on a CPU,
without graph compilation (`--enforce-eager`: minutes of start-up saved; decode steps are eager on a
CPU anyway). Its workers are spawned by vLLM; the parent here is a plain subprocess.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from titan_tpu.generation.vllm.client import ServerClient
from titan_tpu.generation.vllm.errors import EngineError

logger = logging.getLogger(__name__)

# vLLM's default token budget of one scheduler step for a CPU server.
CPU_STEP_TOKENS = 2048


@dataclass(frozen=True)
class ServerSettings:
    python: Path  # the engine environment's interpreter
    model_folder: Path  # a Hugging Face folder (config.json and weights)
    dtype: str  # "float32" or "bfloat16"
    memory_share: float  # vLLM's gpu_memory_utilization (host RAM on a CPU)
    tensor_parallel: int
    max_model_len: int
    log: Path
    start_timeout: float
    device_type: str  # "cpu", "cuda", ...
    extra_args: tuple[str, ...] = ()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ManagedServer:
    """Start, watch and stop one server process; `url` is where it answers."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        s = self.settings
        command = [
            str(s.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(s.model_folder),
            "--served-model-name",
            "policy",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            s.dtype,
            "--skip-tokenizer-init",
            "--max-model-len",
            str(s.max_model_len),
            "--gpu-memory-utilization",
            str(s.memory_share),
            "--tensor-parallel-size",
            str(s.tensor_parallel),
        ]
        if s.device_type == "cpu":
            # Chunked prefill off: on a CPU, vLLM 0.32 rewinds a seeded request's generator after a
            # partial prefill with an offset the CPU generator does not have, and its engine dies
            # ("CPU Generator does not use offset") once a rollout's prompts exceed one step's
            # token budget. Whole prompts per step need a budget of at least one sequence.
            budget = max(CPU_STEP_TOKENS, s.max_model_len)
            command += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
        return [*command, *s.extra_args]

    def start(self) -> str:
        """Start the server and wait until it answers; its URL. A server that exits or does not answer
        within the start-up timeout is an EngineError naming its log and its last line."""
        s = self.settings
        port = free_port()
        s.log.parent.mkdir(parents=True, exist_ok=True)
        environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
        # The trainer's own environment must not leak into the engine's interpreter.
        environment.pop("PYTHONPATH", None)
        with s.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(port), stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{port}"
        client = ServerClient(self.url, timeout=10)
        deadline = time.monotonic() + s.start_timeout
        start = time.perf_counter()
        while not client.healthy(timeout=5):
            if self.process.poll() is not None:
                raise EngineError(
                    f"engine: the vLLM server exited with status {self.process.returncode} while starting "
                    f"({_last_line(s.log)}); log {s.log}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"engine: the vLLM server did not answer within rl.engine_start_timeout = {s.start_timeout:g} s "
                    f"({_last_line(s.log)}); log {s.log}"
                )
            time.sleep(1.0)
        logger.info(f"engine: vLLM server up at {self.url} in {time.perf_counter() - start:.0f} s (log {s.log})")
        return self.url

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Stop the server and its engine and worker processes (its whole process group): SIGTERM,
        then SIGKILL after 20 s. Also when the server itself is already gone: a server killed by a
        signal leaves its engine core and workers running, each holding its share of memory."""
        if self.process is None:
            return
        group = self.process.pid
        for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if not self._group_alive(group):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
            deadline = time.monotonic() + grace
            while self._group_alive(group) and time.monotonic() < deadline:
                time.sleep(0.2)
        self.process = None

    def _group_alive(self, group: int) -> bool:
        assert self.process is not None
        self.process.poll()  # reap the server itself, so that a dead one does not count as a member
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1].strip()[:300] if lines else "no output"
