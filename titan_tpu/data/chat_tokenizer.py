"""The tokenizer folder of a run: a checkpoint's own, or the built-in `chatml_bytes` one.

Fine-tuning needs more than a `tokenizer.json`: the folder beside it holds the chat template and the
special tokens (`tokenizer_config.json`), and the fine-tuned model is exported with them. A run's
`data.tokenizer` names a tokenizer.json or its folder; the folder is that path or its parent.

`chatml_bytes` is a checkpoint-style folder made here, for runs that must not download anything
(the debug fine-tuning config, tests): every UTF-8 byte is one token (a byte-level BPE with no
merges, so it loads as a fast tokenizer in transformers), then <|endoftext|>, <|im_start|> and
<|im_end|> as special tokens, and a ChatML template written for it. It is written into a temporary
folder of the process on first use; the files are a few KB and always the same.
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

CHATML_BYTES = "chatml_bytes"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML as Qwen-style chat models write it: each turn between <|im_start|>role and <|im_end|>.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_symbols() -> list[str]:
    """The printable character each byte value stands for in a byte-level BPE vocabulary: printable
    Latin-1 bytes stand for themselves, the others for code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, int] = {b: b for b in printable}
    extra = 256
    for b in range(256):
        if b not in symbols:
            symbols[b] = extra
            extra += 1
    return [chr(symbols[b]) for b in range(256)]


def write_chatml_bytes(folder: Path) -> Path:
    """Write the built-in tokenizer folder (tokenizer.json, tokenizer_config.json) into `folder`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return write_chat_folder(tokenizer, folder)


def write_chat_folder(tokenizer: Any, folder: Path) -> Path:
    """Save a `tokenizers.Tokenizer` that holds SPECIAL_TOKENS as a checkpoint-style folder: its
    tokenizer.json, and the ChatML template and special-token roles that the trainer and
    transformers' AutoTokenizer read (tokenizer_config.json, generation_config.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "bos_token": None,
        "eos_token": "<|im_end|>",  # what ends a generated answer, as chat checkpoints set it
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    # What ends generation in transformers: the end of a turn, and the end of text.
    generation = {
        "eos_token_id": [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return folder


@cache
def _chatml_bytes_folder() -> Path:
    return write_chatml_bytes(Path(tempfile.mkdtemp(prefix="titan_tpu_chatml_bytes_")))


def tokenizer_folder(spec: str) -> Path:
    """The folder of `data.tokenizer`: the built-in folder for `chatml_bytes`, else the path itself
    when it is a folder, else the folder holding the tokenizer.json it names."""
    if spec == CHATML_BYTES:
        return _chatml_bytes_folder()
    path = Path(spec).expanduser()
    return path if path.is_dir() else path.parent


# The files of a checkpoint's folder that make its tokenizer and chat template; an export copies
# those present, so that the fine-tuned folder chats like the one it was fine-tuned from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_export_files(spec: str, chat_template: str = "") -> dict[str, Path]:
    """File name in an exported folder -> the file to copy there, for `data.tokenizer = spec` (none
    for the built-in byte tokenizer, which has no files). `data.chat_template`, when set, goes in as
    chat_template.jinja, which transformers reads before tokenizer_config.json's template."""
    if spec == "byte":
        return {}
    folder = tokenizer_folder(spec)
    files = {name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()}
    if chat_template:
        files["chat_template.jinja"] = Path(chat_template).expanduser()
    return files
