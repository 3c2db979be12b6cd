"""How the processes are split between the parallelism axes, and the named DeviceMesh built from it.

Mesh axes, outermost (least traffic) to innermost (most traffic):

    pp            pipeline stages (only when pp > 1): one activation per micro-batch crosses it, so
                  it is outermost, and on TPU the axis that spans slices over DCN
    dp_replicate  HSDP replicas; on TPU the axis that spans slices over DCN
    dp_shard      FSDP sharding; with ep > 1 it is split into (dp_shard_mod_ep, ep)
    cp            context parallelism (only when cp > 1): ranks holding different chunks of the
                  same samples' sequences (titan_tpu/distributed/context_parallel.py)
    tp            tensor parallelism, innermost so it lands on the fastest links

Flattened views handed out: "dp" = (dp_replicate, dp_shard) for the data loader and the loss mean,
"dp_shard" as one axis even when ep splits it. With cp > 1 also "dp_shard_cp" = (dp_shard, cp), over
which FSDP shards (the cp ranks' gradients are summed like data-parallel ones, as in TorchTitan), and
"dp_cp" = (dp_replicate, dp_shard, cp), over which per-rank mean losses are averaged. With pp > 1
also "pp" and "pp_dp" = (pp, dp_replicate, dp_shard[, cp]), over which the losses are summed (only
the last stage holds one; the others add zeros). The rank order
inside the mesh comes from
`topology.build_rank_layout` (ICI-aware on TPU, row-major elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import ParallelismConfig
from titan_tpu.distributed.fsdp import FSDPPolicy


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees of every axis; `dp_shard` is already resolved (never -1)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    world_size: int
    cp: int = 1
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 to "every process the other axes leave", then validate."""
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            others = cfg.pp * cfg.dp_replicate * cfg.tp * cfg.cp
            if others <= 0 or world_size % others != 0:
                cp_factor = f" x cp {cfg.cp}" if cfg.cp > 1 else ""
                pp_factor = f"pp {cfg.pp} x " if cfg.pp > 1 else ""
                raise ConfigError(
                    f"parallelism: {pp_factor}dp_replicate {cfg.dp_replicate}{cp_factor} x tp {cfg.tp} = {others} "
                    "does not "
                    f"divide the {world_size} processes started, so dp_shard = -1 has no value; "
                    f"pick degrees whose product is {world_size}"
                )
            dp_shard = world_size // others
        dims = cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.ep, world_size, cfg.cp, cfg.pp)
        dims.validate()
        return dims

    def validate(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "ep", "cp", "pp"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"parallelism.{name}: must be >= 1, got {value}")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            cp_factor = f"cp {self.cp} x " if self.cp_enabled else ""
            pp_factor = f"pp {self.pp} x " if self.pp_enabled else ""
            raise ConfigError(
                f"parallelism: {pp_factor}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"{cp_factor}tp {self.tp} = {product}, but {self.world_size} processes were started"
            )
        if self.cp_enabled and self.ep_enabled:
            raise ConfigError(
                f"parallelism.ep: expert parallelism is not supported with parallelism.cp = {self.cp} yet; "
                "set parallelism.cp = 1"
            )
        if self.dp_shard % self.ep != 0:
            raise ConfigError(
                f"parallelism.ep: expert parallelism is carved from dp_shard, so ep {self.ep} must "
                f"divide dp_shard {self.dp_shard}"
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP, or replication through fully_shard) is applied whenever dp > 1, or cp > 1:
        the cp ranks' gradients must be summed like data-parallel ones."""
        return self.dp * self.cp > 1

    @property
    def fsdp_shards(self) -> int:
        """How many ways FSDP splits a parameter: dp_shard, times cp (the cp ranks shard too)."""
        return self.dp_shard * self.cp

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def mesh_axes(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, sizes) of the physical mesh axes, outermost first."""
        names: tuple[str, ...]
        sizes: tuple[int, ...]
        if self.ep_enabled:
            names = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
            sizes = (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
        elif self.cp_enabled:
            names = ("dp_replicate", "dp_shard", "cp", "tp")
            sizes = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        else:
            names = ("dp_replicate", "dp_shard", "tp")
            sizes = (self.dp_replicate, self.dp_shard, self.tp)
        if self.pp_enabled:
            names, sizes = ("pp", *names), (self.pp, *sizes)
        return names, sizes

    def describe(self) -> str:
        cp_factor = f"cp {self.cp} x " if self.cp_enabled else ""
        pp_factor = f"pp {self.pp} x " if self.pp_enabled else ""
        text = f"{pp_factor}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x {cp_factor}tp {self.tp}"
        return text + (f" (ep {self.ep} inside dp_shard)" if self.ep_enabled else "")

    def build_meshes(self, device_type: str, rank_layout: np.ndarray | None = None) -> dict[str, DeviceMesh]:
        """The named world mesh and its sub-meshes, by name: "world", every axis name, "dp",
        "dp_shard" (flattened when ep splits it) and "fsdp" (what `fully_shard` takes: 1-D dp_shard,
        or 2-D (dp_replicate, dp_shard) for HSDP / replication; with cp > 1 dp_shard_cp takes
        dp_shard's place), and with cp > 1 "dp_shard_cp" and "dp_cp".

        `rank_layout` has the mesh shape and holds global ranks (the ICI-aware order from
        `topology.build_rank_layout`); None means row-major. Every rank must call this (it creates groups).
        """
        names, sizes = self.mesh_axes()
        if rank_layout is None:
            rank_layout = np.arange(self.world_size).reshape(sizes)
        if tuple(rank_layout.shape) != sizes:
            raise ConfigError(
                f"rank layout has shape {tuple(rank_layout.shape)} but the mesh {dict(zip(names, sizes))} needs {sizes}"
            )
        world = DeviceMesh(device_type, torch.as_tensor(rank_layout, dtype=torch.int), mesh_dim_names=names)
        meshes = {"world": world, **{name: world[name] for name in names}}
        # Flattened meshes are kept here rather than sliced from the root again later (slicing a
        # flattened dim from the root mesh is deprecated).
        if self.ep_enabled:
            meshes["dp_shard"] = world["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
            meshes["dp"] = world["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
            if self.dp_replicate > 1:
                # HSDP over (dp_replicate, dp_shard): the flattened dp unflattened into two axes.
                meshes["fsdp"] = meshes["dp"]._unflatten(
                    0, (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")
                )
            else:
                meshes["fsdp"] = meshes["dp_shard"]
        elif self.cp_enabled:
            meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
            meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
            meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            if self.dp_replicate > 1:
                meshes["fsdp"] = meshes["dp_cp"]._unflatten(
                    0, (self.dp_replicate, self.fsdp_shards), ("dp_replicate", "dp_shard_cp")
                )
            else:
                meshes["fsdp"] = meshes["dp_shard_cp"]
        else:
            meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
            meshes["fsdp"] = world["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else world["dp_shard"]
        if self.pp_enabled:
            dp_axes = ("dp_shard_mod_ep", "ep") if self.ep_enabled else ("dp_shard",)
            cp_axes = ("cp",) if self.cp_enabled else ()
            # Named first: mypy reads a starred tuple written inside the brackets as the 3.11-only `world[*axes]`.
            pp_dp_axes = ("pp", "dp_replicate", *dp_axes, *cp_axes)
            meshes["pp_dp"] = world[pp_dp_axes]._flatten("pp_dp")
        return meshes


@dataclass(frozen=True)
class ParallelContext:
    """What a model's `parallelize` function and the trainer need: the degrees, the named meshes
    (empty for a single process), the tensor-parallel options from `[parallelism]` and the FSDP
    policy every `fully_shard` of the run uses (set by `parallelize_model` from the config)."""

    dims: ParallelDims
    meshes: dict[str, DeviceMesh] = field(default_factory=dict)
    sequence_parallel: bool = True
    loss_parallel: bool = False
    fsdp: FSDPPolicy = FSDPPolicy()

    def mesh(self, name: str) -> DeviceMesh:
        if name not in self.meshes:
            raise RuntimeError(
                f"no '{name}' mesh (single-process run, or the axis is not built); "
                f"have: {', '.join(self.meshes) or 'none'}"
            )
        return self.meshes[name]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh("tp")

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh("ep")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """Flattened (dp_replicate, dp_shard): same data inside a tp group, different across it."""
        return self.mesh("dp")

    @property
    def dp_reduce_mesh(self) -> DeviceMesh | None:
        """The mesh to reduce per-rank values (loss, counts) over data parallelism; None when there is
        one data-parallel rank and nothing to reduce."""
        return self.dp_mesh if self.dims.dp > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self.mesh("fsdp")

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh("pp")

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh("cp")

    @property
    def loss_reduce_mesh(self) -> DeviceMesh | None:
        """The mesh over which per-rank mean losses are averaged: the data-parallel ranks and, with
        cp > 1, the cp ranks (each holds an equal share of different tokens of the same samples, so
        the mean of their means is the mean over the samples' tokens). None with nothing to reduce.
        With pp > 1 the sum runs over the stages too: only the last stage holds a loss, the others
        add zeros."""
        if self.dims.pp_enabled:
            return self.mesh("pp_dp")
        if not self.dims.cp_enabled:
            return self.dp_reduce_mesh
        return self.mesh("dp_cp")

    @property
    def loss_reduce_ranks(self) -> int:
        """How many ranks' mean losses `loss_reduce_mesh` sums."""
        return self.dims.dp * self.dims.cp

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.loss_parallel and self.dims.tp_enabled

    def dp_coordinates(self) -> tuple[int, int]:
        """(dp_rank, dp_world_size) for the data loader: the flattened (dp_replicate, dp_shard)
        coordinate, so every rank of one tp group reads the same samples."""
        if self.dims.dp == 1:
            return 0, 1
        return self.dp_mesh.get_local_rank(), self.dims.dp
