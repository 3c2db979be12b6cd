"""Where GRPO's rollouts come from: the engine (rl.engine), the weights it samples from, and with
rl.max_staleness > 0 the thread that samples ahead of training.

What is sampled is a draw: rl.prompts_per_step prompts x rl.group_size completions, numbered by its
place in the prompt stream. A rollout batch is one draw, or several with rl.dynamic_sampling
(draws.py); either way draws are sampled in order.

Weight versions count optimizer steps. Before a rollout batch the trainer has taken (batches so far) x
steps_per_rollout steps; the engine gets those weights when at least rl.sync_every steps passed since
its last push (the builtin engine samples from the trainer's modules themselves, so it always has
them). Synchronous (max_staleness 0): draw d is sampled after the push, from those weights.
Asynchronous: after the push the sampling thread may go up to draw d + max_staleness; since every
rollout batch takes at least one draw, a draw is trained at most max_staleness rollout batches after
the weights that sampled it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from titan_tpu.generation.vllm.client import ServerRefused, ServerUnavailable
from titan_tpu.generation.vllm.engine import SyncRecord, VllmEngine, failure_of
from titan_tpu.protocols.rollout import RolloutEngine, SamplingParams
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.engines import rollout_engines
from titan_tpu.tasks.grpo.multi_turn import EpisodeSource
from titan_tpu.tasks.grpo.producer import RolloutProducer, Sampled
from titan_tpu.tasks.grpo.prompts import PromptStream
from titan_tpu.tasks.grpo.rollout import rank_rows

logger = logging.getLogger(__name__)


class RolloutSource:
    def __init__(
        self,
        ctx: TaskContext,
        rl: RLConfig,
        stream: PromptStream,
        rows: int,
        episodes: EpisodeSource | None = None,
    ) -> None:
        self.ctx, self.rl, self.stream = ctx, rl, stream
        self.episodes = episodes  # multi-turn (rl.env): each row an episode, else one completion
        self.rows = rows
        self.rank_rows: list[list[int]] = []  # this rank's rows of each mini-batch (set up with the engines)
        self.mine: list[int] = []
        self.rollout_engine: RolloutEngine | None = None
        self.evaluation_engine: RolloutEngine | None = None
        self.producer: RolloutProducer | None = None
        self.pushed_version = -1

    def setup(
        self,
        args: object,
        pad_id: int,
        reshard_after: Callable[[nn.Module], bool],
        lockstep: dist.ProcessGroup | None,
    ) -> None:
        ctx = self.ctx
        self.rank_rows = rank_rows(self.rows, ctx.config.training.global_batch_size, ctx.dp_rank, ctx.dp_world)
        self.mine = [r for mini in self.rank_rows for r in mini]
        self.rollout_engine, self.evaluation_engine = rollout_engines(
            self.ctx, self.rl, args, pad_id, reshard_after, lockstep
        )

    @property
    def is_vllm(self) -> bool:
        return isinstance(self.rollout_engine, VllmEngine)

    def sync_record(self) -> SyncRecord | None:
        return self.rollout_engine.sync if isinstance(self.rollout_engine, VllmEngine) else None

    # ------------------------------------------------------------------------------ rollouts

    def rollout(self, model: nn.Module, index: int, version: int, params: SamplingParams) -> tuple[Sampled, float]:
        """Draw `index` of this rank's rows for training at weights `version` (optimizer steps taken),
        and the seconds the trainer waited for it beyond sampling it itself (asynchronous only; 0 when
        synchronous)."""
        if self.rl.max_staleness == 0:
            self._push(model, version)
            return self._sample(index, params, collective=True), 0.0
        if self.producer is None:
            if index > 0 and self.ctx.is_writer:
                # What a stopped run had sampled ahead was never trained on and is not in its checkpoint.
                logger.info(
                    f"rollouts: resuming at draw {index} (step {version}); the draws sampled ahead of "
                    f"training before the stop (up to {self.rl.max_staleness}) are sampled again"
                )
            self.producer = RolloutProducer(lambda i: self._sample(i, params, collective=False), first=index)
        with self.producer.paused():
            self._push(model, version)
        self.producer.allow(index + self.rl.max_staleness)
        sampled, waited = self.producer.take(index)
        engine = self._vllm()
        while engine.recover_if_failed(sampled.failure):
            self.producer.restart_from(index)
            sampled, more = self.producer.take(index)
            waited += more
        return sampled, waited

    def _push(self, model: nn.Module, version: int, due: bool = False) -> None:
        """The engine samples from `model`'s weights from now on, when rl.sync_every steps passed since
        its last push or `due` (every rank calls this: a push gathers the model's shards)."""
        if not due and self.pushed_version >= 0 and version - self.pushed_version < self.rl.sync_every:
            return
        assert self.rollout_engine is not None
        self.rollout_engine.load_weights(model, version)
        self.pushed_version = version

    def _sample(self, index: int, params: SamplingParams, collective: bool) -> Sampled:
        """This rank's completions of draw `index`. `collective`: through `generate`, which recovers
        from an engine failure with the other ranks; else through the vLLM engine's `request`, whose
        failure is handed back in the result (the sampling thread does no collective)."""
        start = time.perf_counter()
        rl, seed = self.rl, self.ctx.config.training.seed
        prompts = self.stream.at(index * rl.prompts_per_step, rl.prompts_per_step)
        rows = self.mine
        asked = [prompts[r // rl.group_size].ids for r in rows]
        seeds = [hash((seed, index, r)) % (2**63) for r in rows]
        sampled = Sampled(index=index, prompts=prompts, version=self.pushed_version)
        assert self.rollout_engine is not None
        generate = self.rollout_engine.generate if collective else self._vllm().request
        try:
            if self.episodes is not None:
                episodes = self.episodes.sample(generate, prompts, rows, index, params, collective)
                sampled.episodes = episodes
                sampled.completions = {r: e.tokens for r, e in episodes.items()}
                sampled.logps = {r: e.logp_tensor() for r, e in episodes.items()}
            else:
                out = generate(asked, params, seeds)
                sampled.completions = dict(zip(rows, out.tokens))
                sampled.logps = dict(zip(rows, out.logps))
        except (ServerUnavailable, ServerRefused) as error:
            sampled.failure = failure_of(error)
            return sampled
        sampled.seconds = time.perf_counter() - start
        return sampled

    def _vllm(self) -> VllmEngine:
        engine = self.rollout_engine
        if not isinstance(engine, VllmEngine):
            raise RuntimeError("asynchronous rollouts need the vLLM engine (rl.engine = 'vllm')")
        return engine

    def evaluation(self, model: nn.Module, step: int) -> RolloutEngine:
        """The engine held-out evaluation samples with, given the current weights (pushed whatever
        rl.sync_every says: an evaluation of older weights would report another model's accuracy)."""
        assert self.evaluation_engine is not None
        if self.evaluation_engine is self.rollout_engine:
            with self.producer.paused() if self.producer is not None else contextlib.nullcontext():
                self._push(model, step, due=True)
        else:
            self.evaluation_engine.load_weights(model, step)
        return self.evaluation_engine

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if isinstance(self.rollout_engine, VllmEngine):
            self.rollout_engine.close()
