"""A checkpoint saved under one layout loads under another with the whole training state intact, and
training goes on as if the layout had never changed; async saves by several processes hold the state
of the step they were taken at; Hugging Face weights load into TP and EP models, each rank reading
only its own block.

Two chains, each against an uninterrupted one-process run of 11 steps (constant lr after 2 warmup
steps, so a run stopped at step 5 is the first 5 steps of the 11-step one):
    llama3:     1 process -(step 2)-> FSDP 4 -(step 5)-> TP 2 x FSDP 2 -(step 8)-> 1 process (to 11)
    qwen3_moe:  1 process -(step 2)-> EP 2 x FSDP 2 -(step 5)-> TP 2 x EP 2 -(step 8)-> 1 process
At each link the loaded state (parameters, both AdamW moments and step counts, gathered to full
tensors) must equal the saving run's state bit for bit: resharding copies, it does not compute. Each
segment's 3 steps (loss, gradient norm) and end state must match the uninterrupted run (parity.compare,
tolerances in parity.py). The 4-process links run in one launch (checkpoint_layouts_worker.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.support.one_thread import one_intra_op_thread
from titan_tpu.checkpoint.hf_import import hf_tensor_index
from titan_tpu.models.qwen3.args import QWEN3_MOE_FLAVORS
from titan_tpu.models.qwen3.state_dict_adapter import QWEN3_STATE_DICT_ADAPTER

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("checkpoint_layouts_worker.py")

from tests.distributed.checkpoint_layouts_worker import ASYNC_STEPS, CHAINS, LINKS, STEPS, resume, trainer_for  # noqa: E402
from tests.parity.models.test_hf_roundtrip import ARGS as LLAMA_ARGS  # noqa: E402
from tests.parity.models.test_hf_roundtrip import assert_logits_match, random_hf_model  # noqa: E402
from tests.support.launch import torchrun  # noqa: E402
from tests.support.parity import (  # noqa: E402
    EXACT,
    RunResult,
    assert_checkpoint_chain,
    assert_parity,
    capture_states,
    compare_states,
    train_and_capture,
)

MOE_ARGS = QWEN3_MOE_FLAVORS["debug_moe"]
HF_SHAPES = {"llama": LLAMA_ARGS, "moe": MOE_ARGS}


def uninterrupted(work: Path, tag: str) -> tuple[RunResult, dict[int, dict[str, torch.Tensor]]]:
    """One process, all 11 steps; saves step 2 for the chain and captures the state at each link."""
    config, _ = CHAINS[tag]
    trainer = trainer_for(config, work / f"{tag}_single", STEPS, f"--checkpoint.interval={LINKS[0]}")
    captured = capture_states(trainer, {*LINKS, *ASYNC_STEPS})
    try:
        run = train_and_capture(trainer)
    finally:
        trainer.close()
    return run, captured


def last_segment(work: Path, tag: str) -> tuple[dict[str, torch.Tensor], RunResult]:
    config, links = CHAINS[tag]
    trainer, loaded = resume(config, work / links[-1][0], LINKS[-1], STEPS, work / f"{tag}_back")
    try:
        return loaded, train_and_capture(trainer)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with one_intra_op_thread():
        return _run_chains(tmp_path_factory.mktemp("layouts"))


def _run_chains(work: Path) -> dict[str, Any]:
    start = time.perf_counter()
    out: dict[str, Any] = {"work": work}
    for tag in CHAINS:
        out[f"{tag}_single"], out[f"{tag}_captured"] = uninterrupted(work, tag)
    hf_models = {
        "llama": random_hf_model(),
        "moe": random_hf_model(QWEN3_STATE_DICT_ADAPTER, MOE_ARGS, Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    for tag, hf in hf_models.items():
        hf.save_pretrained(work / f"hf_{tag}")
        tokens = torch.randint(0, HF_SHAPES[tag].vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        torch.save(tokens, work / f"tokens_{tag}.pt")
        with torch.no_grad():
            out[f"hf_{tag}_logits"] = hf(input_ids=tokens).logits
        out[f"tokens_{tag}"] = tokens
    single_s = time.perf_counter() - start

    start = time.perf_counter()
    torchrun(4, WORKER, str(work))
    launch_s = time.perf_counter() - start
    out["result"] = json.loads((work / "result.json").read_text())
    start = time.perf_counter()
    for tag in CHAINS:
        out[f"{tag}_back"] = last_segment(work, tag)
    print(
        f"\nlayouts: one-process runs {single_s + time.perf_counter() - start:.1f} s, 4-process launch "
        f"{launch_s:.1f} s; per part: {out['result']['timings_s']}"
    )
    return out


def segment(work: Path, name: str) -> tuple[dict[str, torch.Tensor], RunResult]:
    saved = torch.load(work / f"{name}.pt", weights_only=True)
    return saved["loaded"], RunResult(**saved["run"])


@pytest.mark.slow
@pytest.mark.parametrize("tag", list(CHAINS))
def test_reshard_chain_keeps_state_and_matches_uninterrupted(runs: dict[str, Any], tag: str) -> None:
    single, captured = runs[f"{tag}_single"], runs[f"{tag}_captured"]
    _, links = CHAINS[tag]
    segments = [(name, *segment(runs["work"], name)) for name, _ in links]
    segments.append(("1 process", *runs[f"{tag}_back"]))
    assert_checkpoint_chain(segments, LINKS, single, captured, f"{tag} ")


@pytest.mark.slow
def test_async_saves_by_four_processes_hold_their_step(runs: dict[str, Any]) -> None:
    """A background write that read parameters after the next optimizer step, or a save committed
    before all 4 ranks wrote, would load a different state."""
    saved = torch.load(runs["work"] / "async_fsdp4.pt", weights_only=True)
    assert sorted(saved["captured"]) == sorted(saved["loaded"]) == list(ASYNC_STEPS)
    for step in ASYNC_STEPS:
        report = compare_states(saved["loaded"][step], saved["captured"][step], EXACT)
        assert report.ok, (step, report.failures[:10])
    run = RunResult(**saved["run"])
    reference = runs["llama_single"].at(ASYNC_STEPS[-1], runs["llama_captured"][ASYNC_STEPS[-1]])
    assert_parity(run, reference, f"async FSDP 4 (saved steps {list(ASYNC_STEPS)} load bitwise) against one process")


def check_logits(runs: dict[str, Any], name: str, tag: str, model_cls: type) -> None:
    work = runs["work"]
    logits = torch.load(work / f"hf_logits_{name}.pt", weights_only=True)
    expected = runs[f"hf_{tag}_logits"]
    reloaded = AutoModelForCausalLM.from_pretrained(work / f"{name}_export", attn_implementation="eager").eval()
    assert type(reloaded) is model_cls
    with torch.no_grad():
        exported = reloaded(input_ids=runs[f"tokens_{tag}"]).logits
    assert_logits_match(name, logits, exported, expected)


def reads_by_name(rank: dict[str, Any]) -> dict[str, tuple[list[int], list[int]]]:
    reads: dict[str, tuple[list[int], list[int]]] = {}
    for name, offsets, lengths in rank["reads"]:
        assert name not in reads, f"{name} read twice"
        reads[name] = (offsets, lengths)
    return reads


@pytest.mark.slow
def test_hf_import_export_under_tensor_parallel(runs: dict[str, Any]) -> None:
    """TP 2 x FSDP 2: each rank reads a quarter of every projection, cut along TP's dimension then
    FSDP's rows (column-wise q_proj: rows / 4; row-wise o_proj: rows / 2 x columns / 2); logits and
    the export gathered from the shards match transformers."""
    in_files = {name: list(shape) for name, (_, shape) in hf_tensor_index(runs["work"] / "hf_llama").items()}
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    for rank in runs["result"]["hf_tp2_fsdp2"]["ranks"]:
        reads = reads_by_name(rank)
        assert set(reads) == set(in_files)
        assert reads[q][1] == [in_files[q][0] // 4, in_files[q][1]], reads[q]
        assert reads[o][1] == [in_files[o][0] // 2, in_files[o][1] // 2], reads[o]
    check_logits(runs, "hf_tp2_fsdp2", "llama", LlamaForCausalLM)


@pytest.mark.slow
def test_hf_import_export_under_expert_parallel(runs: dict[str, Any]) -> None:
    """Each rank reads only the experts its shard holds (ep 2 halves them, FSDP 2 halves that again),
    whole, and of every other tensor only its FSDP rows; logits and export match transformers."""
    in_files = {name: list(shape) for name, (_, shape) in hf_tensor_index(runs["work"] / "hf_moe").items()}
    experts = {name for name in in_files if ".mlp.experts." in name}
    covered: list[int] = []
    for rank in runs["result"]["hf_ep2_fsdp2"]["ranks"]:
        (start, *_), (count, *_) = rank["expert_block"]
        assert count == MOE_ARGS.num_experts // 4, rank["expert_block"]
        covered += range(start, start + count)
        reads = reads_by_name(rank)
        mine = {n for n in experts if start <= int(n.split(".mlp.experts.")[1].split(".")[0]) < start + count}
        assert experts & set(reads) == mine  # its own experts and no other
        assert all(reads[n] == ([0, 0], in_files[n]) for n in mine)  # FSDP cut the range, not the experts
        assert set(reads) - experts == set(in_files) - experts  # every other tensor, in part
        q = "model.layers.0.self_attn.q_proj.weight"
        assert reads[q][1] == [in_files[q][0] // 4, in_files[q][1]], reads[q]
    assert sorted(covered) == list(range(MOE_ARGS.num_experts))
    check_logits(runs, "hf_ep2_fsdp2", "moe", Qwen3MoeForCausalLM)
