"""GRPO's prompts: the arithmetic generator's problems, or your records (`rl.task = "data"`), each
turned once into the token ids the policy is prompted with, with its record and place for rewards.

A record's prompt (`rl.prompt_field`) is a string or a `messages` list of role/content turns. With
a chat tokenizer (a checkpoint folder, or `chatml_bytes`) it is rendered with the checkpoint's
template and its generation prompt, after `rl.system_prompt` as a system turn when that is set and
the prompt brings no system turn of its own; with the byte tokenizer a string prompt is used as it
is. The held-out prompts are `rl.eval_path`'s records, or else a seeded `rl.held_out_fraction` of
the records, which training never draws from.

The prompts are a stream in a seeded order whose position is the only state (`PromptStream`), so a
resumed run continues with the next prompt and every data-parallel layout sees the same sequence.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.chat_masks import check_messages, end_of_turn
from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.chat_tokenizer import tokenizer_folder
from titan_tpu.data.sft_records import FileRecords, HuggingFaceRecords
from titan_tpu.data.tokenizer import HFTokenizer
from titan_tpu.tasks.grpo.arithmetic import ArithmeticProblems
from titan_tpu.tasks.grpo.config import RLConfig

# An arithmetic prompt starts on a new line, as every problem does in its pretraining text.
ARITHMETIC_PREFIX = "\n"
_SPLIT_SEED = 1234


Record = tuple[str, dict[str, Any]]  # where it is (file and line) and its fields


@dataclass(frozen=True)
class Prompt:
    text: str  # what the policy is prompted with, as text (rewards receive it)
    ids: list[int]
    record: dict[str, Any]
    place: str  # the record's file and line, for errors


@dataclass(frozen=True)
class PromptSet:
    train: list[Prompt]
    held_out: list[Prompt]
    stop_text: str  # what ends a completion: rl.stop_text, or the chat template's end of turn


def chat_template_of(config: TrainConfig) -> ChatTemplate | None:
    """The tokenizer folder's chat template (or data.chat_template); None for the byte tokenizer."""
    if config.data.tokenizer == "byte":
        return None
    return ChatTemplate.from_folder(tokenizer_folder(config.data.tokenizer), config.data.chat_template or None)


def prompt_set(config: TrainConfig, tokenizer: Any) -> PromptSet:
    rl = config.section(RLConfig)
    if rl.task == "arithmetic":
        problems = ArithmeticProblems(rl.max_operand, rl.held_out_fraction)

        def arithmetic(items: list[Any]) -> list[Prompt]:
            return [
                Prompt(
                    p.prompt,
                    tokenizer.encode(ARITHMETIC_PREFIX + p.prompt),
                    p.record(rl.reference_field),
                    f"arithmetic problem {p.prompt}",
                )
                for p in items
            ]

        return PromptSet(arithmetic(problems.train), arithmetic(problems.held_out), _stop_text(rl.stop_text, None))
    template = chat_template_of(config)
    if template is not None and not isinstance(tokenizer, HFTokenizer):
        raise ConfigError("data.tokenizer: a chat template needs its checkpoint's tokenizer (a folder), not 'byte'")
    train, held_out = split_records(config)

    def render(items: list[Record]) -> list[Prompt]:
        prompts = []
        for where, record in items:
            text = _prompt_text(record, where, template, rl)
            prompts.append(Prompt(text, tokenizer.encode(text), record, where))
        return prompts

    return PromptSet(render(train), render(held_out), _stop_text(rl.stop_text, template, **rl.template_switches))


def split_records(config: TrainConfig) -> tuple[list[Record], list[Record]]:
    """data.path's records to train on and the held-out ones: rl.eval_path's records, or else a seeded
    rl.held_out_fraction of data.path's."""
    rl = config.section(RLConfig)
    records = _records(config.data.source, config.data.path, config.data.hf_split, "data.path")
    if rl.eval_path:
        train, held_out = records, _records("files", rl.eval_path, "", "rl.eval_path")
    else:
        order = list(range(len(records)))
        random.Random(_SPLIT_SEED).shuffle(order)
        count = max(1, round(rl.held_out_fraction * len(records)))
        held = set(order[:count])
        train = [r for i, r in enumerate(records) if i not in held]
        held_out = [r for i, r in enumerate(records) if i in held]
    if not train:
        raise ConfigError(f"data.path: {config.data.path!r} leaves no training prompts after the held-out split")
    return train, held_out


def stop_ids(tokenizer: Any, stop_text: str) -> tuple[int, ...]:
    """The tokens that end a completion: the stop text's last token, and the tokenizer's eos."""
    return tuple(dict.fromkeys(tokenizer.encode(stop_text)[-1:] + [tokenizer.eos_id]))


def _stop_text(setting: str, template: ChatTemplate | None, **switches: Any) -> str:
    if setting != "auto":
        return setting
    return end_of_turn(template, **switches) if template is not None else "\n"


def _records(source: str, path: str, split: str, key: str) -> list[Record]:
    if not path:
        raise ConfigError(
            f"{key}: rl.task = 'data' needs the prompt records' path (.jsonl/.parquet files or a dataset)"
        )
    if source == "files":
        reader: Any = FileRecords(path, key)
    elif source == "huggingface":
        reader = HuggingFaceRecords(path, split, key)
    else:
        raise ConfigError("data.source: rl.task = 'data' reads records: set it to 'files' or 'huggingface'")
    return [(where, record) for _, where, record in reader.records()]


def _prompt_text(record: dict[str, Any], where: str, template: ChatTemplate | None, rl: Any) -> str:
    prompt = record.get(rl.prompt_field)
    if isinstance(prompt, str) and prompt:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        messages = list(prompt)
        check_messages(messages, where)
    else:
        fields = ", ".join(sorted(record)) or "no fields"
        raise ConfigError(
            f"{where}: rl.prompt_field {rl.prompt_field!r} must be a non-empty string or list of turns "
            f"(the record has {fields})"
        )
    if rl.reference_field not in record and rl.needs_reference():
        raise ConfigError(
            f"{where}: no {rl.reference_field!r} field (rl.reference_field), which the exact and math rewards read"
        )
    if template is None:
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: a list of turns needs a chat template; data.tokenizer 'byte' has none")
        return prompt
    if rl.system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": rl.system_prompt})
    return template.render(messages, add_generation_prompt=True, **rl.template_switches)


class PromptStream:
    """Training prompts in a seeded order, epoch after epoch (reshuffled each epoch); a Stateful
    object whose state is the position in that stream."""

    def __init__(self, prompts: Sequence[Any], seed: int) -> None:
        self.prompts = prompts
        self.seed = seed
        self.position = 0  # prompts handed out so far, over all epochs

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[Any]:
        """The next `count` prompts of the global stream (the same whatever the parallel layout)."""
        taken = self.at(self.position, count)
        self.position += count
        return taken

    def at(self, position: int, count: int) -> list[Any]:
        """The `count` prompts from `position` on, without moving the stream (a rollout sampled ahead
        of training takes its prompts this way; training takes them when it uses the rollout)."""
        taken: list[Any] = []
        while len(taken) < count:
            epoch, index = divmod(position + len(taken), len(self.prompts))
            chunk = self._order(epoch)[index : index + count - len(taken)]
            taken += [self.prompts[i] for i in chunk]
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "size": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["size"] != len(self.prompts):
            raise ValueError(
                f"checkpoint's prompt stream (seed {state['seed']}, {state['size']} prompts) does not match "
                f"this run's (seed {self.seed}, {len(self.prompts)} prompts); resume with the same [rl] task"
            )
        self.position = int(state["position"])
