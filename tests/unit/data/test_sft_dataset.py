"""Fine-tuning rows dealt to data-parallel ranks and resumed (titan_tpu/data/sft_dataset.py), on
the generated conversations and the built-in chat tokenizer.

Bugs caught: ranks whose rows are not the single process's rows r, r+W, ... (another global batch
per layout), a resume that replays or skips rows (also with another number of ranks, and across an
epoch), blocks not rebuilt exactly from their first record, an unseeded or unshuffled block order,
a resume with other data settings accepted, a summary that miscounts rows, tokens or targets."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest
import torch

from titan_tpu.config import ConfigError, load_config
from titan_tpu.data.generated_chat import GeneratedChat
from titan_tpu.data.sft_dataset import SftBlockStart, SftDataset, first_epoch_summary
from titan_tpu.data.sft_packing import IGNORE_INDEX
from titan_tpu.data.sft_records import FileRecords
from titan_tpu.tasks.sft.data import ChatEncoding, fingerprint, packing_of

CONFIG = load_config("sft_qwen3_debug", ["--training.seq_len=128", "--data.shuffle_buffer=4"])
ENCODING = ChatEncoding.from_config(CONFIG)
SOURCE = GeneratedChat(seed=0, split="train", count=40)


def _dataset(rank: int = 0, world: int = 1, shuffle: bool = True, config=CONFIG) -> SftDataset:
    packing = packing_of(config, ENCODING, shuffle)
    return SftDataset(SOURCE, ENCODING.encode, packing, rank, world, fingerprint(config, ENCODING))


def _rows(dataset: SftDataset, n: int) -> list[torch.Tensor]:
    return [torch.stack([s["input_ids"], s["labels"], s["document_ids"]]) for s in islice(iter(dataset), n)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_rank_r_of_w_gets_every_wth_row_of_the_single_stream() -> None:
    single = _rows(_dataset(), 24)
    for world in (2, 4):
        for rank in range(world):
            assert _same(_rows(_dataset(rank, world), 24 // world), single[rank::world])


@pytest.mark.parametrize(("old_world", "new_world"), [(1, 1), (4, 1), (1, 2), (2, 4)])
def test_resume_continues_at_the_next_global_row(old_world: int, new_world: int) -> None:
    single = _rows(_dataset(), 60)  # 40 conversations pack into fewer rows: this crosses an epoch
    assert len(single) == 60
    consumed = 7 * old_world
    old = [_dataset(r, old_world) for r in range(old_world)]
    for dataset in old:
        _rows(dataset, consumed // old_world)
    state = old[0].state_dict()
    assert all(d.state_dict() == state for d in old)  # the same on every rank
    for rank in range(new_world):
        resumed = _dataset(rank, new_world)
        resumed.load_state_dict(state)
        assert _same(_rows(resumed, 4), single[consumed + rank :: new_world][:4])


def test_blocks_are_shuffled_by_seed_and_rebuilt_from_their_first_record() -> None:
    plain, shuffled = _rows(_dataset(shuffle=False), 12), _rows(_dataset(), 12)
    assert not _same(plain, shuffled)
    first_block = len(next(_dataset().blocks(SftBlockStart(0, 0, 0, (0, 0)))))
    assert 2 <= first_block < 12
    # The first block's rows, permuted: about shuffle_buffer rows' worth of records packed together.
    assert sorted(map(str, plain[:first_block])) == sorted(map(str, shuffled[:first_block]))
    other_seed = load_config(
        "sft_qwen3_debug", ["--training.seq_len=128", "--data.shuffle_buffer=4", "--training.seed=1"]
    )
    assert not _same(_rows(_dataset(config=other_seed), 12), shuffled)


def test_rows_hold_whole_conversations_with_the_assistant_turns_trained() -> None:
    first = next(iter(_dataset(shuffle=False)))
    documents = first["document_ids"]
    doc0 = first["input_ids"][documents == 0].tolist()
    text = ENCODING.tokenizer.decode(doc0)  # the inputs: the conversation but its last token
    # Best fit puts the longest conversation of the block first; it is one of the block's, whole.
    [messages] = [m for m in map(SOURCE.conversation, range(40)) if ENCODING.template.render(m) == text + "\n"]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    trained = ENCODING.tokenizer.decode(first["labels"][(documents == 0) & (first["labels"] != IGNORE_INDEX)].tolist())
    assert trained == "".join(a + "<|im_end|>" for a in answers)


def test_resume_with_other_data_settings_fails() -> None:
    state = _dataset().state_dict()
    other = load_config("sft_qwen3_debug", ["--training.seq_len=128", "--data.shuffle_buffer=4", "--sft.train_on=all"])
    with pytest.raises(ConfigError, match="train_on 'assistant' -> 'all'"):
        _dataset(config=other).load_state_dict(state)


def test_summary_counts_one_epoch() -> None:
    summary = first_epoch_summary(SOURCE, ENCODING.encode, packing_of(CONFIG, ENCODING, shuffle=False))
    rows = _rows(_dataset(shuffle=False), summary.rows)
    lengths = [s["length"].item() for s in islice(iter(_dataset(shuffle=False)), summary.rows)]
    assert summary.counts.examples == 40 and summary.positions == 128 * summary.rows
    assert summary.tokens == sum(lengths)
    assert summary.targets == sum(int((r[1] != IGNORE_INDEX).sum()) for r in rows)
    assert "40 examples (40 kept" in summary.describe()


def test_a_held_out_path_is_named_by_its_own_key(tmp_path: Path) -> None:
    """The held-out records come from validation.path (or rl.eval_path); a message naming data.path
    sends the user to the wrong key."""
    with pytest.raises(ConfigError, match=r"^validation.path: .*missing.jsonl does not exist"):
        FileRecords(str(tmp_path / "missing.jsonl"), "validation.path")
    (tmp_path / "held.jsonl").write_text('{"messages": []}\n')
    assert FileRecords(str(tmp_path / "held.jsonl"), "validation.path").description.startswith("validation.path '")
