"""The dry run (titan_tpu/dryrun) against the planner, and the layouts it accepts or rejects.

Each case sets a config up at a simulated world size in this process and steps it on fake tensors
(seconds each). The bugs they catch: a planner whose state or FSDP bytes drift from what torch
allocates and sends (padding, early stop), a dry run that records no collectives or the wrong
axis, an expert placement torch refuses, and checkpoint keys that differ between layouts (which
resharding a checkpoint relies on).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.dryrun.__main__ import main as dry_run_main
from titan_tpu.dryrun.report import RankReport, load_report
from titan_tpu.dryrun.run import LayoutRejected, dry_run_rank
from titan_tpu.plan.census import ParamShare
from titan_tpu.plan.chips import parse_chips
from titan_tpu.plan.memory import state_bytes
from titan_tpu.plan.planner import make_plan, plan_memory
from titan_tpu.plan.roofline import fsdp_traffic, tp_collectives
from train import main as train_main


def _run(name: str, world: int, *overrides: str, rank: int = 0) -> RankReport:
    return dry_run_rank(load_config(name, list(overrides)), name, world, rank)


def _sent(report: RankReport, kind: str, axis: str) -> tuple[int, int]:
    rows = [r for r in report.collectives if r.kind == kind and r.axis == axis]
    return sum(r.count for r in rows), sum(r.bytes for r in rows)


def _planned_fsdp(name: str, world: int, chips: str, *overrides: str) -> tuple[int, int, int, int]:
    """(all-gathers, their bytes, reduce-scatters, their bytes) of one micro-batch, as planned."""
    plan = make_plan(load_config(name, list(overrides)), parse_chips(chips))
    assert plan.cluster.devices == world
    traffic = fsdp_traffic(plan.detail.local, plan.shape, plan.detail.layout.precision).values()
    accum = plan.shape.grad_accum
    return (
        sum(u.gathers for u in traffic) // accum,
        sum(u.gathered_bytes for u in traffic) // accum,
        sum(u.reductions for u in traffic) // accum,
        sum(u.reduced_bytes for u in traffic) // accum,
    )


def test_llama3_70b_as_shipped_at_64_ranks_matches_the_planner_to_the_byte() -> None:
    """The shipped layout (FSDP over 64, state offloaded to the host) sets up and steps; its state
    and FSDP traffic are the planner's."""
    report = _run("llama3_70b", 64)
    assert report.state_where == "host" and report.fsdp_units == 81 and report.empty_shards == 0
    planned = plan_memory(load_config("llama3_70b", []), 64)
    parameters, gradients, optimizer = state_bytes(planned.local)
    assert (report.parameter_bytes, report.gradient_bytes, report.optimizer_bytes) == (parameters, gradients, optimizer)
    gathers, gathered, reductions, reduced = _planned_fsdp("llama3_70b", 64, "v6e-64")
    assert _sent(report, "all_gather", "dp_shard") == (gathers, gathered)
    assert _sent(report, "reduce_scatter", "dp_shard") == (reductions, reduced)
    assert len(report.model_state) == 723 and len(report.optimizer_state) == 3 * 723
    # Device memory: the planner's activations and gathered buffers against the step's live fake
    # tensors less the gradients (FSDP moves them to the host). A planner without its buffers (12 of
    # its 27 GiB) or its activations would miss by far more than the tolerance.
    device = report.step_peak_bytes - report.gradient_bytes
    assert abs(planned.memory.total / device - 1) < 0.15


@pytest.mark.parametrize("name", ["llama3_405b", "qwen3_moe_235b_a22b"])
def test_the_large_configs_as_shipped_at_256_ranks_hold_the_planners_state(name: str) -> None:
    """405B (FSDP 64 x CP 2 x TP 2, offload) and 235B-A22B (EP 8 inside FSDP 256, the routing stood
    in for) set up and step as shipped; rank 0's state bytes are the planner's to the byte."""
    report = _run(name, 256)
    state = state_bytes(plan_memory(load_config(name, []), 256).local)
    assert (report.parameter_bytes, report.gradient_bytes, report.optimizer_bytes) == state
    assert report.collectives and report.empty_shards == 0


def test_padded_shards_are_planned_and_an_unpadded_planner_misses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 24 ranks the debug model's 256-row weights do not split evenly: FSDP2 pads every shard,
    and the gathered bytes are the padded ones. Negative control: a planner that gathers the
    unpadded size (the bug this fixed) is short of what the dry run sends."""
    overrides = ("--training.global_batch_size=24",)
    report = _run("llama3_debug", 24, *overrides)
    assert report.uneven_shards > 0
    _, gathered, _, reduced = _planned_fsdp("llama3_debug", 24, "h100-24", *overrides)
    assert _sent(report, "all_gather", "dp_shard")[1] == gathered
    assert _sent(report, "reduce_scatter", "dp_shard")[1] == reduced
    monkeypatch.setattr(ParamShare, "gathered_numel", property(lambda share: share.tp_numel))
    _, unpadded, _, _ = _planned_fsdp("llama3_debug", 24, "h100-24", *overrides)
    assert unpadded < _sent(report, "all_gather", "dp_shard")[1]


@pytest.mark.parametrize("mode", ["full", "none"])
def test_tensor_parallel_collectives_are_the_planners_with_and_without_recompute(mode: str) -> None:
    """Full checkpointing recomputes each block's forward but its last collective (torch's early
    stop); the planner counts the same."""
    overrides = ("--parallelism.tp=2", f"--activation_checkpoint.mode={mode}", "--training.global_batch_size=2")
    report = _run("llama3_debug", 4, *overrides)
    plan = make_plan(load_config("llama3_debug", list(overrides)), parse_chips("v6e-4"))
    counted = sum(r.count for r in report.collectives if r.axis == "tp" and r.kind in ("all_gather", "reduce_scatter"))
    assert counted == tp_collectives(plan.shape) > 0
    if mode == "full":  # negative control: a planner without the early stop counts one more a block
        without_recompute = tp_collectives(dataclasses.replace(plan.shape, recomputed_blocks=0))
        assert without_recompute + 4 * plan.shape.recomputed_blocks == counted + plan.shape.recomputed_blocks


MOE = ("--parallelism.ep=2", "--model.overrides.moe_hidden_dim=80", "--training.global_batch_size=64")


def test_experts_shard_on_a_dimension_that_splits_evenly() -> None:
    """4 local experts over 32 FSDP shards: neither the expert dimension nor the 80-wide hidden one
    splits evenly, the 256-wide model dimension does; the step runs with the routing stand-in."""
    report = _run("qwen3_moe_debug", 64, *MOE)
    experts = {name: shape for name, shape in report.local_shapes.items() if ".experts.w" in name}
    # w1 / w3 [4, 80, 256] and w2 [4, 256, 80]: the 256-wide dimension split 32 ways.
    assert experts and all(shape in ([4, 80, 8], [4, 8, 80]) for shape in experts.values())
    assert _sent(report, "all_to_all", "ep")[0] > 0
    assert any("routing" in note for note in report.notes)


def test_the_old_expert_placement_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the placement before the fix (the hidden dimension whenever the experts
    do not split) is what torch refuses, and the dry run says so in one line."""
    monkeypatch.setattr(
        "titan_tpu.distributed.expert_parallel.expert_shard_dim",
        lambda shape, shards: 0 if shape[0] % shards == 0 else 1,
    )
    with pytest.raises(LayoutRejected, match="uneven sharding"):
        _run("qwen3_moe_debug", 64, *MOE)


def test_experts_that_split_nowhere_are_refused_by_the_trainer_and_the_planner() -> None:
    overrides = ("--parallelism.ep=2", "--training.global_batch_size=6")  # 3 shards: 4, 256, 256
    with pytest.raises(LayoutRejected, match="no dimension of them splits evenly"):
        _run("qwen3_moe_debug", 6, *overrides)
    with pytest.raises(ConfigError, match="no dimension of them splits evenly"):
        plan_memory(load_config("qwen3_moe_debug", list(overrides)), 6)


LAYOUTS = {
    "fsdp 8": (8, ()),
    "tp 2 x fsdp 4": (8, ("--parallelism.tp=2",)),
    "hsdp 2 x 2 x cp 2": (8, ("--parallelism.dp_replicate=2", "--parallelism.cp=2")),
    "fsdp 64, last rank": (64, ()),
}


def test_checkpoint_keys_and_global_shapes_are_the_same_on_every_layout() -> None:
    """A checkpoint written on one layout loads on another only if its keys and global shapes agree."""
    states = {}
    for name, (world, overrides) in LAYOUTS.items():
        report = _run("llama3_debug", world, "--training.global_batch_size=64", *overrides, rank=world - 1)
        states[name] = (report.model_state, report.optimizer_state)
    # Pipeline stages (set up, not stepped): each rank holds its stages' keys; together, every key.
    overrides = ("--training.global_batch_size=64", "--parallelism.pp=2")
    stages = [_run("llama3_debug", 4, *overrides, rank=rank) for rank in (0, 3)]
    assert all(stage.model_state for stage in stages)
    states["pp 2 x fsdp 2"] = (
        {key: shape for stage in stages for key, shape in stage.model_state.items()},
        {key: shape for stage in stages for key, shape in stage.optimizer_state.items()},
    )
    first = next(iter(states.values()))
    assert first[0] and first[1]
    assert all(state == first for state in states.values())


def test_the_command_line_answers_bad_input_and_rejection_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`train.py --dry-run` is `python -m titan_tpu.dryrun`: exit 2 and one line for bad input, 1 and
    one line for a layout that is rejected, 0 with a JSON per asked rank otherwise."""
    assert dry_run_main(["--config", "llama3_debug"]) == 2
    assert "--config and --world are required" in capsys.readouterr().err
    assert train_main(["--config", "llama3_debug", "--dry-run", "--world", "4", "--rank", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rank: expected ranks from 0 to 3, got 4"
    rejected = ["--config", "qwen3_moe_debug", "--world", "6", "--parallelism.ep=2", "--training.global_batch_size=6"]
    assert dry_run_main([*rejected, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rejected: qwen3_moe_debug at 6 ranks") and "\n" not in err
    assert (
        train_main(["--config", "llama3_debug", "--dry-run", "--world", "4", "--rank", "2", "--out", str(tmp_path)])
        == 0
    )
    assert "rank 2: dp_replicate 1 x dp_shard 4" in capsys.readouterr().out
    assert load_report(tmp_path / "world-4-rank-2.json")["rank"] == 2
