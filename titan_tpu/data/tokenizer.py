"""Tokenizers: the built-in byte-level one, and any Hugging Face `tokenizer.json` through `tokenizers`.

`encode` never adds special tokens: the packer adds bos (when the tokenizer has one) before each
document and eos after it, so that every tokenizer separates documents the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.chat_tokenizer import CHATML_BYTES, tokenizer_folder

# Looked up in this order among the tokenizer's tokens. The end-of-*text* tokens come before chat
# end-of-turn tokens on purpose: pre-training separates documents, not conversation turns.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]")
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|end|>", "[EOS]")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int  # the embedding must have at least this many rows
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then <|bos|> = 256 and <|eos|> = 257."""

    vocab_size: int = 258
    bos_id: int | None = 256
    eos_id: int = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids and, per id, the [start, end) of the character it encodes (a character of
        several UTF-8 bytes gives each of its bytes that character's span)."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids += encoded
            offsets += [(i, i + 1)] * len(encoded)
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A `tokenizer.json` (Llama 3, Qwen 3, ...) loaded with the `tokenizers` package."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path = Path(path)
        try:
            self._tok = RustTokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust side raises a plain Exception with a serde message
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"data.tokenizer: {self.path} is not a readable tokenizer.json ({reason})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        self.bos_id = self._find(BOS_CANDIDATES, specials)
        eos_id = self._find(EOS_CANDIDATES, specials)
        if eos_id is None:
            raise ConfigError(
                f"data.tokenizer: {self.path} has no end-of-text token to separate documents "
                f"(looked for {', '.join(EOS_CANDIDATES)})"
            )
        self.eos_id = eos_id

    def _find(self, candidates: Sequence[str], specials: set[str]) -> int | None:
        # Prefer tokens declared special; fall back to plain vocabulary entries (older files).
        for pool in (specials, None):
            for name in candidates:
                if pool is not None and name not in pool:
                    continue
                token_id = self._tok.token_to_id(name)
                if token_id is not None:
                    return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids and, per id, the [start, end) of the characters it covers in `text`."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [(start, end) for start, end in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def build_tokenizer(spec: str) -> Tokenizer:
    """`"byte"`, `"chatml_bytes"` (the built-in chat tokenizer folder, chat_tokenizer.py), or a path
    to a `tokenizer.json` or to the folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == CHATML_BYTES:
        return HFTokenizer(tokenizer_folder(spec) / "tokenizer.json")
    path = Path(spec).expanduser()
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(
                f"data.tokenizer: folder {path} holds no tokenizer.json; "
                f"allowed: 'byte', '{CHATML_BYTES}' or a path to a tokenizer.json or its folder"
            )
        path = file
    elif not path.is_file():
        raise ConfigError(
            f"data.tokenizer: {path} does not exist; "
            f"allowed: 'byte', '{CHATML_BYTES}' or a path to a tokenizer.json or its folder"
        )
    return HFTokenizer(path)
