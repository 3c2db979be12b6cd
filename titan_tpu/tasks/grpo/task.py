"""GRPO as a training task: the trainer's loop, optimizer, checkpoints and metrics, with batches made
by sampling from the policy it is training.

Each rollout batch (rl.prompts_per_step prompts x rl.group_size completions) serves
rl.updates_per_rollout x (rows / training.global_batch_size) optimizer steps; `next_batch` makes a new
one when the previous is used up, from one draw of prompts or several (rl.dynamic_sampling, draws.py).
The prompt stream's position and the count of rollout batches are the task's checkpointed data state;
a checkpoint therefore has to fall between rollout batches (checked at start-up).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.distributed.fsdp import reshard_all
from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.distributed.parallelize import reshard_setting
from titan_tpu.generation.logprobs import logps_of, token_logps
from titan_tpu.metrics.console import ConsoleView
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.decoder import decoder_args, decoder_workload, require_decoding
from titan_tpu.tasks.grpo.advantages import rollout_advantages
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.draws import RolloutDrawer, RolloutPosition
from titan_tpu.tasks.grpo.engines import check_vllm_engine
from titan_tpu.tasks.grpo.length_runs import logps_in_runs
from titan_tpu.tasks.grpo.multi_turn import EpisodeSource, episode_columns
from titan_tpu.tasks.grpo.objective import grpo_loss
from titan_tpu.tasks.grpo.overlong import overlong_penalties
from titan_tpu.tasks.grpo.producer import Sampled
from titan_tpu.tasks.grpo.prompts import PromptStream, prompt_set, stop_ids
from titan_tpu.tasks.grpo.reference import KLReference
from titan_tpu.tasks.grpo.rewards import build_rewards
from titan_tpu.tasks.grpo.rollout import MicroBatch, build_micro_batches
from titan_tpu.tasks.grpo.rollout_dump import EpisodeDumps
from titan_tpu.tasks.grpo.rollout_flops import ForwardCost
from titan_tpu.tasks.grpo.rollout_stats import (
    add_engine_mismatch,
    add_rollout,
    engine_metrics,
    fresh_stats,
    rollout_metrics,
)
from titan_tpu.tasks.grpo.sampling import RolloutSource
from titan_tpu.tasks.grpo.single_turn import CompletionScores
from titan_tpu.tasks.grpo.step_lines import (
    console_view,
    describe_prompts,
    mini_batch_ties,
    tied_groups,
)
from titan_tpu.tasks.grpo.user_code import search_folders


class GRPOTask(TrainingTask):
    unit = "tokens"

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        self.rl = config.section(RLConfig)
        if ctx.spec.loss_fn is None:
            raise ConfigError(f"training.task = 'grpo': model {ctx.spec.name} is not a language model")
        parallel = ctx.parallel
        if parallel.dims.tp_enabled and (parallel.sequence_parallel or parallel.loss_parallel):
            # Prompts, decode steps (one token) and rollout rows have any length, which a sequence
            # shard cannot split evenly; sampling needs every row's whole vocabulary.
            raise ConfigError(
                "training.task = 'grpo' with parallelism.tp > 1 needs parallelism.sequence_parallel = false "
                "and parallelism.loss_parallel = false"
            )
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        # Multi-turn (rl.env): each row an episode, its reward the environment's.
        self.episodes = EpisodeSource(config, self.tokenizer) if self.rl.env else None
        self.prompts = self.episodes.prompt_set(config) if self.episodes else prompt_set(config, self.tokenizer)
        stop_text = self.prompts.stop_text
        self.rewards = (
            []
            if self.episodes
            else build_rewards(self.rl.rewards, self.rl.reference_field, stop_text, search_folders(config))
        )
        self.single = CompletionScores(self.rewards, self.tokenizer, self.rl.reference_field)
        stops = stop_ids(self.tokenizer, stop_text)
        self.params = SamplingParams(self.rl.max_new_tokens, self.rl.temperature, self.rl.top_p, stops)
        self.greedy = dataclasses.replace(self.params, temperature=0.0)
        self.pad_id = self.tokenizer.eos_id
        self.rows = self.rl.prompts_per_step * self.rl.group_size
        global_batch = config.training.global_batch_size
        if self.rows % global_batch != 0:
            raise ConfigError(
                f"rl.prompts_per_step x rl.group_size = {self.rows} completions must be a multiple of "
                f"training.global_batch_size {global_batch} (one optimizer step per mini-batch)"
            )
        self.steps_per_rollout = self.rl.updates_per_rollout * self.rows // global_batch
        interval = config.checkpoint.interval
        if config.checkpoint.enable and interval % self.steps_per_rollout != 0:
            raise ConfigError(
                f"checkpoint.interval {interval} must be a multiple of the {self.steps_per_rollout} optimizer "
                "steps each rollout batch serves, so a checkpoint never splits one"
            )
        self.dp_mesh = ctx.parallel.dp_reduce_mesh
        stream = PromptStream(self.prompts.train, seed=config.training.seed)
        self.position = RolloutPosition(stream, self.rl.prompts_per_step)
        self.queue: deque[MicroBatch] = deque()
        self.reference: KLReference | None = None
        self.source = RolloutSource(ctx, self.rl, stream, self.rows, self.episodes)
        dp_group = self.dp_mesh.get_group() if self.dp_mesh is not None else None
        self.drawer = RolloutDrawer(self.rl, self.source, self.position, self._score, self._global, dp_group)
        # The rewards the record reports one by one: rl.rewards' and the overlong punishment.
        self.reward_parts = [r.name for r in self.rewards] + (["overlong"] if self.rl.overlong_buffer else [])
        self.dumps = EpisodeDumps(ctx.dump_folder, self.rl.dump_rollouts, self.rl.group_size) if self.episodes else None
        # Set by the first loss of a mixture of experts, which adds its routers' aux loss and logs it.
        self._is_moe = False
        self.args: Any = None
        self._last_exit: float | None = None
        self._step_ties = (0, 0)  # of the mini-batch the last step trained on
        self._reset_stats()

    # ------------------------------------------------------------------------------ set-up

    def model_args(self, args: Any) -> Any:
        config = self.ctx.config
        longest = max(len(p.ids) for p in (*self.prompts.train, *self.prompts.held_out))
        needed = longest + self.rl.max_new_tokens
        if config.training.seq_len < needed:
            raise ConfigError(
                f"training.seq_len {config.training.seq_len} is below the longest prompt + rl.max_new_tokens = {needed}"
            )
        if self.episodes is not None:
            self.episodes.check_budget(needed, config.training.seq_len)
        self.args = decoder_args(self.ctx, self.tokenizer, args)
        if self.rl.engine == "vllm":
            check_vllm_engine(self.ctx, self.rl, self.args)
        else:
            require_decoding(
                self.ctx, self.args, "rl.engine = 'builtin'", "set rl.engine = 'vllm' (a vLLM server samples it)"
            )
        return self.args

    def setup(self, model: nn.Module) -> None:
        """With beta > 0, the frozen reference (reference.py): a copy of the run's initial model, or
        the policy with its LoRA adapters off."""
        # The policy's arguments as built: they carry the kernels the trainer measured after
        # model_args, which the reference must run too.
        self.args = model.args
        self.source.setup(self.args, self.pad_id, self._reshard_after(model), self._lockstep())
        if self.rl.beta != 0:
            self.reference = KLReference.for_policy(model, self.ctx, self.args)

    def data_state(self) -> RolloutPosition:
        return self.position

    def flops_per_item(self) -> float:
        # Training FLOPs per trained token; the rollout's forward work is reported as its own rate
        # (rollout_tflops, rollout_mfu; convention in rollout_flops.py).
        return self.ctx.spec.flops_per_token(self.args, self.ctx.config.training.seq_len)

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        return decoder_workload(config, spec, args)

    # ------------------------------------------------------------------------------ batches

    def _reshard_after(self, model: nn.Module) -> Callable[[nn.Module], bool]:
        return reshard_setting(model, self.ctx.config, self.ctx.compute_dtype, self.ctx.device.type)

    def _lockstep(self) -> dist.ProcessGroup | None:
        """The ranks that decode in lockstep: under expert parallelism the ranks of one ep group hold
        other prompts but exchange tokens in every MoE layer of every forward (sampler.generate)."""
        parallel = self.ctx.parallel
        return parallel.ep_mesh.get_group() if parallel.dims.ep_enabled else None

    def _global(self, values: torch.Tensor) -> torch.Tensor:
        """Sum of a [k, N] tensor over data-parallel ranks (each rank fills only its own rows)."""
        return sum_over(values.to(self.ctx.device), self.dp_mesh).cpu() if self.dp_mesh is not None else values

    def _clock_training(self) -> None:
        """Count the time since the last batch left as training (its forward, backward and step)."""
        if self._last_exit is not None:
            self._stats["train_time"] += time.perf_counter() - self._last_exit
        self._last_exit = None

    def next_batch(self, model: nn.Module) -> MicroBatch:
        self._clock_training()
        if not self.queue:
            self._rollout(model)
        batch = self.queue.popleft()
        self._step_ties = batch.groups_tied
        self._stats["train_tokens"] += batch.real_tokens
        self._last_exit = time.perf_counter()
        return batch

    def _score(self, sampled: Sampled) -> dict[str, list[float]]:
        """Rewards, each reward's part and lengths of this rank's rows of a draw."""
        rl, mine = self.rl, self.source.mine
        if sampled.episodes:
            return episode_columns([sampled.episodes[r] for r in mine])
        asked = [sampled.prompts[r // rl.group_size] for r in mine]
        columns = self.single.columns(asked, [sampled.completions[r] for r in mine], keep_sample=self.ctx.is_writer)
        if rl.overlong_buffer:
            penalties = overlong_penalties(
                columns["length"], rl.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty
            )
            columns["reward"] = [reward + penalty for reward, penalty in zip(columns["reward"], penalties)]
            columns["reward/overlong"] = penalties
        return columns

    @torch.no_grad()
    def _rollout(self, model: nn.Module) -> None:
        start = time.perf_counter()
        ctx, rl = self.ctx, self.rl
        version = self.position.rollouts * self.steps_per_rollout
        rollout = self.drawer.next_batch(model, version, self.params)
        mine = self.source.mine
        rewards, lengths = rollout.table["reward"], rollout.table["length"]
        advantages = rollout_advantages(
            rewards, lengths, rl.group_size, rl.advantage_estimator, rl.reward_scaling, rl.advantage_eps
        ).float()
        if self.dumps is not None and ctx.is_writer:
            self.dumps.after_rollout(version, rollout.prompts, rollout.episodes)

        reference = self.reference
        # From an engine other than the trainer's own modules, the trainer scores the same tokens:
        # the engine/trainer mismatch it logs, and the importance-sampling correction's old log-probs.
        engine_apart = self.source.is_vllm
        batches = build_micro_batches(
            self.source.rank_rows,
            {r: rollout.prompts[r // rl.group_size].ids for r in mine},
            rollout.completions,
            advantages,
            lengths,
            ctx.config.training.global_batch_size,
            ctx.local_batch_size,
            ctx.dp_world,
            self.pad_id,
            ctx.device,
            rollout.logps,
            reference.scorer(model) if reference is not None else None,
            first_on_policy=rl.updates_per_rollout == 1,
            trainer_logps=(lambda tokens: token_logps(model, tokens)) if engine_apart else None,
            is_cap=rl.is_cap if engine_apart and rl.is_correction else None,
            trained={r: e.trained for r, e in rollout.episodes.items()} if rollout.episodes else None,
        )
        if engine_apart or (reference is not None and reference.is_adapter_switch):
            reshard_all(model)
        tied = tied_groups(rewards, rl.group_size)
        ties = mini_batch_ties(tied, self.rows, ctx.config.training.global_batch_size, rl.group_size)
        for k, batch in enumerate(batches):
            batch.groups_tied = ties[k * len(ties) // len(batches)]
        for _ in range(rl.updates_per_rollout):
            self.queue.extend(batches)
        # The rollout's time is all of it that is not the policy update: sampling (or waiting for it),
        # rewards, and the log-probabilities scored on the micro-batches.
        self._stats["rollout_time"] += time.perf_counter() - start
        cost = ForwardCost.of_family(ctx.spec.flops_per_token, self.args)
        scoring = int(reference is not None) + int(engine_apart)
        add_rollout(self._stats, rollout, rl.group_size, version, cost, scoring)
        if engine_apart:
            add_engine_mismatch(self._stats, batches, rl.is_cap)

    # ------------------------------------------------------------------------------ loss

    def loss(self, model: nn.Module, batch: MicroBatch) -> TaskLoss:
        rl = self.rl
        output = None
        # Compiled blocks specialise on the sequence length (the CPU's blocked attention loops over
        # it): each run's width would be one more compilation, up to dynamo's limit, in every step.
        if self.ctx.spec.capabilities.repeated_forward and not self.ctx.config.compile.enable:
            logps = logps_in_runs(model, batch.tokens, batch.lengths)
        else:
            output = model(batch.tokens)
            logps = logps_of(output, batch.tokens)
        old_logps = logps.detach() if batch.old_logps is None else batch.old_logps
        terms = grpo_loss(
            logps,
            old_logps,
            batch.advantages,
            batch.mask,
            eps_low=rl.eps_low,
            eps_high=rl.eps_high,
            aggregation=rl.loss_aggregation,
            max_completion_tokens=rl.max_new_tokens,
            beta=rl.beta,
            ref_logps=batch.ref_logps,
            token_normaliser=batch.token_normaliser,
            token_weights=batch.is_weights,
            objective=rl.objective,
            cispo_cap=rl.cispo_cap,
            importance_level=rl.importance_sampling_level,
        )
        loss, aux_loss = terms.loss, torch.zeros((), device=terms.loss.device)
        if output is not None and not isinstance(output, torch.Tensor):
            # A mixture of experts: its routers' load-balancing loss, weighted as pretraining weighs it
            # (titan_tpu/models/qwen3/model.py `moe_loss`; TRL's GRPOTrainer adds it the same way).
            self._is_moe = True
            aux_loss = output.aux_loss.detach()
            loss = loss + output.aux_loss_coef * output.aux_loss
        # Summed on the device: reading them here would make the host wait for every micro-batch.
        self._loss_sums += torch.stack([terms.kl, terms.clip_fraction, aux_loss.to(terms.kl.dtype)])
        self._stats["micro_batches"] += 1
        return TaskLoss(loss, items=batch.real_tokens)

    # ------------------------------------------------------------------------------ metrics

    def _reset_stats(self) -> None:
        self._stats = fresh_stats(self.reward_parts)
        # k3 KL, clip fraction and (MoE) router aux loss of each micro-batch
        self._loss_sums = torch.zeros(3, device=self.ctx.device)

    def step_metrics(self) -> dict[str, float]:
        """Means since the last record: rollout numbers are global already; the per-rank loss numbers
        and rates are combined over data-parallel ranks here (every rank calls this on record steps)."""
        # The trainer has waited for the device; what follows until the next batch (evaluation,
        # checkpoint) is not training time.
        self._clock_training()
        s = self._stats
        counts = torch.tensor([s["micro_batches"], s["train_tokens"], s["train_time"]], dtype=torch.float64)
        local = torch.cat([self._loss_sums.cpu().double(), counts])
        kl, clip, aux, micro, train_tokens, train_time = self._global(local[None])[0].tolist()
        metrics: dict[str, float] = {}
        if micro > 0:
            metrics.update(kl=kl / micro, clip_fraction=clip / micro)
            if self._is_moe:
                metrics["aux_loss"] = aux / micro
        if train_time > 0:
            metrics["train_tokens_per_sec"] = train_tokens / (train_time / self.ctx.dp_world)
        if s["rollouts"] > 0:
            world = self.ctx.parallel.dims.world_size
            metrics.update(rollout_metrics(s, self.reward_parts, self.episodes is not None, world, self.rl))
            metrics.update(engine_metrics(s, self.rl, self.source))
        self._reset_stats()
        return metrics

    def describe_data(self) -> str:
        return describe_prompts(self.ctx.config, self.prompts, self.steps_per_rollout)

    def console_view(self, loss: float, extras: Mapping[str, float]) -> ConsoleView:
        return console_view(loss, self.rl.beta, self._step_ties)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        """Held-out accuracy: the first reward's mean on greedy answers (rl.eval_prompts problems, split
        over ranks); with rl.env, the environment's mean reward on greedy episodes."""
        held_out = self.prompts.held_out[: self.rl.eval_prompts or None]
        if self.episodes is not None:
            if self.dumps is not None and self.ctx.is_writer:
                self.dumps.write(step)
            engine = self.source.evaluation(model, step)
            mine = held_out[self.ctx.dp_rank :: self.ctx.dp_world]
            rewards = [e.reward for e in self.episodes.greedy(engine.generate, mine, self.greedy)]
            reward_sum, count = self._global(torch.tensor([[sum(rewards), float(len(mine))]], dtype=torch.float64))[0]
            return {"heldout_accuracy": float(reward_sum / count) if count else float("nan")}
        ctx = self.ctx
        correct, count = self.single.held_out_accuracy(
            self.source.evaluation(model, step),
            held_out,
            self.greedy,
            ctx.dp_rank,
            ctx.dp_world,
            self.dp_mesh,
            ctx.device,
            # Every rank calls the vLLM engine (its recovery is collective) or decodes in lockstep.
            in_lockstep=self._lockstep() is not None or self.source.is_vllm,
        )
        if ctx.is_writer:
            self.single.log_sample(step)
        return {"heldout_accuracy": correct / count if count else float("nan")}

    def close(self) -> None:
        self.source.close()
