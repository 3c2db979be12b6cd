"""scripts/recipes/sft_then_grpo.py end to end on tiny settings (a few steps per phase): the data, the
trained BPE tokenizer, pretrain -> SFT -> GRPO through the trainer, an export per phase, held-out
accuracy per phase and the transformers greedy check. How much each phase learns is the full run's
(docs/grpo.md and docs/benchmarks/sft_then_grpo_*.md); this checks that every piece is wired to the next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.recipes.sft_then_grpo import main
from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.tasks.grpo.hf_greedy import greedy_ours, greedy_transformers, load_exported

transformers = pytest.importorskip("transformers")

PHASES = ("pretrain", "sft", "grpo")
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recipe") / "out"
    main(["--out", str(out), "--pretrain-steps=4", "--sft-steps=4", "--grpo-steps=2", "--eval-prompts=16"])
    return out


def _held_out_prompts(run: Path) -> tuple[list[list[int]], list[int], int]:
    """Held-out prompts rendered as our trainer renders them; the stop ids and pad id."""
    folder = run / "data" / "tokenizer"
    tokenizer = build_tokenizer(str(folder))
    template = ChatTemplate.from_folder(folder)
    records = [json.loads(line) for line in (run / "data" / "held_out.jsonl").read_text().splitlines()]
    prompts = [
        tokenizer.encode(template.render([{"role": "user", "content": r["question"]}], add_generation_prompt=True))
        for r in records[:16]
    ]
    stops = [tokenizer.token_to_id("<|im_end|>"), tokenizer.eos_id]
    return prompts, stops, tokenizer.eos_id


def test_result_json_has_each_phase_and_every_export_loads_in_transformers(run: Path) -> None:
    """Catches a result.json of another shape than the issue's, a phase missing or out of order, and an
    exported folder without its tokenizer or template (AutoTokenizer fails, or renders a prompt with
    other ids than the trainer did, so the folder would chat differently from how it was trained)."""
    result = json.loads((run / "result.json").read_text())
    assert set(result) == {"phases", "seconds"} and result["seconds"] > 0
    assert tuple(result["phases"]) == PHASES
    assert all(0.0 <= value <= 1.0 for value in result["phases"].values())
    prompts, _, _ = _held_out_prompts(run)
    question = json.loads((run / "data" / "held_out.jsonl").read_text().splitlines()[0])["question"]
    for phase in PHASES:
        folder = run / f"{phase}_hf"
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(ids) == prompts[0], phase
        assert tokenizer.decode(ids).startswith("<|im_start|>user\n")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert model.config.vocab_size >= len(tokenizer)


def test_greedy_tokens_agree_with_transformers_and_a_perturbed_weight_breaks_the_agreement(run: Path) -> None:
    """Catches an export that renames, transposes or drops a weight, or our model or sampler drifting
    from transformers' (the script refuses to finish when the tokens differ, so the run above passing
    already says they agree); the negative control shows the comparison can fail at all: noise in
    our model's embedding changes its greedy tokens, and the check must see it."""
    prompts, stops, pad = _held_out_prompts(run)
    folder = run / "grpo_hf"
    theirs = greedy_transformers(folder, prompts, MAX_NEW_TOKENS, stops, pad)
    ours, decoding = load_exported(folder, "qwen3", "debug")
    assert greedy_ours(ours, decoding, prompts, MAX_NEW_TOKENS, stops, pad) == theirs
    with torch.no_grad():
        ours.tok_embeddings.weight.add_(
            torch.randn(ours.tok_embeddings.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    assert greedy_ours(ours, decoding, prompts, MAX_NEW_TOKENS, stops, pad) != theirs
