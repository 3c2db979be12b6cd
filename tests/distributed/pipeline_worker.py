"""Worker for the pipeline-parallel tests: `torchrun --nproc-per-node 4 pipeline_worker.py OUT CASE...`.

CHECKPOINT_CHAIN, the 4-process links of the checkpoint chain 1 -> PP 2 x FSDP 2 -> PP 4 -> 1: PP 2 x
FSDP 2 (Interleaved1F1B, two stages per rank) loads the step-2 checkpoint of the one-process run in
OUT's folder/chain_single (the test made it), trains steps 3-5 and saves 5; PP 4 loads that, trains
6-8 and saves 8. Each keeps the state it loaded (gathered before any step) and its run, in OUT's
folder/chain_<layout>.pt.

Each other case is a layout of LAYOUTS (or the negative control DETACHED_BOUNDARY): a real
`Trainer` on the Llama 3 debug model (4 layers; the parallelism suite's 10 fp32 steps, parallel_worker.layout_run),
whose freshly initialised stages are compared with one process's initialisation, and whose run
(per-step loss and gradient norm, and every stage's final parameters and AdamW state, gathered from
all ranks and keyed by canonical name) is saved to OUT's folder/<case>.pt for the test to compare
with a single process. DETACHED_BOUNDARY is PP 4 with every stage after the first cutting the
gradient of its input activation (the forward value is unchanged), so the earlier stages get zero
gradients. The cases of MOE_LAYOUTS (and their negative control MOE_TOTALS_CUT) do the same on the
Qwen 3 MoE debug model, compared with the one process of MOE_REFERENCE. Rank 0 writes OUT (JSON).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.distributed.checkpoint_layouts_worker import LINKS, trainer_for  # noqa: E402
from tests.distributed.parallel_worker import layout_run, max_diff, single_process_init  # noqa: E402
from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.parity import RunResult, full_state  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed.sharded_init import canonical_name  # noqa: E402

CONFIG = "llama3_debug"
BASE = layout_run(CONFIG, global_batch_size=4)
LAYOUTS: dict[str, list[str]] = {
    # Pure pipeline: one layer per stage, 4 micro-batches of 1 sample.
    "pp4_1f1b": ["--parallelism.pp=4", "--parallelism.dp_shard=1"],
    # Two stages (one layer each) per rank, replicated over dp_replicate (fully_shard on a (2, 1) mesh).
    "pp2_interleaved_replicate2": [
        "--parallelism.pp=2",
        "--parallelism.pp_schedule=Interleaved1F1B",
        "--parallelism.pp_microbatches=2",
        "--parallelism.dp_replicate=2",
        "--parallelism.dp_shard=1",
    ],
    # FSDP inside each stage, with full activation checkpointing.
    "pp2_fsdp2_ac": ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--activation_checkpoint.mode=full"],
    # Tensor parallelism (sequence parallel: each stage gathers its output sequence, and the next
    # shards it again) with per-block torch.compile (aot_eager, as the parallelism suite's TP 2 x FSDP 2).
    "pp2_tp2_gpipe_compiled": [
        "--parallelism.pp=2",
        "--parallelism.tp=2",
        "--parallelism.dp_shard=1",
        "--parallelism.pp_schedule=GPipe",
        "--compile.enable=true",
        "--compile.backend=aot_eager",
    ],
    # Context parallelism inside each stage: stages pass on this cp rank's part of the sequence, whose
    # rotary tables the next stage reads at the rank's true positions.
    "pp2_cp2": ["--parallelism.pp=2", "--parallelism.cp=2", "--parallelism.dp_shard=1"],
    # The zero-bubble schedule (input and weight gradients computed apart) with FSDP inside the stages.
    "pp2_zero_bubble_fsdp2": [
        "--parallelism.pp=2",
        "--parallelism.pp_schedule=InterleavedZeroBubble",
        "--parallelism.pp_microbatches=2",
        "--parallelism.dp_shard=2",
    ],
}
DETACHED_BOUNDARY = "pp4_detached_boundary"
MOE_CONFIG = "qwen3_moe_debug"
MOE_BASE = layout_run(MOE_CONFIG, global_batch_size=4)
# Expert parallelism inside each stage's FSDP group, with full activation checkpointing (the
# recompute runs the dispatch / combine all-to-alls again inside the schedule's backward); the last
# step's checkpoint, saved by stage, is loaded by one process in the test. (Compiled blocks are left
# out: compile alone moved a one-process MoE run by 9.3e-6 in loss and 1.2e-4 in grad norm, a
# token's near-tied experts switching, which leaves the comparison no margin.)
MOE_LAYOUTS: dict[str, list[str]] = {
    "pp2_ep2_fsdp2_ac": [
        "--parallelism.pp=2",
        "--parallelism.dp_shard=2",
        "--parallelism.ep=2",
        "--activation_checkpoint.mode=full",
        "--checkpoint.enable=true",
        "--checkpoint.interval=1000",
        "--checkpoint.keep_latest_k=0",
    ],
    # Two stages per rank under the zero-bubble schedule, which computes input and weight gradients
    # apart and detaches each stage's outputs in place (a stage output that is a view fails there).
    "pp2_ep2_zero_bubble": [
        "--parallelism.pp=2",
        "--parallelism.dp_shard=2",
        "--parallelism.ep=2",
        "--parallelism.pp_schedule=InterleavedZeroBubble",
        "--parallelism.pp_microbatches=2",
    ],
}
# The one process the MoE layouts are compared with: two accumulated micro-batches of 2 samples.
# Data-parallel rank r of 2 takes samples r, r + 2, ..., and the schedule's micro-batch i is sample
# i of each rank's 2, so both runs form the aux loss over the same samples {2i, 2i + 1}.
MOE_REFERENCE = ["--training.local_batch_size=2"]
# Negative control: PP 2 x EP 2 whose second stage cuts the gradient of the router totals it receives
# (the first stage's routers then miss the load-balancing gradient).
MOE_TOTALS_CUT = "pp2_ep2_totals_gradient_cut"
CHECKPOINT_CHAIN = "checkpoint_chain"
# The 4-process links of the chain, in order: (name, layout).
CHAIN_LINKS = [
    # Two stages per rank: the checkpoint is saved and loaded through the stages' StageUnion.
    (
        "pp2_fsdp2",
        [
            "--parallelism.pp=2",
            "--parallelism.dp_shard=2",
            "--parallelism.pp_schedule=Interleaved1F1B",
            "--parallelism.pp_microbatches=2",
        ],
    ),
    ("pp4", ["--parallelism.pp=4", "--parallelism.dp_shard=1"]),
]


def cut_input_gradient(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The same activation forward, no gradient back to the previous stage."""
    hidden = args[0]
    return (hidden.detach() + 0 * hidden, *args[1:])


def cut_totals_gradient(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The same router totals forward, no gradient back to the previous stage."""
    hidden, totals = args
    return hidden, totals.detach() + 0 * totals


def gathered_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every stage's full_state, merged from all ranks (each pp rank holds different names)."""
    state = full_state(model, optimizer)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    merged: dict[str, torch.Tensor] = {}
    for rank_state in everyone:
        merged.update(rank_state)
    return merged


def run_layout(
    name: str, overrides: list[str], dump: Path, cut: Callable[..., Any] | None = None, moe: bool = False
) -> dict[str, float]:
    """`cut`: a forward pre-hook put on every stage but the first (a negative control)."""
    from titan_tpu.training.trainer import Trainer

    config_name, base = (MOE_CONFIG, MOE_BASE) if moe else (CONFIG, BASE)
    config = load_config(config_name, [*base, *overrides, f"--job.dump_folder={dump / name}"])
    trainer = Trainer(config)
    reference = single_process_init(config)
    init_diff = max(max_diff(p, reference[canonical_name(n)]) for n, p in trainer.model.named_parameters())
    if cut is not None:
        for stage in trainer.pipeline.modules:
            if stage.tok_embeddings is None:
                stage.register_forward_pre_hook(cut)
    run = trained(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{name}.pt")
    return {"init_max_abs_diff": init_diff}


def trained(trainer: Any) -> RunResult:
    """Train to the end; the steps, losses, grad norms and the gathered final state (every stage's)."""
    records = trainer.train()
    return RunResult(
        [r.step for r in records],
        [r.loss for r in records],
        [r.grad_norm for r in records],
        gathered_state(trainer.model, trainer.optimizer),
    )


def checkpoint_chain(work: Path) -> None:
    source = work / "chain_single"
    for (name, layout), step, stop in zip(CHAIN_LINKS, LINKS, LINKS[1:]):
        dump = work / f"chain_{name}"
        if dist.get_rank() == 0:
            (dump / "checkpoint").mkdir(parents=True)
            shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
        dist.barrier()
        trainer = trainer_for(CONFIG, dump, stop, *layout)
        assert trainer.step == step, (trainer.step, step)
        loaded = gathered_state(trainer.model, trainer.optimizer)
        run = trained(trainer)
        if dist.get_rank() == 0:
            torch.save({"loaded": loaded, "run": run.__dict__}, work / f"chain_{name}.pt")
        source = dump


def reference(dump: Path, moe: bool = False) -> RunResult:
    """The single process, same config (for the MoE layouts, with MOE_REFERENCE)."""
    from tests.support.parity import train_and_capture
    from titan_tpu.training.trainer import Trainer

    args = [*MOE_BASE, *MOE_REFERENCE] if moe else BASE
    folder = dump / ("moe_single" if moe else "single")
    trainer = Trainer(load_config(MOE_CONFIG if moe else CONFIG, [*args, f"--job.dump_folder={folder}"]))
    run = train_and_capture(trainer)
    trainer.close()
    return run


def loaded_by_one_process(saved_by: Path, step: int, dump: Path) -> dict[str, torch.Tensor]:
    """The state one process loads from `saved_by`'s step-`step` checkpoint (a MoE layout's run),
    gathered before any step."""
    from titan_tpu.training.trainer import Trainer

    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(saved_by / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    args = [*MOE_BASE, *MOE_REFERENCE, "--checkpoint.enable=true", f"--job.dump_folder={dump}"]
    trainer = Trainer(load_config(MOE_CONFIG, args))
    assert trainer.step == step, (trainer.step, step)
    state = full_state(trainer.model, trainer.optimizer)
    trainer.close()
    return state


def case(name: str, dump: Path) -> tuple[str, Any]:
    if name == CHECKPOINT_CHAIN:
        return name, lambda: checkpoint_chain(dump)
    if name == DETACHED_BOUNDARY:
        return name, lambda: run_layout(name, LAYOUTS["pp4_1f1b"], dump, cut=cut_input_gradient)
    if name == MOE_TOTALS_CUT:
        layout = MOE_LAYOUTS["pp2_ep2_fsdp2_ac"][:3]  # without activation checkpointing and the checkpoint
        return name, lambda: run_layout(name, layout, dump, cut=cut_totals_gradient, moe=True)
    if name in MOE_LAYOUTS:
        return name, lambda: run_layout(name, MOE_LAYOUTS[name], dump, moe=True)
    return name, lambda: run_layout(name, LAYOUTS[name], dump)


def main(out: Path, names: list[str]) -> None:
    run_cases(out, [case(name, out.parent) for name in names])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
