"""Train a byte-level BPE tokenizer on your own text with the `tokenizers` package and save it as a
chat checkpoint's tokenizer folder (ChatML template, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`),
which the trainer (`data.tokenizer = FOLDER`), the Hugging Face export and transformers'
AutoTokenizer all read.

Digits are split one by one before the byte-level step, as Qwen's tokenizer does, so numbers are
written digit by digit and no merge turns "12" into a token of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from pathlib import Path

from titan_tpu.data.chat_tokenizer import SPECIAL_TOKENS, write_chat_folder

_BYTES = 256
SMALLEST_VOCAB = _BYTES + len(SPECIAL_TOKENS) + 1  # every byte, the special tokens and one merge
ROLES = ("system\n", "user\n", "assistant\n")


def train_bpe(texts: Iterable[str], folder: Path, vocab_size: int) -> Path:
    """Learn `vocab_size - 256 - 3` merges from `texts` and write the tokenizer folder; returns it.
    The vocabulary is every byte, the special tokens and the merges, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < SMALLEST_VOCAB:
        raise ValueError(
            f"vocab_size must be at least {SMALLEST_VOCAB} (every byte, the special tokens, one merge), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The template's role names are learned as words too, so a rendered turn stays short.
    tokenizer.train_from_iterator(chain(texts, ROLES), trainer)
    return write_chat_folder(tokenizer, folder)
