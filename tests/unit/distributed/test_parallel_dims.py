"""ParallelDims: resolution of dp_shard = -1, validation messages, and the named meshes (built on a
fake process group, so one process can stand in for 16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import ParallelismConfig
from titan_tpu.distributed.fsdp import FSDPPolicy
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims


def dims(world: int, **kwargs: int) -> ParallelDims:
    return ParallelDims.from_config(ParallelismConfig(**kwargs), world)


def test_dp_shard_minus_one_takes_the_rest() -> None:
    d = dims(16, dp_replicate=2, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp) == (2, 4, 2)
    assert d.dp == 8 and d.fsdp_enabled and d.hsdp_enabled and d.tp_enabled


def test_single_process_has_nothing_enabled() -> None:
    d = dims(1)
    assert d.dp_shard == 1 and not d.fsdp_enabled and not d.tp_enabled and not d.is_distributed
    assert ParallelContext(d).dp_coordinates() == (0, 1)


def test_product_mismatch_writes_the_arithmetic() -> None:
    with pytest.raises(ConfigError) as info:
        dims(8, dp_replicate=2, dp_shard=3, tp=2)
    assert "dp_replicate 2 x dp_shard 3 x tp 2 = 12, but 8 processes were started" in str(info.value)


def test_rest_that_does_not_divide() -> None:
    with pytest.raises(ConfigError, match=r"dp_replicate 1 x tp 3 = 3 does not divide the 8 processes"):
        dims(8, tp=3)


def test_ep_must_divide_dp_shard() -> None:
    with pytest.raises(ConfigError, match=r"ep 3 must divide dp_shard 4"):
        dims(8, dp_shard=4, tp=2, ep=3)


def test_replication_only_is_still_fsdp_wrapped() -> None:
    d = dims(4, dp_replicate=4, dp_shard=1)
    assert d.fsdp_enabled and not d.hsdp_enabled


def test_fsdp_policy_from_config() -> None:
    cfg = ParallelismConfig(fsdp_reduce_dtype="bfloat16", fsdp_reshard_after_forward="default", fsdp_cpu_offload=True)
    bf16 = FSDPPolicy.from_config(cfg, torch.bfloat16, "cuda", sharded=True)
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.cpu_offload, bf16.pin_memory) == (
        torch.bfloat16,
        torch.bfloat16,
        True,
        True,
    )
    kwargs = bf16.shard_kwargs(is_last_block=False)
    last = bf16.shard_kwargs(is_last_block=True)
    assert kwargs["reshard_after_forward"] and not last["reshard_after_forward"]
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16
    assert type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"
    # float32 compute keeps float32 reductions; nothing is offloaded without FSDP.
    fp32 = FSDPPolicy.from_config(cfg, torch.float32, "cpu", sharded=False)
    assert (fp32.param_dtype, fp32.reduce_dtype, fp32.cpu_offload) == (torch.float32, torch.float32, False)
    assert ParallelContext(dims(1)).fsdp == FSDPPolicy()
    with pytest.raises(ConfigError, match=r"got 'sometimes', expected default, always or never"):
        FSDPPolicy(reshard="sometimes")


def test_meshes_row_major(fake_world: int) -> None:
    d = dims(16, dp_replicate=2, tp=2)
    meshes = d.build_meshes("cpu")
    assert meshes["world"].mesh.tolist() == np.arange(16).reshape(2, 4, 2).tolist()
    assert meshes["tp"].mesh.tolist() == [4, 5]
    assert meshes["dp_shard"].mesh.tolist() == [1, 3, 5, 7]
    assert meshes["dp"].mesh.tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    assert meshes["fsdp"].mesh.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]]
    ctx = ParallelContext(d, meshes)
    # Rank 5 is (replica 0, shard 2, tp 1): data rank 2 of 8, same as its tp partner rank 4.
    assert ctx.dp_coordinates() == (2, 8)


def test_meshes_follow_a_custom_rank_layout(fake_world: int) -> None:
    layout = np.random.RandomState(0).permutation(16).reshape(1, 4, 4)
    meshes = dims(16, tp=4).build_meshes("cpu", layout)
    row = [r for r in layout.reshape(4, 4).tolist() if fake_world in r][0]
    assert meshes["tp"].mesh.tolist() == row
    assert meshes["fsdp"].mesh_dim_names == ("dp_shard",)


def test_meshes_with_expert_parallel(fake_world: int) -> None:
    d = dims(16, dp_replicate=2, dp_shard=4, tp=2, ep=2)
    meshes = d.build_meshes("cpu")
    assert meshes["world"].mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    assert meshes["ep"].size() == 2 and meshes["dp_shard"].size() == 4 and meshes["dp"].size() == 8
    assert meshes["fsdp"].mesh.shape == (2, 4)


def test_wrong_layout_shape(fake_world: int) -> None:
    with pytest.raises(ConfigError, match=r"rank layout has shape \(4, 4\)"):
        dims(16, tp=4).build_meshes("cpu", np.arange(16).reshape(4, 4))
