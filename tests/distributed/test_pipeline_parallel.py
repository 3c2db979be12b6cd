"""Pipeline parallelism (`parallelism.pp`) on 4 CPU processes (gloo), against 1 process.

One torchrun launch of pipeline_worker.py trains the Llama 3 debug model (4 layers) 10 fp32 steps
(warmup 2) through the real Trainer in each layout: PP 4 with 1F1B (one layer per stage), PP 2
Interleaved1F1B (two stages per rank) x replicate 2, PP 2 x FSDP 2 with full activation
checkpointing (1F1B), PP 2 x TP 2 with sequence parallelism and compiled blocks (GPipe), PP 2 x CP 2
(1F1B), PP 2 x FSDP 2 with InterleavedZeroBubble (two stages per rank), and the negative control. The same launch
trains the Qwen 3 MoE debug model under PP 2 x EP 2 (experts over ep inside each stage's FSDP 2),
with 1F1B and full activation checkpointing, and with InterleavedZeroBubble (two stages per rank),
with its own negative control.
- parity: every step's loss and gradient norm and the final parameters and AdamW moments of every
  stage, gathered from all ranks, match the single process within the layout suite's tolerances
  (parity.py). Catches a loss normalised per micro-batch rather than over the batch (or scaled
  twice by the schedule), a logged loss not taken from the last stage (or counted once per stage),
  a gradient norm over one stage's gradients only, stages that hold the wrong layers or lose the
  embedding or head, under TP a stage handed a sequence-sharded activation its rotary tables
  do not fit, and under CP a schedule fed whole rows instead of the cp rank's part, or a logged
  loss summed without the other cp ranks;
- identical init: every stage's parameters equal one process's initialisation bit for bit (the
  layout-invariant init keys each parameter by its unchanged name);
- the check bites: PP 4 with every stage boundary passing the activation forward but no gradient
  back (the earlier stages then never learn) fails the same comparison;
- PP 2 x EP 2 (both schedules) matches one process that accumulates the same two micro-batches (each micro-batch's
  load-balancing loss over the data-parallel ranks' router statistics, as without pp). Catches a
  stage that forms the aux loss from its own layers only, router totals not passed on (or passed
  without their gradient: the negative control cuts it at the stage boundary, and the first stage's
  routers then miss the aux gradient), expert gradients misscaled by ep inside a stage, and a loss
  reduced over the wrong ranks under the ep-split mesh; its last checkpoint, saved by stage, loads
  into one process bit for bit (experts laid out over ep saved under one process's names);
 -(step 2)-> PP 2 x FSDP 2 -(step 5)-> PP 4 -(step 8)-> 1 process (to
  11), as test_checkpoint_reshard.py's chains: at each link the loaded state (parameters, both AdamW
  moments, step counts, gathered from every stage) equals the saving run's bit for bit, and each
  segment's 3 steps and end state match the uninterrupted one-process run. Catches stage parameters
  or optimizer state saved or loaded under other names than one process's (a stage prefix, a
  renumbered layer), and a stage that loads another stage's layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent

from tests.distributed import pipeline_worker as worker  # noqa: E402
from tests.distributed.checkpoint_layouts_worker import LINKS, resume, trainer_for  # noqa: E402
from tests.distributed.parallel_worker import STEPS  # noqa: E402
from tests.support.launch import torchrun  # noqa: E402
from tests.support.one_thread import one_intra_op_thread  # noqa: E402
from tests.support.parity import (  # noqa: E402
    EXACT,
    RunResult,
    assert_checkpoint_chain,
    assert_matches_single_process,
    capture_states,
    compare,
    compare_states,
    train_and_capture,
)

pytestmark = pytest.mark.slow
CASES = [*worker.LAYOUTS, worker.DETACHED_BOUNDARY, *worker.MOE_LAYOUTS, worker.MOE_TOTALS_CUT]
CHAIN_STEPS = 11


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("pipeline_parallel")
    data: dict[str, Any] = {}
    with one_intra_op_thread():
        # The chain's uninterrupted run first: its step-2 checkpoint starts the 4-process links.
        trainer = trainer_for(worker.CONFIG, folder / "chain_single", CHAIN_STEPS, f"--checkpoint.interval={LINKS[0]}")
        data["chain_captured"] = capture_states(trainer, set(LINKS))
        data["chain_single"] = train_and_capture(trainer)
        trainer.close()
    out = folder / "results.json"
    torchrun(4, HERE / "pipeline_worker.py", str(out), *CASES, worker.CHECKPOINT_CHAIN, timeout=900)
    data.update(json.loads(out.read_text()))
    print(f"\n4-process launch, per part: {data['timings_s']}")
    for name in CASES:
        data[name]["run"] = RunResult.load(folder / f"{name}.pt")
    with one_intra_op_thread():
        data["single"] = worker.reference(folder)
        data["moe_single"] = worker.reference(folder, moe=True)
        data["moe_loaded"] = worker.loaded_by_one_process(folder / "pp2_ep2_fsdp2_ac", STEPS, folder / "moe_loaded")
        saved_by = folder / f"chain_{worker.CHAIN_LINKS[-1][0]}"
        trainer, loaded = resume(worker.CONFIG, saved_by, LINKS[-1], CHAIN_STEPS, folder / "chain_back")
        data["chain_back"] = (loaded, train_and_capture(trainer))
        trainer.close()
    data["folder"] = folder
    return data


@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
def test_parity_with_single_process(results: dict[str, Any], layout: str) -> None:
    assert_matches_single_process(results[layout]["run"], results["single"], STEPS, layout)


@pytest.mark.parametrize("layout", CASES)
def test_init_is_identical_to_single_process(results: dict[str, Any], layout: str) -> None:
    assert results[layout]["init_max_abs_diff"] == 0.0


def test_parity_check_fails_for_a_boundary_without_gradient(results: dict[str, Any]) -> None:
    """The earlier stages' gradients are zero: the gradient norm differs from the first step on."""
    report = compare(results[worker.DETACHED_BOUNDARY]["run"], results["single"])
    print(f"\n{worker.DETACHED_BOUNDARY}: {report.summary()}; e.g. {report.failures[:2]}")
    assert not report.ok


@pytest.mark.parametrize("layout", list(worker.MOE_LAYOUTS))
def test_moe_parity_with_single_process(results: dict[str, Any], layout: str) -> None:
    assert_matches_single_process(results[layout]["run"], results["moe_single"], STEPS, layout)


def test_moe_parity_check_fails_for_router_totals_without_gradient(results: dict[str, Any]) -> None:
    """The first stage's routers miss the aux gradient: their gradients, the gradient norm and
    every later loss differ."""
    report = compare(results[worker.MOE_TOTALS_CUT]["run"], results["moe_single"])
    print(f"\n{worker.MOE_TOTALS_CUT}: {report.summary()}; e.g. {report.failures[:2]}")
    assert not report.ok


def test_moe_checkpoint_saved_by_stage_loads_into_one_process(results: dict[str, Any]) -> None:
    report = compare_states(results["moe_loaded"], results["pp2_ep2_fsdp2_ac"]["run"].state, EXACT)
    assert report.ok, report.failures[:10]


def test_checkpoint_chain_through_pipeline_layouts(results: dict[str, Any]) -> None:
    single, captured, folder = results["chain_single"], results["chain_captured"], results["folder"]
    segments = []
    for name, _ in worker.CHAIN_LINKS:
        saved = torch.load(folder / f"chain_{name}.pt", weights_only=True)
        segments.append((name, saved["loaded"], RunResult(**saved["run"])))
    segments.append(("1 process", *results["chain_back"]))
    assert_checkpoint_chain(segments, LINKS, single, captured, "")
