"""The planner's arithmetic: chip names, parameter counts from the models themselves, sharding,
fitting in HBM, and the roofline on a case worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.device.peak import table_peak_flops
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.models.flux.flops import flux_param_count
from titan_tpu.models.llama3.flops import llama3_param_count
from titan_tpu.models.qwen3.flops import qwen3_param_count
from titan_tpu.plan.__main__ import main
from titan_tpu.plan.census import ROOT, Census, ParamShare, census
from titan_tpu.plan.chips import GIB, parse_chips
from titan_tpu.plan.memory import Precision
from titan_tpu.plan.planner import make_plan
from titan_tpu.plan.report import fit_line
from titan_tpu.plan.roofline import COLLECTIVE_EFFICIENCY, StepShape, estimate_step, fsdp_seconds


def test_chip_counts_devices_and_reuses_the_peak_table() -> None:
    v7x = parse_chips("v7x-64")
    assert (v7x.chips, v7x.devices, v7x.slices) == (64, 128, 1)
    assert v7x.hbm_bytes_per_device == 96 * GIB
    assert v7x.peak_flops_per_device == table_peak_flops("TPU v7x") == 2307e12 / 2
    v5p = parse_chips("v5p-64")
    assert (v5p.devices, v5p.peak_flops_per_device) == (64, 459e12)
    assert parse_chips("v6e-512").slices == 2  # two 256-chip pods joined over DCN
    assert parse_chips("h100-16").slices == 2  # two 8-GPU NVLink domains
    with pytest.raises(ConfigError, match="do not split into whole slices of 256"):
        parse_chips("v6e-300")


@pytest.mark.parametrize("name", ["x100-8", "v6e", "v6e-0", "tpu-8"])
def test_bad_chip_names_list_the_valid_ones(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "llama3_debug", "--chips", name]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --chips {name}:") and "\n" not in err
    if name != "v6e-0":
        assert "valid: v4-N, v5e-N, v5p-N, v6e-N, v7x-N, a100-N, h100-N, h200-N, b200-N (N = chips)" in err


@pytest.mark.parametrize(
    ("config", "count"),
    [
        ("llama3_8b", lambda a: llama3_param_count(a)),
        ("llama3_405b", lambda a: llama3_param_count(a)),
        ("qwen3_32b", lambda a: qwen3_param_count(a)),
        ("qwen3_moe_235b_a22b", lambda a: qwen3_param_count(a)),
        ("flux_dev", lambda a: flux_param_count(a)),
    ],
)
def test_parameter_counts_are_the_flavors(config: str, count) -> None:
    model = census(load_config(config, []), ParallelDims(1, 1, 1, 1, 1))
    assert model.total == count(model.args)
    assert model.local == model.total  # one device holds everything


def test_sharding_divides_what_the_plans_split() -> None:
    config = load_config("llama3_8b", [])
    whole = census(config, ParallelDims(1, 1, 1, 1, 1))
    assert census(config, ParallelDims(1, 8, 1, 1, 8)).local == whole.total // 8  # every dim divides
    tp = census(config, ParallelDims(1, 1, 8, 1, 8))
    norms = sum(p.numel for p in whole.params if p.name.endswith("norm.weight"))
    assert tp.local == (whole.total - norms) // 8 + norms  # norms are replicated over tp
    moe = load_config("qwen3_moe_235b_a22b", [])
    experts = [p for p in census(moe, ParallelDims(1, 64, 1, 16, 64)).params if ".experts." in p.name]
    assert all(p.local_numel * 64 == p.numel for p in experts)  # ep 16 x FSDP over the other 4


def test_405b_on_v5e_8_does_not_fit_and_says_by_how_much() -> None:
    no_offload = ["--parallelism.tp=1", "--parallelism.cp=1", "--parallelism.fsdp_cpu_offload=false"]
    plan = make_plan(load_config("llama3_405b", no_offload), parse_chips("v5e-8"))
    assert not plan.fit.fits
    over = (plan.fit.need - plan.fit.usable) / GIB
    assert over > 700  # 405e9 x 16 bytes of state over 8 chips alone is 757 GiB per chip
    assert fit_line(plan).startswith("does not fit:") and f"{over:.2f} GiB over" in fit_line(plan)


@pytest.mark.parametrize("config_name, parameters", [("llama3_8b", 8.03e9), ("qwen3_8b", 8.19e9)])
def test_8b_as_shipped_on_v6e_8_with_fsdp_8_fits(config_name: str, parameters: float) -> None:
    fsdp_8 = ["--parallelism.dp_shard=8", "--parallelism.cp=1", "--parallelism.tp=1"]
    plan = make_plan(load_config(config_name, [*fsdp_8, "--activation_checkpoint.mode=full"]), parse_chips("v6e-8"))
    assert plan.fit.fits and plan.fit.margin > 0
    assert plan.detail.memory.state == pytest.approx(16 * parameters / 8, rel=0.01)
    # Why FSDP 8 needs full checkpointing: selective keeps too much at 8192 tokens.
    selective = [*fsdp_8, "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_option=2"]
    assert not make_plan(load_config(config_name, selective), parse_chips("v6e-8")).fit.fits


def test_roofline_on_a_hand_checked_case() -> None:
    # One FSDP unit (the root: gathered once, not again for backward) of 1e9 elements over 4
    # devices of a v6e-4: each device receives 3/4 of it in bf16 (2 bytes) and reduce-scatters 3/4
    # in float32 (4 bytes): 0.75e9 x 6 = 4.5e9 bytes at 800 GB/s / 2 directions x 1/2 of the links
    # x COLLECTIVE_EFFICIENCY.
    cluster = parse_chips("v6e-4")
    params = (ParamShare("w", 10**9, 10**9 // 4, 10**9, ROOT, 4),)
    model = Census(args=None, params=params, n_blocks=1)
    shape = StepShape(
        devices=4,
        dp_shard=4,
        dp_replicate=1,
        tp=1,
        ep=1,
        micro_batch=1,
        grad_accum=1,
        tokens_per_sample=1,
        dim=1,
        vocab=0,
        loss_parallel=False,
        moe_top_k=0,
        n_blocks=1,
        recomputed_blocks=0,
        reshard="default",
    )
    precision = Precision(compute_bytes=2, reduce_bytes=4)
    bandwidth = 800e9 / 2 * 0.5 * COLLECTIVE_EFFICIENCY
    assert fsdp_seconds(model, shape, precision, cluster) == pytest.approx(4.5e9 / bandwidth)
    # 1e15 useful FLOPs per device at 918 TFLOP/s x 0.5: 2.1786 s of compute, more than the FSDP
    # time, so the step is compute-bound and MFU is the efficiency itself.
    step = estimate_step(model, shape, precision, cluster, 1e15, 0.0, 4, compute_efficiency=0.5)
    assert step.compute_s == pytest.approx(1e15 / (918e12 * 0.5))
    assert step.step_s == step.compute_s and step.mfu == pytest.approx(0.5)
    # Full recomputation of the blocks' forward (a third of 6N) costs its FLOPs but is not useful work.
    full = dataclasses.replace(shape, recomputed_blocks=1)
    recomputed = estimate_step(model, full, precision, cluster, 1e15, 1e15 / 3, 4, compute_efficiency=0.5)
    assert recomputed.mfu == pytest.approx(0.5 * 3 / 4)


def test_the_command_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--config", "llama3_70b", "--chips", "v6e-256", "--parallelism.dp_shard=32", "--parallelism.tp=8"]) == 0
    )
    out = capsys.readouterr().out
    assert "dp_replicate 1 x dp_shard 32 x tp 8" in out and "fits:" in out and "MFU" in out
    assert main(["--config", "llama3_70b", "--chips", "v6e-256", "--parallelism.dp_shard=3", "--parallelism.tp=8"]) == 2
    assert "dp_shard 3 x tp 8 = 24, but 256 processes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mode", "option", "wrapped"), [("full", "2", 8), ("selective", "2", 4), ("selective", "op", 8)]
)
def test_activation_offload_leaves_one_checkpointed_input_on_the_device(mode: str, option: str, wrapped: int) -> None:
    """With offload, every checkpointed block's kept input moves to host memory but the one in flight:
    what is kept into backward falls by (checkpointed blocks - 1) inputs, and the peak by at most
    that (full checkpointing, at the last block's backward: the 7 inputs before it, less the one in
    flight). Catches inputs of unwrapped blocks counted as moved, none moved, and the one in flight
    left out. (Not measured: on a CPU host the host memory is the device's.)"""
    from titan_tpu.config.sections import ActivationCheckpointConfig
    from titan_tpu.plan.activations import Geometry, estimate_activations
    from titan_tpu.protocols.planning import BlockActivations

    block = BlockActivations(full=100.0, selective_op=40.0, checkpointed=10.0, backward=30.0)
    geometry = Geometry(micro_batch=2, tokens_per_sample=1000, act_bytes=2)
    plain = estimate_activations(block, 8, geometry, ActivationCheckpointConfig(mode, option))
    offloaded = estimate_activations(block, 8, geometry, ActivationCheckpointConfig(mode, option, offload=True))
    one_input = 10 * geometry.tokens
    assert plain.kept - offloaded.kept == (wrapped - 1) * one_input
    assert 0 < plain.peak - offloaded.peak <= (wrapped - 1) * one_input
    if mode == "full":
        assert plain.peak - offloaded.peak == 6 * one_input


def test_the_search_ranks_layouts_that_fit_and_prints_overrides_that_reproduce_them() -> None:
    """llama3_8b on v6e-8: every layout found fits, they come best MFU first, the best is at least
    as fast as the shipped layout, and its printed overrides, loaded as train.py loads them, plan to
    the same memory and MFU. Catches a layout kept that does not fit, a wrong order, and an override
    line that is not the layout it was planned from (a lever left out of it)."""
    from titan_tpu.plan.search import search

    cluster = parse_chips("v6e-8")
    shipped = make_plan(load_config("llama3_8b", []), cluster)
    fitting, closest = search(load_config("llama3_8b", []), cluster, shipped.compute_efficiency)
    assert fitting and closest is None
    assert all(candidate.plan.fit.fits for candidate in fitting)
    # Ranked by MFU to four decimals (among equal ones, fewer levers first: search.py `_rank`).
    mfus = [round(candidate.plan.step.mfu, 4) for candidate in fitting]
    assert mfus == sorted(mfus, reverse=True) and mfus[0] >= round(shipped.step.mfu, 4)
    for candidate in fitting[:3]:
        replanned = make_plan(load_config("llama3_8b", list(candidate.overrides)), cluster)
        assert replanned.fit.need == candidate.plan.fit.need
        assert replanned.step.mfu == pytest.approx(candidate.plan.step.mfu, rel=1e-12)


def test_the_search_says_what_is_over_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    # One chip: no FSDP, so FSDP CPU offload cannot take the state off it (on v5e-8 it can).
    assert main(["--config", "llama3_405b", "--chips", "v5e-1", "--search"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no layout fits (llama3 405B on v5e-1); the closest is ")
    assert "--parallelism.tp=" in out and "the largest is optimizer" in out


def test_the_search_tries_pipeline_and_context_parallelism_and_their_overrides_reproduce_them() -> None:
    """llama3_debug on v6e-4: pp 2 (both schedules) and cp 2 layouts are among those found, and
    their printed overrides, loaded as train.py loads them (through the trainer's pp and cp checks),
    plan to the same memory and MFU. Catches a lever the search never tries, or one left out of the
    overrides (pp_schedule, pp_microbatches, cp)."""
    from titan_tpu.plan.search import search

    cluster = parse_chips("v6e-4")
    fitting, _ = search(load_config("llama3_debug", []), cluster, 0.75)
    pipelined = [c for c in fitting if c.plan.config.parallelism.pp == 2]
    context = [c for c in fitting if c.plan.config.parallelism.cp == 2]
    assert {c.plan.config.parallelism.pp_schedule for c in pipelined} == {"1F1B", "Interleaved1F1B"}
    assert context
    for candidate in (pipelined[0], context[0]):
        replanned = make_plan(load_config("llama3_debug", list(candidate.overrides)), cluster)
        assert replanned.fit.need == candidate.plan.fit.need
        assert replanned.step.mfu == pytest.approx(candidate.plan.step.mfu, rel=1e-12)


def test_the_search_offloads_fsdp_state_only_where_nothing_fits_without() -> None:
    """llama3_8b on v5e-4 (16 GB): its float32 state alone (32 GB a chip) fits no layout, so every
    layout found keeps it in host memory; on v6e-8 (32 GiB), where layouts fit without, none
    offloads. Catches an offload lever the search lacks, and offload preferred though it costs time."""
    from titan_tpu.plan.search import search

    small, _ = search(load_config("llama3_8b", []), parse_chips("v5e-4"), 0.75)
    assert small and all(c.plan.config.parallelism.fsdp_cpu_offload for c in small)
    assert "--parallelism.fsdp_cpu_offload=true" in small[0].overrides
    large, _ = search(load_config("llama3_8b", ["--training.global_batch_size=24"]), parse_chips("v6e-8"), 0.75)
    assert not large[0].plan.config.parallelism.fsdp_cpu_offload
