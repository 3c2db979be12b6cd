"""Conversations rendered with a checkpoint's own chat template, as transformers renders them.

A chat template is a Jinja program that ships with a checkpoint (the `chat_template` of its
`tokenizer_config.json`, or a `chat_template.jinja` beside it). Fine-tuning must feed the model the
text the template makes, token for token, or the fine-tuned model learns a format nobody prompts it
with. So the template runs as `transformers`' `apply_chat_template` runs it: the same Jinja settings
(blocks trimmed, `loopcontrols`), the same helpers (`raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML), the checkpoint's special tokens as variables, and messages whose
`None` fields are dropped, reasoning given as `thinking` or `reasoning` seen as `reasoning_content`
too, and the tools offered (`tools`: JSON schemas) passed as given: None when none, an empty list as
an empty list (templates test `if tools`, so both render as no tools). An assistant's `tool_calls`
reach the template untouched: their `arguments` may be an object (the template writes it with
`tojson`) or a JSON string (written as it is). It runs sandboxed: a template is code from a download.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan_tpu.config.errors import ConfigError

Message = Mapping[str, Any]
# Names records give an assistant's reasoning; templates read `reasoning_content` (gpt-oss's read
# `thinking`), so each is filled from the first present, as apply_chat_template fills them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# tokenizer_config.json fields a template may read as variables (Llama 3's reads bos_token).
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ConfigError):
    """A conversation the template refuses (its `raise_exception`) or fails to render: bad input,
    so the entry point prints its one line and exits with 2."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the text a tool schema renders.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a template sees as variables, from the checkpoint's tokenizer_config.json."""
    tokens = {name: _token_text(tokenizer_config.get(name)) for name in SPECIAL_TOKEN_FIELDS}
    return {name: text for name, text in tokens.items() if text is not None}


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """The folder's tokenizer_config.json ({} when it has none)."""
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not readable JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _template_from_config(config: Mapping[str, Any], where: Path) -> tuple[str | None, str | None]:
    """`chat_template` as a string, or the "default" and "tool_use" templates of a list of named ones."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template, None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            tool_use = named.get("tool_use")
            return named["default"], tool_use if isinstance(tool_use, str) else None
        raise ConfigError(f"{where}: chat_template lists {sorted(map(str, named))} but no 'default'")
    raise ConfigError(f"{where}: chat_template must be a string or a list of named templates")


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]] | None:
    """`tools` as apply_chat_template hands them to the template: None stays None, a list of schemas
    is a list. transformers also turns Python functions into schemas; records and environments give
    schemas, so anything else is refused here rather than rendered as its repr."""
    if tools is None:
        return None
    if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
        raise ChatTemplateError(f"tools must be a list of JSON-schema objects, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{i}] must be a JSON-schema object, got {type(tool).__name__}")
    return list(tools)


def _compile(source: str, origin: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ConfigError(f"chat template {origin}: line {err.lineno}: {err.message}") from None


class ChatTemplate:
    """One checkpoint's template, compiled once; `render` is `apply_chat_template(..., tokenize=False)`.
    `tool_use`: the template a list of named templates offers for conversations given tools, which
    apply_chat_template picks whenever `tools` is not None (Hermes-style checkpoints ship one)."""

    def __init__(self, source: str, tokens: Mapping[str, str], origin: str, tool_use: str | None = None) -> None:
        self.source = source
        self.tokens = dict(tokens)
        self.origin = origin  # where the template came from, for error messages
        self._template = _compile(source, origin)
        self._tool_use = None if tool_use is None else _compile(tool_use, f"{origin} (tool_use)")

    @classmethod
    def from_folder(cls, folder: str | Path, override: str | Path | None = None) -> ChatTemplate:
        """The template of a checkpoint folder: `override` (data.chat_template) if given, else the
        folder's chat_template.jinja, else its tokenizer_config.json's `chat_template`. The special
        tokens always come from the folder's tokenizer_config.json."""
        folder = Path(folder).expanduser()
        config = read_tokenizer_config(folder)
        tokens = special_tokens(config)
        if override is not None:
            path = Path(override).expanduser()
            if not path.is_file():
                raise ConfigError(f"data.chat_template: {path} does not exist")
            return cls(path.read_text(encoding="utf-8"), tokens, str(path))
        if (folder / TEMPLATE_FILE).is_file():
            return cls((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), tokens, str(folder / TEMPLATE_FILE))
        source, tool_use = _template_from_config(config, folder / TOKENIZER_CONFIG)
        if source is None:
            raise ConfigError(
                f"{folder}: no chat template (neither {TEMPLATE_FILE} nor a chat_template in "
                f"{TOKENIZER_CONFIG}); set data.chat_template = PATH to a Jinja template"
            )
        return cls(source, tokens, str(folder / TOKENIZER_CONFIG), tool_use)

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **switches: Any,
    ) -> str:
        """The conversation as text, with the `tools` it offers (JSON schemas, as apply_chat_template
        takes them). `switches` are the template's own variables (Qwen 3's `enable_thinking`, a
        `date_string`); they override special tokens of the same name."""
        if not messages:
            raise ChatTemplateError("an empty conversation")
        plain = [_with_reasoning_aliases({k: v for k, v in dict(m).items() if v is not None}) for m in messages]
        schemas = _tool_schemas(tools)
        template = self._tool_use if schemas is not None and self._tool_use is not None else self._template
        try:
            return template.render(
                messages=plain,
                tools=schemas,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.tokens, **switches},
            )
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"chat template {self.origin}: {err}") from None
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as err:
            raise ChatTemplateError(f"chat template {self.origin} failed: {type(err).__name__}: {err}") from None
