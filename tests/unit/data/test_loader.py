"""Packed, shuffled, dp-sharded batches: layout independence, exact resume (also across world sizes)."""

from __future__ import annotations

import io
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import DataConfig
from titan_tpu.data import build_dataloader, build_tokenizer
from titan_tpu.data.tokenizer import ByteTokenizer

SEQ = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_corpus(folder: Path, docs: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) + f" #{i}" for i in range(docs)]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return texts


def cfg_for(folder: Path, **kw) -> DataConfig:
    return DataConfig(source="files", path=str(folder), **kw)


def make(
    cfg: DataConfig,
    batch: int = 4,
    rank: int = 0,
    world: int = 1,
    seed: int = 0,
    seq: int = SEQ,
    tokenizer=None,
):
    return build_dataloader(cfg, tokenizer or ByteTokenizer(), seq, batch, rank, world, seed)


def rows(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The packed samples (seq + 1 tokens) a batch was cut from."""
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)


def take(iterator, count: int) -> list[torch.Tensor]:
    return [rows(next(iterator)) for _ in range(count)]


def global_samples(cfg: DataConfig, count: int, seed: int = 0, seq: int = SEQ, tokenizer=None) -> torch.Tensor:
    """The first `count` samples of the global sequence (one rank, batches of one)."""
    return torch.cat(take(iter(make(cfg, batch=1, seed=seed, seq=seq, tokenizer=tokenizer)), count))


def as_multiset(samples: torch.Tensor) -> Counter:
    return Counter(tuple(row.tolist()) for row in samples)


def stream_of(texts: list[str], tokenizer) -> list[int]:
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [t for text in texts for t in head + tokenizer.encode(text) + [tokenizer.eos_id]]


def test_batches_are_long_and_labels_are_shifted(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    batch = next(iter(make(cfg_for(tmp_path), batch=3)))
    assert set(batch) == {"input_ids", "labels"}
    for value in batch.values():
        assert value.dtype == torch.long and value.shape == (3, SEQ)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def test_unshuffled_stream_is_documents_with_bos_and_eos(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path)
    tok = ByteTokenizer()
    stream = stream_of(texts, tok)
    count = len(stream) // (SEQ + 1)
    samples = global_samples(cfg_for(tmp_path, shuffle=False), count)
    assert samples.flatten().tolist() == stream[: count * (SEQ + 1)]


def test_shuffle_permutes_within_seeded_blocks(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    plain = global_samples(cfg_for(tmp_path, shuffle=False), 16)
    mixed = global_samples(cfg_for(tmp_path, shuffle_buffer=8), 16)
    for block in (slice(0, 8), slice(8, 16)):
        assert as_multiset(mixed[block]) == as_multiset(plain[block])
    assert not torch.equal(mixed, plain)
    assert torch.equal(mixed, global_samples(cfg_for(tmp_path, shuffle_buffer=8), 16))
    assert not torch.equal(mixed, global_samples(cfg_for(tmp_path, shuffle_buffer=8), 16, seed=1))


def test_rank_r_of_w_gets_every_wth_global_sample(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    cfg = cfg_for(tmp_path, shuffle_buffer=5)
    world, batch, steps = 3, 2, 4
    reference = global_samples(cfg, world * batch * steps)
    for rank in range(world):
        mine = torch.cat(take(iter(make(cfg, batch=batch, rank=rank, world=world)), steps))
        assert torch.equal(mine, reference[rank::world])


@pytest.mark.parametrize(("world", "local_batch"), [(4, 2), (2, 2), (8, 1)])
def test_every_layout_sees_the_same_global_batches(tmp_path: Path, world: int, local_batch: int) -> None:
    write_corpus(tmp_path)
    cfg = cfg_for(tmp_path, shuffle_buffer=5)
    global_batch, steps = 8, 5
    accumulation = global_batch // (world * local_batch)
    single = iter(make(cfg, batch=global_batch))
    ranks = [iter(make(cfg, batch=local_batch, rank=r, world=world)) for r in range(world)]
    for _ in range(steps):
        expected = rows(next(single))
        step = torch.cat([row for it in ranks for row in take(it, accumulation)])
        assert as_multiset(step) == as_multiset(expected)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    cfg = cfg_for(tmp_path, shuffle_buffer=6)
    uninterrupted = take(iter(make(cfg, batch=4)), 9)
    loader = make(cfg, batch=4)
    it = iter(loader)
    assert all(torch.equal(a, b) for a, b in zip(take(it, 4), uninterrupted[:4]))
    state = loader.state_dict()
    json.dumps(state["dataset_state"])  # plain data: fits any checkpoint format
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = make(cfg, batch=4)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    after = take(iter(resumed), 5)
    assert all(torch.equal(a, b) for a, b in zip(after, uninterrupted[4:]))
    # A new iter() over a loader continues, never replays.
    assert torch.equal(take(iter(loader), 1)[0], uninterrupted[4])


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (4, 1), (1, 3), (2, 3)])
def test_resume_with_another_world_size(tmp_path: Path, old_world: int, new_world: int) -> None:
    write_corpus(tmp_path)
    # Blocks of 3 samples, fewer than some world sizes: ranks' last samples fall in different blocks.
    cfg = cfg_for(tmp_path, shuffle_buffer=3)
    batch, before, after = 2, 3, 3
    reference = global_samples(cfg, (old_world * before + new_world * after) * batch)
    old = [make(cfg, batch=batch, rank=r, world=old_world) for r in range(old_world)]
    for loader in old:
        take(iter(loader), before)
    states = [loader.state_dict()["dataset_state"] for loader in old]
    assert all(state == states[0] for state in states)  # layout-independent: any rank's state will do
    consumed = old_world * before * batch
    assert states[0]["samples_consumed"] == consumed
    saved = old[-1].state_dict()
    for rank in range(new_world):
        loader = make(cfg, batch=batch, rank=rank, world=new_world)
        loader.load_state_dict(saved)
        mine = torch.cat(take(iter(loader), after))
        assert torch.equal(mine, reference[consumed + rank :: new_world][: after * batch])


def test_epochs_repeat_the_corpus_reshuffled_and_resume_across_them(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path, docs=12)
    per_epoch = len(stream_of(texts, ByteTokenizer())) // (SEQ + 1)
    cfg = cfg_for(tmp_path, shuffle_buffer=4)
    samples = global_samples(cfg, 3 * per_epoch)
    epochs = [samples[e * per_epoch : (e + 1) * per_epoch] for e in range(3)]
    assert as_multiset(epochs[0]) == as_multiset(epochs[1]) == as_multiset(epochs[2])
    assert not torch.equal(epochs[0], epochs[1])
    loader = make(cfg, batch=1)
    take(iter(loader), per_epoch + 3)
    state = loader.state_dict()
    assert state["dataset_state"]["epoch"] == 1
    resumed = make(cfg, batch=1)
    resumed.load_state_dict(state)
    continued = torch.cat(take(iter(resumed), per_epoch))
    assert torch.equal(continued, samples[per_epoch + 3 : 2 * per_epoch + 3])


def test_resume_with_other_data_settings_fails(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    loader = make(cfg_for(tmp_path))
    take(iter(loader), 2)
    state = loader.state_dict()
    other = make(cfg_for(tmp_path), seq=SEQ * 2)
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"data settings differ .*seq_len 16 -> 32"):
        next(iter(other))


def test_corpus_shorter_than_one_sample_fails(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("short")
    with pytest.raises(ConfigError, match=r"fewer tokens than one sample .* = 17"):
        next(iter(make(cfg_for(tmp_path))))


def test_hf_tokenizer_without_bos_packs_eos_separated_documents(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "data")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    bpe.add_special_tokens(["<|endoftext|>"])
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path))
    assert tok.bos_id is None
    stream = stream_of(texts, tok)
    count = len(stream) // (SEQ + 1)
    samples = global_samples(cfg_for(tmp_path / "data", shuffle=False), count, tokenizer=tok)
    assert samples.flatten().tolist() == stream[: count * (SEQ + 1)]
    assert stream.count(tok.eos_id) == len(texts)


def test_embedded_corpus_is_deterministic_and_leaves_global_rng_alone() -> None:
    cfg = DataConfig()
    tok = ByteTokenizer()
    rng_before = torch.random.get_rng_state()
    first = iter(build_dataloader(cfg, tok, 256, 8, 0, 1, seed=0))
    batches = [next(first) for _ in range(2)]
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    again = iter(build_dataloader(cfg, tok, 256, 8, 0, 1, seed=0))
    for batch in batches:
        assert batch["input_ids"].shape == (8, 256)
        assert torch.equal(batch["input_ids"], next(again)["input_ids"])
        assert int(batch["input_ids"].max()) < tok.vocab_size
    other = next(iter(build_dataloader(cfg, tok, 256, 8, 0, 1, seed=1)))
    assert not torch.equal(other["input_ids"], batches[0]["input_ids"])
    text = "".join(tok.decode(row.tolist()) for row in batches[0]["input_ids"])
    assert "def " in text or "import " in text


def test_bad_rank_arguments_are_rejected(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    with pytest.raises(ValueError, match="dp_rank"):
        make(cfg_for(tmp_path), rank=2, world=2)
