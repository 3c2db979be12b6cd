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
# Tools are Qwen 3's, in its words (its template minus the thinking), so that one parser
# (tool_calls.py) reads what either writes: the tools offered in the system turn, an assistant's
# calls after its text as <tool_call> blocks, consecutive tool results in one user turn. A
# conversation without tools renders as it did before tools were added, byte for byte.
CHATML_TEMPLATE = r"""{%- macro text(message) %}
    {%- if message.content is string %}
        {{- message.content }}
    {%- elif message.content is defined %}
        {{- raise_exception('chatml_bytes renders string content only') }}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- text(messages[0]) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + text(messages[0]) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text(message) %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


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
