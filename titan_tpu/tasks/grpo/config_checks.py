"""The checks of GRPO's `[rl]` section (config.py declares its keys): each value in range, none set that
the chosen prompts, episodes, engine or variant would not read, and (`check_rl_with`) the [data] and
[validation] values GRPO reads. Torch-free like the section, since the loader runs them before torch
loads (tests/unit/repository/test_layering.py: a section module's `config_*.py` siblings)."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import require

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig
    from titan_tpu.tasks.grpo.config import RLConfig


def check_rl(rl: RLConfig) -> None:
    """Every [rl] value on its own and against the others (RLConfig.validate)."""
    require(rl.group_size >= 2, "rl.group_size", f"must be >= 2 (a group is its own baseline), got {rl.group_size}")
    require(rl.prompts_per_step >= 1, "rl.prompts_per_step", f"must be >= 1, got {rl.prompts_per_step}")
    require(rl.updates_per_rollout >= 1, "rl.updates_per_rollout", f"must be >= 1, got {rl.updates_per_rollout}")
    for key in ("eps_low", "eps_high"):
        value = getattr(rl, key)
        require(0 < value < 10, f"rl.{key}", f"must be in (0, 10), got {value}")
    require(rl.eps_low < 1, "rl.eps_low", f"must be < 1 (the lower clip 1 - eps_low stays > 0), got {rl.eps_low}")
    require(rl.beta >= 0, "rl.beta", f"must be >= 0, got {rl.beta}")
    require(rl.advantage_eps > 0, "rl.advantage_eps", f"must be > 0, got {rl.advantage_eps}")
    _check_variants(rl)
    require(rl.temperature >= 0, "rl.temperature", f"must be >= 0, got {rl.temperature}")
    require(0 < rl.top_p <= 1, "rl.top_p", f"must be in (0, 1], got {rl.top_p}")
    require(rl.max_new_tokens >= 1, "rl.max_new_tokens", f"must be >= 1, got {rl.max_new_tokens}")
    require(rl.rollout_buckets >= 1, "rl.rollout_buckets", f"must be >= 1, got {rl.rollout_buckets}")
    require(bool(rl.stop_text), "rl.stop_text", "must not be empty")
    require(rl.max_operand >= 1, "rl.max_operand", f"must be >= 1, got {rl.max_operand}")
    require(0 < rl.held_out_fraction < 1, "rl.held_out_fraction", f"must be in (0, 1), got {rl.held_out_fraction}")
    require(rl.eval_prompts >= 0, "rl.eval_prompts", f"must be >= 0, got {rl.eval_prompts}")
    require(bool(rl.reference_field), "rl.reference_field", "must not be empty")
    require(bool(rl.prompt_field), "rl.prompt_field", "must not be empty")
    require(bool(rl.rewards), "rl.rewards", "must name at least one reward")
    require(rl.engine_tp >= 1, "rl.engine_tp", f"must be >= 1, got {rl.engine_tp}")
    require(0 < rl.engine_memory < 1, "rl.engine_memory", f"must be in (0, 1), got {rl.engine_memory}")
    for key in ("engine_start_timeout", "engine_request_timeout"):
        require(getattr(rl, key) > 0, f"rl.{key}", f"must be > 0, got {getattr(rl, key)}")
    require(rl.engine_restarts >= 0, "rl.engine_restarts", f"must be >= 0, got {rl.engine_restarts}")
    require(rl.sync_every >= 1, "rl.sync_every", f"must be >= 1, got {rl.sync_every}")
    require(rl.max_staleness >= 0, "rl.max_staleness", f"must be >= 0 (0 = synchronous), got {rl.max_staleness}")
    require(rl.is_cap >= 1, "rl.is_cap", f"must be >= 1, got {rl.is_cap}")
    require(rl.max_turns >= 1, "rl.max_turns", f"must be >= 1 (one model turn at least), got {rl.max_turns}")
    require(
        rl.max_episode_tokens >= 0,
        "rl.max_episode_tokens",
        f"must be >= 0 (0 = training.seq_len), got {rl.max_episode_tokens}",
    )
    require(rl.dump_rollouts >= 0, "rl.dump_rollouts", f"must be >= 0, got {rl.dump_rollouts}")
    if rl.env:
        for key in SINGLE_TURN_ONLY:
            require(
                _unset(rl, key),
                f"rl.{key}",
                f"is read by single-turn GRPO; with rl.env = {rl.env!r} the environment renders each record "
                "and gives the reward (set what it reads in rl.env_args); remove it",
            )
    else:
        for key in ENV_ONLY:
            require(
                _unset(rl, key),
                f"rl.{key}",
                "applies to multi-turn episodes (rl.env); set rl.env or remove it",
            )
    for url in rl.engine_urls:
        require(
            url.startswith(("http://", "https://")),
            "rl.engine_urls",
            f"{url!r} is not an http(s):// address of a vLLM server",
        )
    if rl.engine == "builtin":
        for key in VLLM_ONLY:
            require(
                _unset(rl, key),
                f"rl.{key}",
                "applies to rl.engine = 'vllm' (the builtin sampler runs on the trainer's own modules, "
                "in step with training); set rl.engine = 'vllm' or leave it unset",
            )
    for index, table in enumerate(rl.rewards):
        _check_reward_table(table, f"rl.rewards[{index}]")


def check_rl_with(rl: RLConfig, config: TrainConfig) -> None:
    """The [data] and [validation] values GRPO reads, against rl.task: records the arithmetic
    generator would not read, keys of the other prompt source, a held-out loss GRPO does not measure."""
    data = config.data
    require(
        data.text_field == "text" and not data.document_mask,
        "data.text_field" if data.text_field != "text" else "data.document_mask",
        "is for pretraining text; GRPO reads rl.prompt_field of its prompt records and samples one "
        "completion per row; remove it",
    )
    if rl.task == "arithmetic":
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
                _unset(rl, key),
                f"rl.{key}",
                "applies to rl.task = 'data'; remove it or set rl.task = 'data'",
            )
    else:
        require(
            not rl.eval_path or _unset(rl, "held_out_fraction"),
            "rl.held_out_fraction",
            "splits data.path's records when rl.eval_path is empty; rl.eval_path holds the held-out prompts "
            "here; remove one of them",
        )
        require(
            _unset(rl, "max_operand"),
            "rl.max_operand",
            "applies to rl.task = 'arithmetic'; remove it or set rl.task = 'arithmetic'",
        )
    if rl.env:
        require(
            rl.task == "data",
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

# The keys of one rl.rewards table.
REWARD_KEYS = ("fn", "weight", "pattern")


def _default(rl: RLConfig, key: str) -> Any:
    spec = next(f for f in fields(rl) if f.name == key)
    return spec.default_factory() if spec.default is MISSING and spec.default_factory is not MISSING else spec.default


def _unset(rl: RLConfig, key: str) -> bool:
    """Whether rl.<key> has its default: a variant (or prompt source, engine) that does not read it leaves it so."""
    return getattr(rl, key) == _default(rl, key)


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
                f"rl.cispo_cap instead; remove it (or set its default, {_default(rl, key)})",
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
