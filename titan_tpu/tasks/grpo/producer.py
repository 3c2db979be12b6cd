"""Rollouts sampled ahead of training (rl.max_staleness > 0): a thread of this rank's own asks the
engine for the draws after the one being trained, while the trainer trains (a draw is a rollout
batch's prompts, or one of several with rl.dynamic_sampling; "rollout" below stands for either).

The thread does no collective and touches no model: it only sends this rank's prompts to the engine
(vLLM servers, in processes of their own) and keeps what comes back. The trainer's thread decides
when it may go on: it pushes new weights to the engine only between two of the thread's rollouts
(`paused`), then allows it the rollouts up to `max_staleness` past the one it trains next (`allow`).
A rollout is therefore sampled from weights at most max_staleness rollouts old. A rollout whose
requests failed comes back with its failure, and the trainer, once the engine is back, has it sampled
again from that index on (`restart_from`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from titan_tpu.generation.episodes import Trajectory
from titan_tpu.tasks.grpo.prompts import Prompt


@dataclass
class Sampled:
    """One rollout's completions of this rank's rows, before they are scored."""

    index: int  # the draw's place in the run: its prompts are the stream's from index x prompts_per_step on
    prompts: list[Prompt]  # the rollout's prompts (every rank's, the same on each)
    completions: dict[int, list[int]] = field(default_factory=dict)  # row -> token ids
    logps: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> the sampler's log-probs
    version: int = -1  # optimizer steps behind the weights that sampled it
    seconds: float = 0.0
    failure: str | None = None  # the engine did not answer (the rollout holds no completions then)
    episodes: dict[int, Trajectory] = field(default_factory=dict)  # row -> its episode (rl.env)


class RolloutProducer:
    """`sample(index)` in a thread, for index = first, first + 1, ... as far as `allow` lets it."""

    def __init__(self, sample: Callable[[int], Sampled], first: int) -> None:
        self._sample = sample
        self._next = first
        self._allowed = first - 1
        self._epoch = 0  # bumped by restart_from: a rollout begun before it is dropped
        self._results: dict[int, Sampled] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self.idle_seconds = 0.0  # spent waiting for the trainer to allow the next rollout
        self._state = threading.Condition()
        self._generating = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._state:
                idle = time.perf_counter()
                self._state.wait_for(lambda: self._stopped or self._next <= self._allowed)
                self.idle_seconds += time.perf_counter() - idle
                if self._stopped:
                    return
                index, epoch = self._next, self._epoch
            try:
                with self._generating:
                    result = self._sample(index)
            except BaseException as error:  # handed to the trainer's thread, which raises it
                with self._state:
                    self._error = error
                    self._state.notify_all()
                return
            with self._state:
                if epoch == self._epoch:
                    self._results[index] = result
                    self._next = index + 1
                self._state.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No rollout is being sampled while inside (the trainer pushes weights here)."""
        with self._generating:
            yield

    def allow(self, last: int) -> None:
        """The thread may sample rollouts up to index `last`."""
        with self._state:
            self._allowed = max(self._allowed, last)
            self._state.notify_all()

    def take(self, index: int) -> tuple[Sampled, float]:
        """Rollout `index` (waiting for it if need be) and the seconds spent waiting."""
        start = time.perf_counter()
        with self._state:
            self._state.wait_for(lambda: index in self._results or self._error is not None)
            if self._error is not None:
                raise self._error
            result = self._results.pop(index)
        return result, time.perf_counter() - start

    def restart_from(self, index: int) -> None:
        """Drop rollout `index` and everything after it; the thread samples them again."""
        with self._state:
            self._epoch += 1
            self._results = {i: r for i, r in self._results.items() if i < index}
            self._next = index
            self._state.notify_all()

    def close(self) -> None:
        with self._state:
            self._stopped = True
            self._state.notify_all()
        self._thread.join(timeout=60)
