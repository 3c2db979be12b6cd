"""How Qwen 3 is spread over the mesh (called on the `meta` model before AC, compile and FSDP).

Dense: exactly Llama 3's tensor (+ sequence) parallel plan, per-head q/k norms included.
MoE: the same plan for attention, norms, embeddings and head; the MoE feed-forward is expert-parallel
over `ep` and replicated over `tp` (layout rule and gradient bookkeeping in
`titan_tpu.distributed.expert_parallel`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from models.llama3.parallelize import apply_decoder_tp, block_plan, check_tp_divisibility, parallelize_llama3
from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.expert_parallel import (
    parallelize_moe,
    replicate_moe_over_tp,
    sum_over_mesh,
    validate_expert_parallel,
)
from titan_tpu.distributed.parallel_dims import ParallelContext


def parallelize_qwen3(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """The dense ModelSpec's `parallelize`: tensor parallelism when tp > 1; ep has nothing to shard."""
    if ctx.dims.ep_enabled:
        raise ConfigError(
            f"parallelism.ep = {ctx.dims.ep} but model 'qwen3' is dense (no experts); use qwen3_moe "
            "or set parallelism.ep = 1"
        )
    return parallelize_llama3(model, ctx)


def parallelize_qwen3_moe(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """The MoE ModelSpec's `parallelize`: TP for the dense parts, EP (+ expert FSDP) for the experts."""
    args = model.args  # type: ignore[attr-defined]
    dims = ctx.dims
    validate_expert_parallel(dims, args.num_experts)
    if dims.tp_enabled:
        if ctx.loss_parallel_enabled:
            raise ConfigError(
                "parallelism.loss_parallel is not supported for qwen3_moe (its loss adds the router's "
                "auxiliary loss to the cross-entropy); set parallelism.loss_parallel = false"
            )
        # Only attention is tensor-parallel (the experts are not): no feed-forward width to check.
        check_tp_divisibility(args.n_heads, args.n_kv_heads, args.n_heads, dims.tp)
        _apply_attention_tp(model, ctx)
        replicate_moe_over_tp(model, ctx.tp_mesh, ctx.sequence_parallel)
    parallelize_moe(model, ctx, args.num_experts)
    if dims.dp > 1:
        # Global-batch load balancing: the aux loss sees the router statistics of every data-parallel
        # rank, so it does not depend on how the batch is split (see Qwen3MoeModel.sum_router_stats).
        model.sum_router_stats = sum_over_mesh(ctx.dp_mesh)  # type: ignore[assignment]
    return model


def _apply_attention_tp(model: nn.Module, ctx: ParallelContext) -> None:
    """Llama's decoder plan without its feed-forward entries (the MoE layer is not tensor-parallel)."""
    tp_mesh, sequence_parallel = ctx.tp_mesh, ctx.sequence_parallel
    blocks = list(model.get_submodule("layers").children())
    # apply_decoder_tp shards the top level and every block; the blocks are re-planned here, so hand
    # it a model view without blocks and plan them ourselves.
    layers = model.get_submodule("layers")
    model.layers = nn.ModuleDict()  # type: ignore[assignment]
    try:
        apply_decoder_tp(model, tp_mesh, sequence_parallel, loss_parallel=False)
    finally:
        model.layers = layers  # type: ignore[assignment]
    for block in blocks:
        plan = {
            name: style
            for name, style in block_plan(block, sequence_parallel).items()
            if not name.startswith("feed_forward")
        }
        parallelize_module(block, tp_mesh, plan)
