"""Hugging Face weights into an FSDP 2 model: each rank reads only the rows of its own shards, the
logits match transformers', and the export gathered from the shards loads in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("checkpoint_hf_worker.py")

from tests.parity.models.test_hf_roundtrip import ARGS, assert_logits_match, random_hf_model  # noqa: E402
from tests.support.launch import torchrun  # noqa: E402


@pytest.mark.slow
def test_fsdp_reads_only_its_shards_and_round_trips(tmp_path: Path) -> None:
    hf = random_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
    torchrun(2, WORKER, str(tmp_path / "hf"), str(tmp_path / "tokens.pt"), str(tmp_path / "out"), timeout=300)

    reads = json.loads((tmp_path / "out" / "result.json").read_text())["reads"]
    full = {name: list(p.shape) for name, p in hf.state_dict().items()}
    for rank_reads in reads:
        by_name = dict(rank_reads)
        assert set(by_name) == set(full)  # every tensor
        assert len(rank_reads) == len(by_name), sorted(rank_reads)  # and each only once
        wq = "model.layers.0.self_attn.q_proj.weight"
        assert by_name[wq] == [full[wq][0] // 2, full[wq][1]], by_name[wq]  # half the rows: its shard
        assert sum(torch.Size(s).numel() for s in by_name.values()) < 0.6 * sum(
            torch.Size(s).numel() for s in full.values()
        )

    logits = torch.load(tmp_path / "out" / "logits.pt", weights_only=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "export").eval()
    with torch.no_grad():
        reloaded = exported(input_ids=tokens).logits
    assert_logits_match("FSDP 2", logits, reloaded, expected)
