"""The sections that belong to one kind of training each: `[flux]` (rectified-flow image training,
titan_tpu/tasks/rectified_flow/), `[rl]` (GRPO, titan_tpu/tasks/grpo/) and `[sft]` (supervised
fine-tuning, titan_tpu/tasks/sft/).

They live with the other sections rather than beside their task so that the configuration imports
nothing above it: every section is known, typed and checked before any task (or torch) is imported.
A new kind of training with settings of its own adds its dataclass here and a field to `TrainConfig`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import opt, opt_table, require


@dataclass
class FluxConfig:
    dataset: Literal["generated", "folder", "webdataset"] = opt(
        "generated",
        "generated: coloured shapes at positions with captions (no download); folder: images with "
        "same-named .txt captions under flux.data_path; webdataset: .tar shards (glob in flux.data_path).",
    )
    data_path: str = opt("", "Folder of images + captions, or a glob of webdataset .tar shards.")
    generated_samples: int = opt(4096, "Size of the generated image-caption set.")
    image_size: int = opt(32, "Training images are centre-cropped and resized to this square size (pixels).")
    autoencoder: str = opt(
        "random",
        "identity (latents are the RGB pixels), random (tiny AutoencoderKL from config), or a local "
        "diffusers AutoencoderKL folder.",
    )
    t5_encoder: str = opt("random", "random (tiny T5 encoder from config) or a local T5EncoderModel folder.")
    clip_encoder: str = opt("random", "random (tiny CLIP text model from config) or a local CLIPTextModel folder.")
    t5_max_length: int = opt(32, "Text tokens per caption for T5 (FLUX.1: 512 dev, 256 schnell).")
    clip_max_length: int = opt(77, "Text tokens per caption for CLIP.")
    cache_encodings: bool = opt(
        False, "Encode each image and caption once and reuse the latents and text embeddings (memory)."
    )
    timestep_sampling: Literal["logit_normal", "uniform"] = opt(
        "logit_normal", "Distribution of the flow time t: sigmoid(N(mean, std)) or uniform."
    )
    logit_mean: float = opt(0.0, "Mean of the normal under the sigmoid (logit_normal).")
    logit_std: float = opt(1.0, "Std of the normal under the sigmoid (logit_normal).")
    time_shift: float = opt(
        1.0, "Shift the schedule towards noise: t -> s t / (1 + (s - 1) t); 1 leaves it (FLUX.1 uses ~3)."
    )
    caption_dropout: float = opt(
        0.1, "Probability of replacing a caption by the empty one (classifier-free guidance training)."
    )
    guidance: float = opt(3.5, "Guidance scale fed to guidance-embedding flavors (flux-dev) in training.")
    sample_prompts: str = opt(
        "a red circle at the top left|a blue square in the center|a green triangle at the bottom right"
        "|a yellow circle at the bottom left",
        "Prompts of the sample grid, separated by '|'.",
    )
    sample_steps: int = opt(20, "Euler steps of the sampler.")
    sample_cfg_scale: float = opt(3.0, "Classifier-free guidance scale of the sampler (1 = none).")
    samples_per_prompt: int = opt(2, "Images per prompt in the sample grid (one row per prompt).")

    def validate(self) -> None:
        if self.dataset != "generated":
            require(bool(self.data_path), "flux.data_path", f"is required when flux.dataset = '{self.dataset}'")
        require(self.generated_samples >= 1, "flux.generated_samples", "must be >= 1")
        require(
            self.image_size >= 8 and self.image_size % 8 == 0,
            "flux.image_size",
            f"must be a multiple of 8, at least 8, got {self.image_size}",
        )
        for key in ("autoencoder", "t5_encoder", "clip_encoder"):
            require(bool(getattr(self, key)), f"flux.{key}", "must not be empty")
        require(self.t5_max_length >= 1, "flux.t5_max_length", "must be >= 1")
        require(self.clip_max_length >= 2, "flux.clip_max_length", "must be >= 2")
        require(self.logit_std > 0, "flux.logit_std", f"must be > 0, got {self.logit_std}")
        require(self.time_shift > 0, "flux.time_shift", f"must be > 0, got {self.time_shift}")
        require(
            0 <= self.caption_dropout < 1, "flux.caption_dropout", f"must be in [0, 1), got {self.caption_dropout}"
        )
        require(bool(self.prompts()), "flux.sample_prompts", "must hold at least one prompt")
        require(self.sample_steps >= 1, "flux.sample_steps", "must be >= 1")
        require(self.samples_per_prompt >= 1, "flux.samples_per_prompt", "must be >= 1")

    def prompts(self) -> list[str]:
        return [p.strip() for p in self.sample_prompts.split("|") if p.strip()]


@dataclass
class RLConfig:
    task: Literal["arithmetic", "data"] = opt(
        "arithmetic",
        "Prompts: arithmetic = generated 'a+b=' problems; data = your records from data.source/data.path "
        "(.jsonl/.parquet files or an offline Hugging Face dataset), rendered with the chat template.",
    )
    prompt_field: str = opt("prompt", "data: record field holding the prompt, a string or a list of role/content turns.")
    system_prompt: str = opt("", "data: a system turn put before each prompt that has none; empty = none.")
    eval_path: str = opt(
        "", "data: held-out records (.jsonl/.parquet) for the held-out accuracy; empty = rl.held_out_fraction of data.path."
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
    eps_low: float = opt(0.2, "Clip the importance ratio from below at 1 - eps_low.")
    eps_high: float = opt(0.2, "Clip the importance ratio from above at 1 + eps_high (DAPO uses 0.28).")
    beta: float = opt(
        0.0, "Weight of the k3 KL penalty against the frozen initial policy; 0 builds no reference model."
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = opt(
        "token_mean",
        "token_mean: over all completion tokens of a mini-batch (DAPO); seq_mean_token_mean: per "
        "completion, then over completions (GRPO paper); seq_mean_token_sum_norm: token sums / "
        "max_new_tokens, then over completions (Dr. GRPO).",
    )
    scale_rewards: bool = opt(
        True, "Divide group-centred rewards by the group's std (GRPO); false keeps them centred only (Dr. GRPO)."
    )
    advantage_eps: float = opt(1e-4, "Added to the group std before dividing by it.")
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
        metadata={"doc": (
            "The reward is the weighted sum of these, each a table { fn, weight = 1.0 }: fn = 'exact' (the "
            "answer before the stop text equals the reference), 'math' (the same value by math-verify: "
            "'#### 42', \\boxed{}, fractions, LaTeX), 'format' (with pattern = a regular expression the "
            "whole completion must match) or 'module:function', your own: called once per rollout batch "
            "with (prompts, completions, records), it returns one float per completion. The first is the "
            "held-out accuracy's."
        )},
    )
    reference_field: str = opt("answer", "Record field holding the reference answer that exact and math compare with.")
    max_operand: int = opt(99, "arithmetic: operands are integers in [0, max_operand].")
    held_out_fraction: float = opt(
        0.05, "Share of the problems (arithmetic) or records (data without rl.eval_path) kept out of training."
    )
    eval_prompts: int = opt(
        256, "Held-out problems decoded greedily at each evaluation (metrics.eval_freq); 0 = all of them."
    )

    def validate(self) -> None:
        require(self.group_size >= 2, "rl.group_size", f"must be >= 2 (a group is its own baseline), got {self.group_size}")
        require(self.prompts_per_step >= 1, "rl.prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        require(self.updates_per_rollout >= 1, "rl.updates_per_rollout", f"must be >= 1, got {self.updates_per_rollout}")
        for key in ("eps_low", "eps_high"):
            value = getattr(self, key)
            require(0 < value < 10, f"rl.{key}", f"must be in (0, 10), got {value}")
        require(self.eps_low < 1, "rl.eps_low", f"must be < 1 (the lower clip 1 - eps_low stays > 0), got {self.eps_low}")
        require(self.beta >= 0, "rl.beta", f"must be >= 0, got {self.beta}")
        require(self.advantage_eps > 0, "rl.advantage_eps", f"must be > 0, got {self.advantage_eps}")
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
        for index, table in enumerate(self.rewards):
            _check_reward_table(table, f"rl.rewards[{index}]")

    def needs_reference(self) -> bool:
        """Whether a built-in reward compares with each record's rl.reference_field."""
        return any(table.get("fn") in ("exact", "math") for table in self.rewards)


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
        f"{where}.weight", f"must be a finite number, got {weight!r}",
    )
    pattern = table.get("pattern")
    if fn == "format":
        require(isinstance(pattern, str) and bool(pattern), f"{where}.pattern", "is required for fn = 'format' (a regular expression)")
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"{where}.pattern: not a regular expression: {err}") from None
    else:
        require(pattern is None, f"{where}.pattern", f"applies to fn = 'format' only, not {fn!r}")


@dataclass
class SftConfig:
    dataset: Literal["data", "generated"] = opt(
        "data",
        "data: the records data.source and data.path name (.jsonl/.parquet files, or an offline Hugging "
        "Face dataset); generated: a generated chat task (no download) for the debug config and tests.",
    )
    train_on: Literal["assistant", "last_assistant", "completion", "all"] = opt(
        "assistant",
        "Tokens the loss trains on: every assistant turn (with its end-of-turn token), the last one, "
        "the completion of prompt/completion records, or all tokens.",
    )
    packing: bool = opt(
        True, "Pack examples one after another into rows of training.seq_len; false pads one example per row."
    )
    overflow: Literal["truncate", "drop"] = opt(
        "truncate", "An example longer than a row: keep its first seq_len + 1 tokens, or leave it out."
    )
    messages_field: str = opt("messages", "Record field holding a conversation (a list of role/content turns).")
    prompt_field: str = opt("prompt", "Record field holding the prompt of prompt/completion records.")
    completion_field: str = opt("completion", "Record field holding the completion of prompt/completion records.")
    template_switches: dict[str, Any] = opt_table(
        "Variables the chat template reads, e.g. { enable_thinking = false } for Qwen 3."
    )
    generated_examples: int = opt(4096, "generated: conversations in the training set.")
    generated_held_out: int = opt(256, "generated: conversations kept apart for validation and generation.")
    eval_generations: int = opt(
        16,
        "At each evaluation, greedily answer the last user turn of this many held-out conversations and "
        "report the share answered exactly; 0 = none.",
    )
    max_new_tokens: int = opt(64, "Longest generated answer in evaluations, in tokens.")

    def validate(self) -> None:
        for key in ("messages_field", "prompt_field", "completion_field"):
            require(bool(getattr(self, key)), f"sft.{key}", "must not be empty")
        require(self.generated_examples >= 1, "sft.generated_examples", f"must be >= 1, got {self.generated_examples}")
        require(self.generated_held_out >= 1, "sft.generated_held_out", f"must be >= 1, got {self.generated_held_out}")
        require(self.eval_generations >= 0, "sft.eval_generations", f"must be >= 0, got {self.eval_generations}")
        require(self.max_new_tokens >= 1, "sft.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
