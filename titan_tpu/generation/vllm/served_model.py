"""Whether a running server's model is one the trainer's weights fit, checked before the first push:
vLLM's engine core dies on a reload of other shapes (an assertion in its weight loader), which would
take the user's server down with it.

The server names the folder it was started from (`root` in /v1/models). Where the trainer can read
that folder (the same host, or a shared filesystem: the condition for pushing weights there at all),
its config.json is compared on the keys that fix the weights' shapes, and its tokenizer with the
run's. Where it cannot, the one check left is a prompt of the run's last token id, which a server of
a smaller vocabulary refuses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_tpu.generation.vllm.client import ServedModel

# The config keys that fix the weights' shapes (those a family's config has).
SHAPE_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "tie_word_embeddings",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def shape_mismatch(served: dict[str, Any], ours: dict[str, Any]) -> str | None:
    for key in SHAPE_KEYS:
        if key in ours and key in served and served[key] != ours[key]:
            return f"{key} is {served[key]!r} where this run's model has {ours[key]!r}"
    return None


def tokenizer_mismatch(served: Path, ours: Path) -> str | None:
    for name in TOKENIZER_FILES:
        theirs, mine = served / name, ours / name
        if theirs.is_file() and mine.is_file() and _digest(theirs) != _digest(mine):
            return f"its {name} differs from {mine}'s"
    return None


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def served_model_check(
    ours: dict[str, Any], tokenizer_folder: Path | None, accepts_last_token: Callable[[ServedModel], bool]
) -> Callable[[ServedModel], str | None]:
    """The check for `VllmEngine`: `ours` is the run's Hugging Face config, `tokenizer_folder` the run's
    initial folder (None: no tokenizer to compare), `accepts_last_token(model)` sends the probe prompt."""

    def check(model: ServedModel) -> str | None:
        root = Path(model.root)
        config_file = root / "config.json"
        if config_file.is_file():
            mismatch = shape_mismatch(json.loads(config_file.read_text()), ours)
            if mismatch is None and tokenizer_folder is not None:
                mismatch = tokenizer_mismatch(root, tokenizer_folder)
            if mismatch is not None:
                return f"serves {root}, whose {mismatch}; start it from this run's model"
            return None
        if not accepts_last_token(model):
            return (
                f"serves {model.root}, whose vocabulary is smaller than this run's {ours['vocab_size']} tokens; "
                "start it from this run's model"
            )
        return None

    return check
