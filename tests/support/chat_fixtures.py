"""Checkpoint folders with a published chat template and a small tokenizer that has its special tokens.

The templates are the published ones: Qwen 3's (`Qwen/Qwen3-8B`'s tokenizer_config.json) and Llama
3.1's (`meta-llama/Llama-3.1-8B-Instruct`'s), read from the copies TRL ships as package data
(`trl/chat_templates/qwen3.jinja`, `llama3_1.jinja`; TRL compares them byte for byte against
checkpoints' templates), so nothing is downloaded and nothing is copied into this repository. The
tokenizer is a byte-level BPE trained here on a few sentences, with the family's special tokens
added as the published tokenizer has them (special, or plain added tokens such as Qwen's <think>).
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "template": "qwen3.jinja",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
        # As Qwen 3's tokenizer_config.json: no bos, eos is the end of turn, pad is end of text.
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    },
    "llama3_1": {
        "template": "llama3_1.jinja",
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "added": [],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    },
}

CORPUS = [
    "You are a helpful assistant. Answer briefly.",
    "What is two plus two? Two plus two is four.",
    "Name a prime number larger than ten. Thirteen is prime.",
    "Thank you! You are welcome. Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "The quick brown fox jumps over the lazy dog; 0123456789 #### \\boxed{42}",
]


def published_template(family: str) -> str:
    return (files("trl") / "chat_templates" / FAMILIES[family]["template"]).read_text(encoding="utf-8")


def checkpoint_folder(root: Path, family: str, with_template: bool = True) -> Path:
    """`root/family` holding tokenizer.json and tokenizer_config.json (with the chat template unless
    `with_template` is False), loadable by transformers' AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = FAMILIES[family]
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=spec["special"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens(spec["added"])
    if spec["config"].get("bos_token"):
        # As Llama 3's tokenizer.json: plain encoding (add_special_tokens) starts with bos.
        bos = spec["config"]["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "add_bos_token": False,
        **{k: v for k, v in spec["config"].items() if v is not None},
    }
    if with_template:
        config["chat_template"] = published_template(family)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


# A multi-turn conversation with a system prompt; the first answer carries reasoning, which Qwen 3's
# template drops from turns before the last user message.
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nFour."},
    {"role": "user", "content": "Name a prime number larger than ten."},
    {"role": "assistant", "content": "Thirteen."},
]
