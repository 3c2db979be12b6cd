"""A checkpoint saved under one layout loads under another and the next step's loss is the same
(within 1e-5 relative: only the order of floating-point sums changes); Hugging Face weights load into
an expert-parallel model, each rank reading only its own experts.

Two chains, one 4-process launch for all of their multi-process links (checkpoint_layouts_worker.py):
    llama3: 1 process, steps 1-2, saves step 2
      -> FSDP 4 loads step 2, trains 3-4, saves 3 and 4     (1 process -> FSDP 4: step 3 vs 1 process)
           -> 1 process loads step 3, trains 4             (FSDP 4 -> 1 process: step 4 vs FSDP 4)
           -> TP 2 x FSDP 2 loads step 3, trains 4         (FSDP 4 -> TP 2 x FSDP 2: step 4 vs FSDP 4)
    qwen3_moe (experts sharded over ep, then FSDP):
      1 process, steps 1-2, saves step 2
      -> EP 2 x FSDP 2 loads step 2, trains 3-4, saves 3 and 4   (step 3 vs 1 process)
           -> 1 process loads step 3, trains 4                  (step 4 vs EP 2 x FSDP 2)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from models.qwen3 import QWEN3_MOE_FLAVORS, QWEN3_STATE_DICT_ADAPTER
from titan_tpu.checkpoint.hf import hf_tensor_index
from titan_tpu.config import load_config
from titan_tpu.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("checkpoint_layouts_worker.py")
sys.path.insert(0, str(ROOT / "tests" / "parity"))
sys.path.insert(0, str(WORKER.parent))

from checkpoint_layouts_worker import ARGS, LLAMA, MOE  # noqa: E402
from launch import torchrun  # noqa: E402
from test_hf_roundtrip import random_hf_model  # noqa: E402

REL = 1e-5
MOE_ARGS = QWEN3_MOE_FLAVORS["debug_moe"]


def one_process(config: str, dump: Path, *extra: str) -> dict[int, float]:
    trainer = Trainer(load_config(config, [*ARGS, f"--job.dump_folder={dump}", *extra]))
    try:
        return {r.step: r.loss for r in trainer.train()}
    finally:
        trainer.close()


def start_from(source: Path, step: int, dump: Path) -> Path:
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


def close(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_checkpoint_resume.py
    try:
        return _run_chains(tmp_path_factory.mktemp("layouts"))
    finally:
        torch.set_num_threads(threads)


def _run_chains(work: Path) -> dict[str, Any]:
    start = time.perf_counter()
    single = one_process(LLAMA, work / "single", "--checkpoint.interval=2")
    moe_single = one_process(MOE, work / "moe_single", "--checkpoint.interval=2")
    start_from(work / "single", 2, work / "fsdp4")
    start_from(work / "moe_single", 2, work / "ep2_fsdp2")
    hf = random_hf_model(QWEN3_STATE_DICT_ADAPTER, MOE_ARGS, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    hf.save_pretrained(work / "hf_moe")
    tokens = torch.randint(0, MOE_ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, work / "tokens.pt")
    with torch.no_grad():
        hf_logits = hf(input_ids=tokens).logits

    torchrun(4, WORKER, str(work))
    result = json.loads((work / "result.json").read_text())
    losses = {k: {int(s): v for s, v in result[k].items()} for k in ("fsdp4", "tp2_fsdp2", "ep2_fsdp2")}

    back = one_process(LLAMA, start_from(work / "fsdp4", 3, work / "back"))
    moe_back = one_process(MOE, start_from(work / "ep2_fsdp2", 3, work / "moe_back"))
    print(f"layouts: {time.perf_counter() - start:.1f} s in all")
    return {
        "single": single,
        "back": back,
        "moe_single": moe_single,
        "moe_back": moe_back,
        **losses,
        "hf": result["hf_ep2_fsdp2"],
        "hf_logits": hf_logits,
        "tokens": tokens,
        "work": work,
    }


@pytest.mark.slow
def test_reshard_between_layouts(runs: dict[str, Any]) -> None:
    single, fsdp4, back, tp = runs["single"], runs["fsdp4"], runs["back"], runs["tp2_fsdp2"]
    assert sorted(fsdp4) == [3, 4] and sorted(back) == [4] and sorted(tp) == [4]
    diffs = {
        "1 process -> FSDP 4": close(fsdp4[3], single[3]),
        "FSDP 4 -> 1 process": close(back[4], fsdp4[4]),
        "FSDP 4 -> TP 2 x FSDP 2": close(tp[4], fsdp4[4]),
    }
    print("relative next-step loss differences:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(v <= REL for v in diffs.values()), diffs


@pytest.mark.slow
def test_reshard_expert_parallel(runs: dict[str, Any]) -> None:
    single, ep, back = runs["moe_single"], runs["ep2_fsdp2"], runs["moe_back"]
    assert sorted(ep) == [3, 4] and sorted(back) == [4]
    diffs = {
        "1 process -> EP 2 x FSDP 2": close(ep[3], single[3]),
        "EP 2 x FSDP 2 -> 1 process": close(back[4], ep[4]),
    }
    print("qwen3_moe relative next-step loss differences:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(v <= REL for v in diffs.values()), diffs


@pytest.mark.slow
def test_hf_import_export_under_expert_parallel(runs: dict[str, Any]) -> None:
    """Each rank reads only the experts its shard holds (ep 2 halves them, FSDP 2 halves that again),
    whole, and of every other tensor only its FSDP rows; logits and export match transformers."""
    in_files = {name: list(shape) for name, (_, shape) in hf_tensor_index(runs["work"] / "hf_moe").items()}
    experts = {name for name in in_files if ".mlp.experts." in name}
    covered: list[int] = []
    for rank in runs["hf"]:
        (start, *_), (count, *_) = rank["expert_block"]
        assert count == MOE_ARGS.num_experts // 4, rank["expert_block"]
        covered += range(start, start + count)
        reads: dict[str, tuple[list[int], list[int]]] = {}
        for name, offsets, lengths in rank["reads"]:
            assert name not in reads, f"{name} read twice"
            reads[name] = (offsets, lengths)
        mine = {n for n in experts if start <= int(n.split(".mlp.experts.")[1].split(".")[0]) < start + count}
        assert experts & set(reads) == mine  # its own experts and no other
        assert all(reads[n] == ([0, 0], in_files[n]) for n in mine)  # FSDP cut the range, not the experts
        assert set(reads) - experts == set(in_files) - experts  # every other tensor, in part
        q = "model.layers.0.self_attn.q_proj.weight"
        assert reads[q][1] == [in_files[q][0] // 4, in_files[q][1]], reads[q]
    assert sorted(covered) == list(range(MOE_ARGS.num_experts))

    logits = torch.load(runs["work"] / "hf_logits.pt", weights_only=True)
    expected = runs["hf_logits"]
    reloaded = AutoModelForCausalLM.from_pretrained(runs["work"] / "hf_export", attn_implementation="eager").eval()
    assert type(reloaded) is Qwen3MoeForCausalLM
    with torch.no_grad():
        exported = reloaded(input_ids=runs["tokens"]).logits
    scale = expected.abs().max().item()
    loaded_diff = (logits - expected).abs().max().item()
    exported_diff = (exported - expected).abs().max().item()
    print(f"EP 2 x FSDP 2: ours vs HF {loaded_diff:.2e}, exported vs HF {exported_diff:.2e} (max |logit| {scale:.2f})")
    assert loaded_diff <= 1e-5 * max(1.0, scale)
    assert exported_diff <= 1e-5 * max(1.0, scale)
