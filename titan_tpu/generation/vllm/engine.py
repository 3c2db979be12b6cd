"""The vLLM rollout engine: `RolloutEngine` over one or more vLLM servers.

Every data-parallel rank is a client: it sends its own prompts, one request per prompt (each with
the row's seed), spread round-robin over the servers, up to IN_FLIGHT_PER_SERVER in flight at once
so that vLLM batches them. Weights travel as a Hugging Face folder: every rank takes part in
gathering the (possibly sharded) model through the family's adapter, rank 0 writes it into shared memory (`/dev/shm` where
the host has it) and has each server load it in place, paused, its prefix cache dropped; on a GPU or
TPU slice of its own the same swap runs over the network filesystem or vLLM's transfer engines
(docs/grpo.md). A started server that dies or hangs is started again, at most rl.engine_restarts
times, and given the last weights pushed; the rollout that failed is generated again.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_tpu.generation.vllm.client import (
    Completion,
    ServedModel,
    ServerClient,
    ServerRefused,
    ServerUnavailable,
)
from titan_tpu.generation.vllm.errors import EngineError, EngineFailed
from titan_tpu.generation.vllm.server import ManagedServer
from titan_tpu.protocols.rollout import Rollout, SamplingParams

logger = logging.getLogger(__name__)

# Requests one rank keeps in flight per server: enough to fill vLLM's batch (its default cap on the
# sequences decoded together, max_num_seqs, is 128 for a CPU server and 256 on a GPU); more wait in
# the server's queue.
IN_FLIGHT_PER_SERVER = 256


@dataclass
class SyncRecord:
    """What the last weight push cost."""

    version: int = -1
    seconds: float = 0.0
    bytes: int = 0


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _broadcast(value: Any) -> Any:
    """Rank 0's value on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class VllmEngine:
    """Rollouts from vLLM servers: the user's (`urls`) or one this engine starts (`managed`, rank 0's).

    `export(model, folder)` writes the trainer's (possibly sharded) model as a Hugging Face folder (every
    rank calls it, rank 0 writes); `weights_folder` is where the pushed folders go (each push a new
    one; the previous is removed). `check_served(model)` says why a server's model is not one this
    run's weights fit (None: they fit); it runs at every connection, before any weights are pushed,
    because vLLM's engine dies on a push of other shapes.
    """

    def __init__(
        self,
        urls: Sequence[str],
        managed: ManagedServer | None,
        export: Callable[[nn.Module, Path], None],
        weights_folder: Path,
        request_timeout: float,
        restarts: int,
        check_served: Callable[[ServedModel], str | None] = lambda model: None,
    ) -> None:
        self.managed = managed if _rank() == 0 else None
        self.check_served = check_served
        self.urls = list(urls)
        self.export = export
        self.weights_folder = weights_folder
        self.request_timeout = request_timeout
        self.restarts_left = restarts
        self.restarts_done = 0
        self.pushed: Path | None = None
        self.sync = SyncRecord()
        self.version = -1
        self.model_name = "policy"
        self.max_model_len = 0
        if self.managed is not None:
            atexit.register(self.managed.stop)
        self._connect()

    # ------------------------------------------------------------------------------ servers

    def _connect(self) -> None:
        """Start the managed server (rank 0) or check the given ones; every rank then knows the URLs,
        the served model's name and its longest sequence."""
        info: tuple[list[str], str, int] | str | None = None
        if _rank() == 0 and self.managed is None and not self.urls:
            info = "engine: no vLLM server to send rollouts to (rl.engine_urls is empty and none was started)"
        elif _rank() == 0:
            try:
                if self.managed is not None and not self.managed.alive():
                    self.managed.start()
                urls = [self.managed.url] if self.managed is not None else self.urls
                served = [ServerClient(url, self.request_timeout).served_model() for url in urls]
                names = {model.name for model in served}
                if len(names) != 1:
                    raise EngineError(
                        f"engine: the servers at {', '.join(urls)} serve different models: {sorted(names)}"
                    )
                for model in served:
                    mismatch = self.check_served(model)
                    if mismatch is not None:
                        raise EngineError(f"engine: the server at {model.url} {mismatch}")
                info = (urls, served[0].name, min(model.max_model_len for model in served))
            except (ServerUnavailable, ServerRefused) as error:
                info = f"engine: {error}; is a vLLM server running there (rl.engine_urls)?"
            except EngineError as error:
                info = str(error)
        info = _broadcast(info)
        if isinstance(info, str):
            raise EngineError(info)
        assert info is not None
        self.urls, self.model_name, self.max_model_len = info
        self.clients = [ServerClient(url, self.request_timeout) for url in self.urls]

    def _recover(self, failure: str) -> None:
        """After a failed rollout: rank 0 starts the managed server again and gives it the last weights
        pushed; every rank then reconnects. User-given servers are not ours to restart."""
        message = None
        if _rank() == 0:
            if self.managed is None:
                message = f"engine: {failure}; the servers at rl.engine_urls are not started by this run"
            elif self.restarts_left == 0:
                message = (
                    f"engine: {failure}; restarted {self.restarts_done} times already; log {self.managed.settings.log}"
                )
            else:
                logger.warning(f"engine: {failure}; starting the vLLM server again (log {self.managed.settings.log})")
                self.managed.stop()
        message = _broadcast(message)
        if message is not None:
            raise EngineFailed(message)
        self.restarts_left -= 1
        self.restarts_done += 1
        try:
            self._connect()
        except EngineError as error:  # mid-run, a server that will not come back stops the run
            raise EngineFailed(str(error)) from None
        if _rank() == 0 and self.pushed is not None:
            for client in self.clients:
                client.swap_weights(str(self.pushed))
        if _distributed():
            dist.barrier()

    # ------------------------------------------------------------------------------ weights

    def load_weights(self, policy: nn.Module, version: int) -> None:
        """Push `policy`'s weights to every server (all ranks call this: the export gathers shards)."""
        if version == self.version:
            return
        start = time.perf_counter()
        folder = self.weights_folder / f"version-{version}"
        if _rank() == 0 and folder.exists():
            shutil.rmtree(folder)  # a folder left by a run that stopped mid-push
        if _distributed():
            dist.barrier()
        self.export(policy, folder)
        error = None
        if _rank() == 0:
            try:
                for client in self.clients:
                    client.swap_weights(str(folder))
            except ServerRefused as refused:
                error = (
                    f"engine: the server would not load this run's weights ({refused}); it serves another "
                    "model or vocabulary than the trainer's"
                )
            except ServerUnavailable as unavailable:
                error = f"unavailable: {unavailable}"
            if self.pushed is not None and self.pushed != folder:
                shutil.rmtree(self.pushed, ignore_errors=True)
        error = _broadcast(error)
        self.pushed = folder
        if error is not None and error.startswith("unavailable: "):
            self._recover(error.removeprefix("unavailable: "))
        elif error is not None:
            raise EngineError(error)
        self.version = version
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if _rank() == 0 else 0
        self.sync = SyncRecord(version, time.perf_counter() - start, int(_broadcast(size)))

    # ------------------------------------------------------------------------------ rollouts

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> Rollout:
        """This rank's completions; a server that stops answering is started again and the whole call
        repeated (on every rank: the call is collective when the run has several processes)."""
        while True:
            failure, rollout = None, None
            try:
                rollout = self.request(prompts, params, seeds)
            except (ServerUnavailable, ServerRefused) as error:
                failure = failure_of(error)
            if not self.recover_if_failed(failure):
                assert rollout is not None
                return rollout

    def recover_if_failed(self, failure: str | None) -> bool:
        """Collective over the ranks: whether any rank's requests failed (`failure`, this rank's), in
        which case the server was started again and given the last weights pushed."""
        failures = _gather_failures(failure)
        refused = [f for f in failures if f.startswith(REFUSED)]
        if refused:  # a request the server will not serve: starting it again would not help
            log = f"; log {self.managed.settings.log}" if self.managed is not None else ""
            raise EngineFailed(f"engine: {refused[0].removeprefix(REFUSED)}{log}")
        if failures:
            self._recover(failures[0])
        return bool(failures)

    def request(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> Rollout:
        """This rank's completions, no collective: a server that does not answer raises ServerUnavailable."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; one seed per prompt")

        def one(index: int) -> Completion:
            client = self.clients[index % len(self.clients)]
            seed = None if seeds is None or params.temperature == 0 else seeds[index]
            return client.complete(self.model_name, prompts[index], params, seed)

        workers = IN_FLIGHT_PER_SERVER * len(self.clients)
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(prompts)))) as pool:
            done = list(pool.map(one, range(len(prompts))))
        return Rollout(
            tokens=[c.tokens for c in done],
            logps=[torch.tensor(c.logps, dtype=torch.float32) for c in done],
            stopped=[c.stopped for c in done],
        )

    def describe(self) -> str:
        return f"vLLM at {', '.join(self.urls)}, weights of step {self.version}"

    def close(self) -> None:
        if self.managed is not None:
            self.managed.stop()
        if _rank() == 0 and self.pushed is not None:
            # Only what this engine wrote: rl.engine_weights_folder may be a folder that holds more.
            shutil.rmtree(self.pushed, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.weights_folder.rmdir()  # when empty


# Marks a failure the server answered with an error status (the others: it did not answer).
REFUSED = "refused: "


def failure_of(error: ServerUnavailable | ServerRefused) -> str:
    """The line a rank hands the others about its failed requests."""
    return f"{REFUSED}{error}" if isinstance(error, ServerRefused) else str(error)


def _gather_failures(failure: str | None) -> list[str]:
    """Every rank's failure (None where it succeeded), so that all ranks recover together."""
    if not _distributed():
        return [failure] if failure else []
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failure)
    return [f for f in everyone if f]


def weights_folder_for(run_folder: Path, chosen: str = "") -> Path:
    """The folder the user chose (servers on other hosts read it over a shared filesystem); else
    shared memory where the host has it (a push is a write and a read of the whole model), else
    beside the run's outputs."""
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    name = "titan_tpu_engine_" + hashlib.sha1(str(run_folder.resolve()).encode()).hexdigest()[:12]
    return (shm / name) if shm.is_dir() else run_folder / "engine_weights"
