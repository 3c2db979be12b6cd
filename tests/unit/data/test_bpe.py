"""The BPE tokenizer trained on our own text (titan_tpu/data/bpe.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_tpu.data.bpe import SMALLEST_VOCAB, train_bpe
from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.tokenizer import build_tokenizer

TEXTS = ["Ann has 17 apples and buys 5 more.", "Ben has 12 pens and gives 3 away."] * 200


def test_the_folder_is_a_chat_tokenizer_that_splits_digits_and_learned_words(tmp_path: Path) -> None:
    """Catches a tokenizer the trainer cannot use (no end-of-text token, vocabulary over the size
    asked for), numbers merged into opaque tokens (17 as one token), merges that were never learned
    (every word spelled byte by byte), text that does not survive encode/decode, and a folder without
    its ChatML template."""
    folder = train_bpe(TEXTS, tmp_path / "tok", vocab_size=300)
    tokenizer = build_tokenizer(str(folder))
    assert tokenizer.vocab_size <= 300 and tokenizer.eos_id == tokenizer.token_to_id("<|endoftext|>")
    text = "Ann has 17 apples."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "1" in pieces and "7" in pieces and not any(p.strip().isdigit() and len(p.strip()) > 1 for p in pieces)
    assert " apples" in pieces
    rendered = ChatTemplate.from_folder(folder).render([{"role": "user", "content": text}], add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_end|>") == [tokenizer.token_to_id("<|im_end|>")]


def test_a_vocabulary_too_small_for_the_bytes_is_refused(tmp_path: Path) -> None:
    """Catches a tokenizer that cannot encode every byte (some text would have no ids)."""
    with pytest.raises(ValueError, match=f"at least {SMALLEST_VOCAB}"):
        train_bpe(TEXTS, tmp_path / "tok", vocab_size=SMALLEST_VOCAB - 1)
