"""Expert parallelism (EP): each rank of the `ep` mesh axis holds num_experts / ep of every MoE layer's
experts; tokens travel to the rank holding their expert and back with two all-to-alls.

Layout rule. ep is carved out of dp_shard, never out of tp or dp_replicate:

    world = dp_replicate x dp_shard x tp,   dp_shard = dp_shard_mod_ep x ep   (ep innermost of dp_shard)

so ep must divide dp_shard (`ParallelDims.validate`) and the number of experts (`validate_expert_parallel`).
The ranks of one ep group are data-parallel peers (different micro-batches), which is what makes
expert parallelism pay: the experts' memory is divided by ep and every expert sees the tokens of ep
ranks. Parameters are then sharded as follows:

    attention, norms, router, embeddings   FSDP over dp_shard (all of it), TP over tp as for dense
    experts (w1, w2, w3: [E, out, in])     Shard(0) over ep, then FSDP over dp_shard_mod_ep
                                           (HSDP: replicated over dp_replicate as well)

Expert gradients: the expert held on rank r collects the contributions of all ep ranks' tokens, i.e.
a *sum* over ep of per-rank mean-loss gradients, and FSDP over dp_shard_mod_ep averages only over
that axis. The missing 1/ep is applied inside backward: the experts' output gradient is scaled by
1/ep on its way in and their input gradient by ep on its way out, so the weight gradients carry 1/ep
and the tokens' gradients are untouched. (FSDP's `set_gradient_divide_factor` would do it in the
reduce-scatter, but it needs ReduceOp.PREMUL_SUM, which gloo lacks; this works on every backend.)

With tp > 1 the MoE layer is not tensor-parallel: its input is gathered to the full sequence, every
tp rank routes the same tokens and computes the same outputs (so router and expert gradients agree
across tp without a reduction), and the output is re-sharded along the sequence for the residual.

The model code knows none of this: `GroupedExperts(x_sorted, counts)` is wrapped by a forward
pre-hook (dispatch) and a forward hook (combine) installed here. On TPU the two exchanges are
TorchTPU's ragged all-to-all (ragged_exchange.py, no host-side split sizes); elsewhere
`all_to_all_single`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan_tpu.config.errors import ConfigError
from titan_tpu.device.tpu_api import torch_tpu_function
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.distributed.ragged_exchange import RaggedExchange

LAYOUT_RULE = (
    "expert parallelism is carved from dp_shard (dp_shard = dp_shard_mod_ep x ep); ep must divide "
    "dp_shard and the number of experts"
)


def validate_expert_parallel(dims: ParallelDims, num_experts: int) -> None:
    """One clear line when ep cannot be laid out (see LAYOUT_RULE)."""
    if dims.ep < 1:
        raise ConfigError(f"parallelism.ep: must be >= 1, got {dims.ep}")
    if dims.dp_shard % dims.ep != 0:
        raise ConfigError(
            f"parallelism.ep: {LAYOUT_RULE}; ep {dims.ep} does not divide dp_shard {dims.dp_shard} ({dims.describe()})"
        )
    if num_experts % dims.ep != 0:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and dims.dp_shard % d == 0]
        raise ConfigError(
            f"parallelism.ep: {LAYOUT_RULE}; ep {dims.ep} does not divide the model's {num_experts} "
            f"experts (with dp_shard {dims.dp_shard}, ep can be one of {fits})"
        )


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


# torch 2.13 renamed these two (the old names warn on every call); older releases have only the old.
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_rows = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over `group` (every rank the same shape); the gradient is
    reduce-scattered (summed) back to each rank's rows. Blocking c10d calls, so one collective is in
    flight at a time: the same gathers as functional collectives, issued back to back on a gloo
    group, crashed a process with a corrupted heap in some launches of the hf layout test."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        _all_gather_rows(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ScatterRows.apply(grad, ctx.group), None


class ScatterRows(torch.autograd.Function):
    """Sum over `group` and keep this rank's block of rows (reduce-scatter along dim 0); the
    gradient is all-gathered. The inverse of GatherRows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        _reduce_scatter_rows(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return GatherRows.apply(grad, ctx.group), None


class _Dispatch:
    """The all-to-all pair around one experts module. State from the dispatch (how to send the
    results back, and the regrouping permutation) is kept here until the matching combine;
    activation-checkpoint recompute runs the pair again in the same order, so one slot suffices.

    `ragged_all_to_all`: the device's ragged exchange (TorchTPU's on TPU, see ragged_exchange.py),
    or None for `all_to_all_single` with host-side split sizes."""

    def __init__(
        self, ep_mesh: DeviceMesh, num_experts: int, ragged_all_to_all: Callable[..., torch.Tensor] | None
    ) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep
        self.ragged_all_to_all = ragged_all_to_all
        self.state: tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None = None

    def dispatch(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x, counts = args
        # counts [E] of this rank's tokens per global expert; experts e*L .. (e+1)*L-1 live on ep rank e.
        if self.ragged_all_to_all is None:
            routed, received_matrix, send_back = self._exchange_split(x, counts)
        else:
            routed, received_matrix, send_back = self._exchange_ragged(x, counts, self.ragged_all_to_all)
        # Arrived ordered by (source rank, local expert); the experts want (local expert, source).
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local_experts, device=x.device).repeat(self.ep),
            received_matrix.flatten(),
            output_size=routed.shape[0],
        )
        order = torch.argsort(expert_of_row, stable=True)
        self.state = (send_back, order)
        # Undo, for the tokens, the 1/ep the combine puts on the experts' gradients (module doc).
        tokens = ScaleGrad.apply(routed[order], float(self.ep))
        return tokens, received_matrix.sum(0)

    def _exchange_split(
        self, x: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        sent_per_rank = counts.view(self.ep, self.local_experts).sum(1).tolist()
        received_matrix = received.view(self.ep, self.local_experts)  # [source rank, local expert]
        received_per_rank = received_matrix.sum(1).tolist()
        routed = all_to_all_single_autograd(x, received_per_rank, sent_per_rank, group=self.group)

        def send_back(rows: torch.Tensor) -> torch.Tensor:
            return all_to_all_single_autograd(rows, sent_per_rank, received_per_rank, group=self.group)

        return routed, received_matrix, send_back

    def _exchange_ragged(
        self, x: torch.Tensor, counts: torch.Tensor, op: Callable[..., torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        # Every rank's counts: the op's output offsets are the receiver's rows as seen by the sender.
        every_rank = counts.new_empty(self.ep * counts.shape[0])
        _all_gather_rows(every_rank, counts.contiguous(), group=self.group)
        exchange = RaggedExchange.from_counts(
            every_rank.view(self.ep, -1), dist.get_rank(self.group), self.group.group_name
        )
        return exchange.dispatch(x, op), exchange.received_matrix, lambda rows: exchange.combine(rows, op)

    def combine(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("expert-parallel combine without a dispatch")
        send_back, order = self.state
        self.state = None
        output = ScaleGrad.apply(output, 1.0 / self.ep)
        by_source = torch.empty_like(output).index_copy(0, order, output)
        return send_back(by_source)


def tpu_ragged_all_to_all(ep_mesh: DeviceMesh) -> Callable[..., torch.Tensor] | None:
    """TorchTPU's ragged all-to-all when the ep mesh is on TPU, else None (the all-to-all path)."""
    return torch_tpu_function("torch.tpu.ops.ragged_all_to_all") if ep_mesh.device_type == "tpu" else None


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every MoE feed-forward (a module with `router` and `experts` children) in the model."""
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "experts")]


def moe_experts(moe: nn.Module) -> nn.Module:
    """The `experts` child of a MoE layer of `moe_layers`."""
    return moe.get_submodule("experts")


def num_experts(experts: nn.Module) -> int:
    """How many experts an experts module (weights [E, ...]) holds: its `num_experts`."""
    count = experts.num_experts
    if not isinstance(count, int):
        raise TypeError(f"{type(experts).__name__}.num_experts: expected an int, got {type(count).__name__}")
    return count


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, ragged_all_to_all: Callable[..., torch.Tensor] | None = None
) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (dim 0) and wrap them with dispatch / combine,
    which exchange tokens through `ragged_all_to_all` when given (see `_Dispatch`). Call on the
    `meta` model, before FSDP."""
    for moe in moe_layers(model):
        experts = moe_experts(moe)
        count = num_experts(experts)
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]))
            experts.register_parameter(name, sharded)
        hooks = _Dispatch(ep_mesh, count, ragged_all_to_all)
        experts.register_forward_pre_hook(hooks.dispatch)
        experts.register_forward_hook(hooks.combine)


def replicate_moe_over_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """With tp > 1, run each MoE layer on the full sequence on every tp rank (see module doc)."""

    def gather(module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        if isinstance(x, DTensor):
            x = x.redistribute(tp_mesh, [Replicate()]).to_local()
        return (x, *args[1:])

    def scatter(module: nn.Module, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[Any, Any]:
        # The residual stream between sub-layers is a plain tensor holding this rank's sequence
        # shard (SP) or the whole sequence; hand back the same.
        out, stats = output
        if not sequence_parallel:
            return out, stats
        full = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return full.redistribute(tp_mesh, [Shard(1)]).to_local(), stats

    for moe in moe_layers(model):
        moe.register_forward_pre_hook(gather)
        moe.register_forward_hook(scatter)


def sum_over_mesh(mesh: DeviceMesh) -> Callable[[torch.Tensor], tuple[torch.Tensor, int]]:
    """A (sum over the mesh's ranks, number of ranks) function, e.g. for global-batch load balancing
    (`Qwen3MoeModel.sum_router_stats`): no autograd, the caller handles the gradient."""
    group = mesh.get_group()

    def summed(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        tensor = tensor.detach().clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor, mesh.size()

    return summed


def expert_fsdp_mesh(ctx: ParallelContext) -> DeviceMesh | None:
    """The mesh the experts are FSDP-sharded over: dp_shard_mod_ep, with dp_replicate in front for
    HSDP; None when that is a single rank (ep == dp_shard and no replicas)."""
    dims = ctx.dims
    world = ctx.mesh("world")
    if dims.dp_replicate > 1:
        return world["dp_replicate", "dp_shard_mod_ep"]
    if dims.dp_shard // dims.ep > 1:
        return world["dp_shard_mod_ep"]
    return None


def apply_expert_fsdp(model: nn.Module, ctx: ParallelContext) -> None:
    """`fully_shard` every MoE layer's experts (`shard_experts`)."""
    shard_experts([moe_experts(moe) for moe in moe_layers(model)], ctx)


def shard_experts(experts_modules: list[nn.Module], ctx: ParallelContext) -> None:
    """`fully_shard` each experts module (one per MoE layer, in block order, its parameters
    [E, ...] laid out over ep) over the expert-FSDP mesh, before the blocks are sharded (so the
    block's FSDP leaves them alone), with the run's FSDP policy (`ctx.fsdp`: the experts are
    gathered in the compute dtype and resharded like their block). When that mesh is a single rank
    the experts still get their own (trivial) FSDP group, so that the block's FSDP never sees
    parameters laid out over ep.
    """
    mesh = expert_fsdp_mesh(ctx) or ctx.mesh("world")["dp_shard_mod_ep"]
    shards = mesh.size(0) if mesh.ndim == 1 else mesh.size(1)
    ep = ctx.dims.ep
    for index, experts in enumerate(experts_modules):
        placements: dict[int, Shard] = {}
        for name, param in experts.named_parameters():
            local_shape = [param.shape[0] // ep, *param.shape[1:]]
            dim = expert_shard_dim(local_shape, shards)
            if dim is None:
                raise ConfigError(expert_fsdp_refusal(name, local_shape, shards, ctx.dims))
            placements[id(param)] = Shard(dim)
        fully_shard(
            experts,
            mesh=mesh,
            shard_placement_fn=_placement_of(placements),
            **ctx.fsdp.shard_kwargs(is_last_block=index == len(experts_modules) - 1),
        )


def _placement_of(placements: dict[int, Shard]) -> Callable[[nn.Parameter], Shard | None]:
    """A `shard_placement_fn` that gives each parameter its placement (by identity)."""
    return lambda param: placements[id(param)]


def expert_shard_dim(local_shape: list[int], shards: int) -> int | None:
    """The dimension FSDP shards a layer's experts on, from their shape after expert parallelism
    ([local experts, ...]): the expert dimension when the local experts split evenly over the
    shards, else the first other dimension that does (FSDP2 pads only dimension 0, and with fewer
    experts than shards padding it would gather mostly zeros; any other dimension it shards only
    evenly); None when no dimension splits evenly."""
    for dim, size in enumerate(local_shape):
        if size % shards == 0:
            return dim
    return None


def expert_fsdp_refusal(name: str, local_shape: list[int], shards: int, dims: ParallelDims) -> str:
    """The one line for experts FSDP cannot shard, and what to change."""
    return (
        f"parallelism.ep = {dims.ep}: each rank's experts {name} {local_shape} are FSDP-sharded over "
        f"dp_shard / ep = {shards} ranks, and no dimension of them splits evenly over {shards} (FSDP2 shards "
        "a dimension other than the first only evenly); choose an ep for which dp_shard / ep divides the "
        "local experts or one of their other dimensions (a larger ep shards fewer ways)"
    )


def parallelize_moe(model: nn.Module, ctx: ParallelContext, num_experts: int) -> None:
    """Expert parallelism (and expert FSDP) for a model whose dense parts are handled elsewhere."""
    dims = ctx.dims
    validate_expert_parallel(dims, num_experts)
    if not dims.ep_enabled:
        return
    apply_expert_parallel(model, ctx.ep_mesh, tpu_ragged_all_to_all(ctx.ep_mesh))
    apply_expert_fsdp(model, ctx)
