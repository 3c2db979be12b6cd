"""Pipeline parallelism without processes: the layer split rule, stage models cut on meta, the
`pp` mesh axis and the one-line refusals of what is not built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_tpu.config import ConfigError, load_config
from titan_tpu.config.sections import ParallelismConfig
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.pipeline import stage_models
from titan_tpu.distributed.pipeline_plan import plan_pipeline
from titan_tpu.models.registry import get_model_spec


def parallelism(**values: object) -> ParallelismConfig:
    return dataclasses.replace(ParallelismConfig(), **values)


def test_default_split_is_even_with_one_stage_per_rank() -> None:
    """A rule that put the remainder, or the embedding's share, on one stage would move layers."""
    plan = plan_pipeline(parallelism(pp=2), n_layers=8, local_batch_size=4)
    assert plan.stage_layers == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert plan.microbatches == 2
    assert plan.stages_of_rank(0) == [0] and plan.stages_of_rank(1) == [1]


def test_interleaved_runs_two_looped_stages_per_rank() -> None:
    """Rank r holds stages r and r + pp, the placement torch's interleaved schedule expects; a
    contiguous placement (stages 2r, 2r + 1) would deadlock it."""
    plan = plan_pipeline(parallelism(pp=2, pp_schedule="Interleaved1F1B"), n_layers=4, local_batch_size=4)
    assert plan.stage_layers == ((0,), (1,), (2,), (3,))
    assert plan.stages_of_rank(0) == [0, 2] and plan.stages_of_rank(1) == [1, 3]
    assert plan.microbatches == 4


def test_zero_bubble_runs_two_stages_per_rank() -> None:
    plan = plan_pipeline(parallelism(pp=2, pp_schedule="InterleavedZeroBubble"), n_layers=8, local_batch_size=4)
    assert plan.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.stages_of_rank(1) == [1, 3]


def test_layers_per_stage_override() -> None:
    plan = plan_pipeline(parallelism(pp=2, pp_schedule="Interleaved1F1B", pp_layers_per_stage=2), 8, 4)
    assert plan.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7))


@pytest.mark.parametrize(
    ("values", "n_layers", "batch", "says"),
    [
        ({"pp": 3}, 4, 3, "do not split the model's 4 layers evenly"),
        ({"pp": 2, "pp_layers_per_stage": 3}, 4, 4, "does not divide the model's 4 layers"),
        ({"pp": 2, "pp_layers_per_stage": 1}, 4, 4, "runs one stage per pp rank"),
        ({"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_layers_per_stage": 2}, 4, 4, "at least 4"),
        ({"pp": 2, "pp_microbatches": 3}, 4, 4, "does not divide the 4 samples"),
        ({"pp": 4, "pp_microbatches": 2}, 4, 4, "at least one micro-batch per stage"),
        ({"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_microbatches": 5}, 4, 5, "multiple of 2"),
    ],
)
def test_what_does_not_divide_is_refused(values: dict[str, object], n_layers: int, batch: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        plan_pipeline(parallelism(**values), n_layers, batch)


def test_stages_keep_their_names_and_only_their_modules() -> None:
    """Names unchanged (checkpoints by name reshard across pp degrees); the embedding only on the
    first stage, the norm and head only on the last."""
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        whole = spec.model_cls(spec.flavor("debug"))
    plan = plan_pipeline(parallelism(pp=2), n_layers=4, local_batch_size=2)
    names = {n for n, _ in whole.named_parameters()}
    parts = [stage for rank in (0, 1) for _, stage in stage_models(whole, plan, rank, "llama3 debug")]
    first, last = ({n for n, _ in stage.named_parameters()} for stage in parts)
    assert first | last == names and not first & last
    assert "tok_embeddings.weight" in first and {"norm.weight", "output.weight"} <= last
    assert {n.split(".")[1] for n in first if n.startswith("layers.")} == {"0", "1"}
    assert len(whole.layers) == 4  # the copies are cut, not the model they came from


def test_tied_embeddings_are_refused() -> None:
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        tied = spec.model_cls(dataclasses.replace(spec.flavor("debug"), tie_embeddings=True))
    plan = plan_pipeline(parallelism(pp=2), n_layers=4, local_batch_size=2)
    with pytest.raises(ConfigError, match="tied embeddings"):
        stage_models(tied, plan, 0, "llama3 debug")


def test_pp_is_the_outermost_mesh_axis_and_absent_at_1() -> None:
    dims = ParallelDims.from_config(parallelism(pp=2, tp=2), world_size=8)
    assert dims.mesh_axes() == (("pp", "dp_replicate", "dp_shard", "tp"), (2, 1, 2, 2))
    assert dims.describe().startswith("pp 2 x ")
    single = ParallelDims.from_config(parallelism(tp=2), world_size=8)
    assert "pp" not in single.mesh_axes()[0] and "pp" not in single.describe()


def test_meshes_with_pipeline_and_expert_parallelism(fake_world: int) -> None:
    """Rank 5 of (pp 2, dp_shard 4 = dp_shard_mod_ep 2 x ep 2, tp 2) is (0, 1, 0, 1): its experts'
    peers differ in the ep coordinate only, its data-parallel peers are its pp stage's ranks of its tp
    coordinate, and the loss is summed over those of both stages (the pp_dp mesh, which took a
    dp_shard axis the ep-split mesh does not have)."""
    dims = ParallelDims.from_config(parallelism(pp=2, ep=2, tp=2), world_size=16)
    assert dims.mesh_axes() == (("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp"), (2, 1, 2, 2, 2))
    meshes = dims.build_meshes("cpu")
    assert meshes["ep"].mesh.tolist() == [5, 7]
    assert meshes["pp"].mesh.tolist() == [5, 13]
    assert meshes["dp"].mesh.tolist() == [1, 3, 5, 7]
    assert meshes["pp_dp"].mesh.tolist() == [1, 3, 5, 7, 9, 11, 13, 15]


def test_meshes_with_pipeline_and_context_parallelism(fake_world: int) -> None:
    """Rank 5 of (pp 2, dp_shard 2, cp 2, tp 2) is (0, 1, 0, 1): the loss is summed over both
    stages' data-parallel and cp ranks of its tp coordinate (each cp rank's mean covers its part of
    the rows; a pp_dp mesh without cp would count one cp rank's loss and halve the logged mean)."""
    dims = ParallelDims.from_config(parallelism(pp=2, cp=2, tp=2), world_size=16)
    assert dims.mesh_axes() == (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 2, 2, 2))
    meshes = dims.build_meshes("cpu")
    assert meshes["cp"].mesh.tolist() == [5, 7]
    assert meshes["pp"].mesh.tolist() == [5, 13]
    assert meshes["pp_dp"].mesh.tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    assert ParallelContext(dims, meshes).loss_reduce_ranks == 4


def test_world_size_arithmetic_counts_pp() -> None:
    with pytest.raises(ConfigError, match=r"pp 2 x dp_replicate 1 x tp 4 = 8 does not divide the 4"):
        ParallelDims.from_config(parallelism(pp=2, tp=4), world_size=4)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--parallelism.loss_parallel=true", "parallelism.loss_parallel"),
        ("--training.local_batch_size=1", "training.local_batch_size"),
        ("--data.document_mask=true", "data.document_mask"),
        ("--validation.enable=true --validation.path=held_out.jsonl", "validation.enable"),
    ],
)
def test_unbuilt_combinations_are_refused_in_one_line(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: .* not supported with parallelism.pp = 2") as error:
        load_config("llama3_debug", ["--parallelism.pp=2", *override.split()])
    assert "\n" not in str(error.value)
