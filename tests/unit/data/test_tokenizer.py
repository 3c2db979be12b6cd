"""Tokenizers: the byte one, and real-format tokenizer.json files (Llama 3, Qwen 3 layouts) built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from titan_tpu.config.errors import ConfigError
from titan_tpu.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

# The split pattern of Llama 3's and Qwen 2/3's tokenizer.json.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def train(model, data):\n    for batch in data:\n        loss = model(batch)\n",
    "Tokenizers split text into pieces; byte-level BPE never meets an unknown character.",
    "Ünïcödé text, 中文字符 and emoji 🚀 must round-trip through every tokenizer.",
] * 5
SAMPLES = [
    "Hello world! The lazy dog sleeps.",
    "def f(x):\n    return x * 2  # ünïcode ✓ 中文 🚀\n",
    "numbers 12345 and   spaces\t\ttabs\n\n",
]


def _byte_level_bpe(specials: list[str], normalize: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalize:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    # Like the real files: special tokens come after the learned vocabulary.
    tok.add_special_tokens(specials)
    return tok


def make_llama3_tokenizer(folder: Path) -> Path:
    tok = _byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], normalize=False)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def make_qwen3_tokenizer(folder: Path) -> Path:
    tok = _byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], normalize=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_byte_tokenizer_round_trip_and_specials() -> None:
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text  # specials decode to nothing
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


@pytest.mark.parametrize("via_folder", [False, True])
def test_llama3_style_tokenizer(tmp_path: Path, via_folder: bool) -> None:
    file = make_llama3_tokenizer(tmp_path / "llama3")
    tok = build_tokenizer(str(file.parent if via_folder else file))
    assert isinstance(tok, HFTokenizer)
    raw = Tokenizer.from_file(str(file))
    assert tok.bos_id == raw.token_to_id("<|begin_of_text|>") is not None
    assert tok.eos_id == raw.token_to_id("<|end_of_text|>") is not None
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.vocab_size > max(tok.bos_id, tok.eos_id)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert tok.bos_id not in ids  # the file's post-processor adds bos; encode must not
        assert len(ids) < len(text.encode("utf-8"))  # merges were learned and are applied
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_qwen3_style_tokenizer_has_no_bos(tmp_path: Path) -> None:
    file = make_qwen3_tokenizer(tmp_path / "qwen3")
    tok = build_tokenizer(str(tmp_path / "qwen3"))
    assert tok.bos_id is None
    assert tok.eos_id == Tokenizer.from_file(str(file)).token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end is not None and tok.eos_id != im_end  # documents end with end-of-text, not a turn end
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("maker", [make_llama3_tokenizer, make_qwen3_tokenizer])
def test_ids_match_transformers(tmp_path: Path, maker) -> None:
    from transformers import PreTrainedTokenizerFast

    file = maker(tmp_path / "tok")
    ours = build_tokenizer(str(file))
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(file))
    for text in SAMPLES:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
        expected_with_specials = ([ours.bos_id] if ours.bos_id is not None else []) + ours.encode(text)
        assert theirs.encode(text, add_special_tokens=True) == expected_with_specials
    assert ours.vocab_size == len(theirs)


def test_missing_tokenizer_paths_fail_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        build_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))
    assert "data.tokenizer" in str(missing.value) and "'byte'" in str(missing.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no tokenizer.json") as empty:
        build_tokenizer(str(tmp_path / "empty"))
    for err in (missing, empty):
        assert "\n" not in str(err.value)


def test_unreadable_and_eos_less_tokenizers_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"not a readable tokenizer.json") as err:
        build_tokenizer(str(bad))
    assert "\n" not in str(err.value)

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"no end-of-text token"):
        build_tokenizer(str(tmp_path))
    # A plain vocabulary entry named like an eos token is accepted (older files do not flag it).
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["vocab"]["</s>"] = 3
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert build_tokenizer(str(tmp_path)).eos_id == 3
