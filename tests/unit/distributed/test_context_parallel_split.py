"""Context parallelism without processes: the chunk split and its inverse, the causal load balance,
the gathered keys' mask, the cp mesh axis (on a fake 16-process group) and the settings refused with
one line. The multi-process parity is tests/distributed/test_context_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titan_tpu.config import load_config
from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import ParallelismConfig
from titan_tpu.distributed.context_parallel import (
    ContextParallelAttention,
    join_ranks,
    rank_positions,
    split_for_rank,
)
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.models.registry import get_model_spec
from titan_tpu.tasks.base import TaskContext


def test_each_rank_holds_chunk_i_and_its_mirror() -> None:
    """Rank i of cp holds chunks i and 2 cp - 1 - i: a wrong chunk order misplaces tokens."""
    assert rank_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert rank_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    with pytest.raises(ValueError, match="divisible by 4"):
        rank_positions(10, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, 2])
def test_join_undoes_split(cp: int, dim: int) -> None:
    """Every token lands on exactly one rank, and joining the parts gives the sequence back: a split
    that drops, repeats or reorders tokens fails."""
    x = torch.randn(2, 24, 24, 3)
    parts = [split_for_rank(x, cp, rank, dim) for rank in range(cp)]
    assert all(part.shape[dim] == 24 // cp for part in parts)
    assert torch.equal(join_ranks(parts, dim), x)
    covered = torch.cat([rank_positions(24, cp, rank) for rank in range(cp)]).sort().values
    assert covered.tolist() == list(range(24))


def causal_work(positions: torch.Tensor) -> int:
    """Query-key pairs under the causal mask: a query at position p attends p + 1 keys."""
    return int((positions + 1).sum())


def test_causal_work_is_the_same_on_every_rank() -> None:
    """The point of the mirrored chunks; the contiguous split (control) is far from balanced."""
    seq_len, cp = 64, 4
    balanced = {causal_work(rank_positions(seq_len, cp, rank)) for rank in range(cp)}
    assert len(balanced) == 1
    contiguous = [causal_work(torch.arange(r * 16, (r + 1) * 16)) for r in range(cp)]
    assert max(contiguous) > 5 * min(contiguous)


def test_mask_is_causal_in_true_positions() -> None:
    """The gathered keys arrive in rank order; reordered into sequence order, rank r's mask must be
    the rows of the whole causal mask at its positions. A mask from the local (or contiguous)
    positions fails."""
    seq_len, cp = 16, 2
    whole = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    keys = torch.cat([rank_positions(seq_len, cp, rank) for rank in range(cp)])
    for rank in range(cp):
        kernel = ContextParallelAttention(lambda q, k, v: q, None, cp, rank)  # type: ignore[arg-type]
        mask = kernel.causal_mask(seq_len, torch.device("cpu"))
        in_order = mask[:, torch.argsort(keys)]
        assert torch.equal(in_order, whole[rank_positions(seq_len, cp, rank)])
        assert kernel.name == "cp2[kernel]"


def dims(world: int, **kwargs: int) -> ParallelDims:
    return ParallelDims.from_config(ParallelismConfig(**kwargs), world)


def test_cp_is_an_axis_of_the_product() -> None:
    d = dims(16, dp_replicate=2, cp=2, tp=2)
    assert (d.dp_shard, d.cp, d.dp, d.fsdp_shards) == (2, 2, 4, 4)
    assert d.mesh_axes() == (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2))
    assert d.describe() == "dp_replicate 2 x dp_shard 2 x cp 2 x tp 2"
    with pytest.raises(ConfigError, match=r"dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 = 4, but 8 processes"):
        dims(8, dp_shard=2, cp=2)
    with pytest.raises(ConfigError, match=r"dp_replicate 1 x cp 3 x tp 1 = 3 does not divide the 8 processes"):
        dims(8, cp=3)
    with pytest.raises(ConfigError, match=r"parallelism.ep: expert parallelism is not supported with parallelism.cp"):
        dims(8, dp_shard=2, ep=2, cp=2, tp=2)


def test_cp_alone_is_fsdp_wrapped() -> None:
    """Two cp ranks of one sample: no data parallelism, but their gradients must still be summed
    (FSDP over dp_shard x cp), and their losses averaged."""
    d = dims(2, cp=2)
    assert d.dp == 1 and d.fsdp_enabled
    assert ParallelContext(d).loss_reduce_ranks == 2
    assert not dims(1).fsdp_enabled and ParallelContext(dims(4, dp_shard=4)).loss_reduce_ranks == 4


def test_meshes_with_context_parallel(fake_world: int) -> None:
    """Rank 5 of (dp_replicate 2, dp_shard 2, cp 2, tp 2) is (0, 1, 0, 1): its cp peer differs in the
    cp coordinate only; data ranks come from (dp_replicate, dp_shard), FSDP shards over dp_shard x cp."""
    d = dims(16, dp_replicate=2, cp=2, tp=2)
    meshes = d.build_meshes("cpu")
    assert meshes["cp"].mesh.tolist() == [5, 7]
    assert meshes["dp"].mesh.tolist() == [1, 5, 9, 13]
    assert meshes["dp_shard_cp"].mesh.tolist() == [1, 3, 5, 7]
    assert meshes["fsdp"].mesh.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]]
    assert meshes["dp_cp"].size() == 8
    ctx = ParallelContext(d, meshes)
    assert ctx.dp_coordinates() == (1, 4)
    assert ctx.loss_reduce_mesh is meshes["dp_cp"] and ctx.loss_reduce_ranks == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--training.seq_len=30"], "training.seq_len 30 is not a multiple of 4"),
        (["--parallelism.ep=2"], "parallelism.ep: expert parallelism is not supported"),
        (["--data.document_mask=true"], "data.document_mask: packed-document masking is not supported"),
        (
            ["--validation.enable=true", "--validation.path=held_out.jsonl"],
            "validation.enable: the held-out evaluation is not supported",
        ),
        (["--parallelism.cp=0"], "parallelism.cp: must be >= 1, got 0"),
    ],
)
def test_unsupported_settings_are_refused_with_one_line(overrides: list[str], message: str) -> None:
    cp = [] if any(o.startswith("--parallelism.cp") for o in overrides) else ["--parallelism.cp=2"]
    with pytest.raises(ConfigError, match=message) as info:
        load_config("llama3_debug", [*cp, *overrides])
    assert "\n" not in str(info.value)


def test_cp_1_leaves_the_config_as_it_was() -> None:
    """Document masking and evaluation are refused only with cp > 1."""
    config = load_config("llama3_debug", ["--data.document_mask=true", "--training.seq_len=30"])
    assert config.parallelism.cp == 1


def cp_task_context(config_name: str, overrides: list[str]) -> TaskContext:
    config = load_config(config_name, overrides)
    return TaskContext(
        config=config,
        spec=get_model_spec(config.model.name),
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
        parallel=ParallelContext(dims(2, cp=2)),
        dp_rank=0,
        dp_world=1,
        local_batch_size=2,
        grad_accum_steps=1,
        dump_folder=Path("."),
        is_writer=True,
    )


def test_families_and_tasks_without_context_parallel_are_refused() -> None:
    """A family whose parallelize does not split attention (Qwen 3 MoE), or a task that does not split
    its rows (SFT), would train every rank on whole rows as if they were chunks: refused, one line."""
    from titan_tpu.tasks.language_model import LanguageModelTask
    from titan_tpu.tasks.sft.task import SftTask

    assert LanguageModelTask(cp_task_context("llama3_debug", [])).context_parallel
    with pytest.raises(ConfigError, match=r"model qwen3_moe has no context-parallel attention"):
        LanguageModelTask(cp_task_context("qwen3_moe_debug", []))
    with pytest.raises(ConfigError, match=r"the SftTask does not split sequences over cp ranks"):
        SftTask(cp_task_context("llama3_debug", ["--training.task=sft"]))


def test_planner_shards_over_cp_and_divides_the_tokens() -> None:
    """The planner's cp 2 layout: parameters sharded over dp_shard x cp (not dp_shard alone), and
    activations at half the tokens plus the gathered keys and values (the measured check is
    tests/distributed/test_context_parallel.py); a family without cp attention is refused."""
    from titan_tpu.plan.planner import plan_memory

    run = ["--training.seq_len=512", "--training.global_batch_size=4", "--training.dtype=float32"]
    one = plan_memory(load_config("llama3_debug", run), 1)
    cp2 = plan_memory(load_config("llama3_debug", [*run, "--parallelism.cp=2"]), 2)
    assert cp2.layout.dims.cp == 2 and cp2.layout.micro_batch == 4
    assert abs(cp2.memory.parameters / one.memory.parameters - 0.5) < 0.01
    assert 0.5 < cp2.activations.peak / one.activations.peak < 0.6
    with pytest.raises(ConfigError, match=r"model qwen3_moe has no context-parallel attention"):
        plan_memory(load_config("qwen3_moe_debug", ["--parallelism.cp=2"]), 2)


def test_roofline_charges_the_kv_gathers() -> None:
    """Llama 3 8B at 32K tokens on v5p-64 with cp 4: each block gathers 2 x kv_dim of the whole
    sequence forward (and again when recomputed) and reduce-scatters as much backward, the ring's
    3/4 of it arriving at ICI speed; cp 1 charges nothing and prints no CP line (its report is
    unchanged). Catches a term left at zero, or counted at the local 1/cp of the sequence."""
    from titan_tpu.plan.chips import parse_chips
    from titan_tpu.plan.planner import make_plan
    from titan_tpu.plan.report import render
    from titan_tpu.plan.roofline import GATHER_SCATTER, assumed_bus_bandwidth

    cluster = parse_chips("v5p-64")
    run = ["--training.seq_len=32768", "--activation_checkpoint.mode=full", "--parallelism.tp=1"]
    plan = make_plan(load_config("llama3_8b", [*run, "--parallelism.cp=4"]), cluster)
    args, layout = plan.detail.census.args, plan.detail.layout
    gathered = layout.micro_batch * 32768 * 2 * args.n_kv_heads * args.attn_head_dim * 2  # bf16
    collectives = 2 * args.n_layers + args.n_layers  # forward + backward, and every block recomputed
    expected = layout.grad_accum * 3 / 4 * gathered * collectives / assumed_bus_bandwidth(cluster, True, GATHER_SCATTER)
    assert plan.step.cp_s == pytest.approx(expected, rel=1e-9)
    assert "+ TP + EP + CP" in render(plan)
    plain = make_plan(load_config("llama3_8b", [*run, "--parallelism.cp=1"]), cluster)
    assert plain.step.cp_s == 0.0 and "CP" not in render(plain)
