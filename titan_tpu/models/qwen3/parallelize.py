"""How Qwen 3 is spread over the mesh (called on the `meta` model before AC, compile and FSDP).

Dense: the dense decoder's tensor (+ sequence) parallel plan (`titan_tpu/models/common/parallelize.py`),
per-head q/k norms included.
MoE: the same plan for attention, norms, embeddings and head, without the feed-forward entries; the
MoE feed-forward is expert-parallel over `ep` and replicated over `tp` (layout rule and gradient
bookkeeping in `titan_tpu.distributed.expert_parallel`).
"""

from __future__ import annotations

from torch import nn

from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.expert_parallel import (
    parallelize_moe,
    replicate_moe_over_tp,
    sum_over_mesh,
    validate_expert_parallel,
)
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.models.common.parallelize import (
    DecoderTPPlan,
    attention_block_plan,
    check_tp_divisibility,
    parallelize_dense_decoder,
)
from titan_tpu.models.qwen3.model import Qwen3Model, Qwen3MoeModel

# Only attention is tensor-parallel: the experts are split over ep instead.
QWEN3_MOE_TP_PLAN = DecoderTPPlan(block_plan=attention_block_plan)


def parallelize_qwen3(model: Qwen3Model, ctx: ParallelContext) -> nn.Module:
    """The dense ModelSpec's `parallelize`: tensor parallelism when tp > 1; ep has nothing to shard."""
    if ctx.dims.ep_enabled:
        raise ConfigError(
            f"parallelism.ep = {ctx.dims.ep} but model 'qwen3' is dense (no experts); use qwen3_moe "
            "or set parallelism.ep = 1"
        )
    return parallelize_dense_decoder(model, ctx)


def parallelize_qwen3_moe(model: Qwen3MoeModel, ctx: ParallelContext) -> nn.Module:
    """The MoE ModelSpec's `parallelize`: TP for the dense parts, EP (+ expert FSDP) for the experts."""
    args = model.args
    dims = ctx.dims
    validate_expert_parallel(dims, args.num_experts)
    if dims.tp_enabled:
        if ctx.loss_parallel_enabled:
            raise ConfigError(
                "parallelism.loss_parallel is not supported for qwen3_moe (its loss adds the router's "
                "auxiliary loss to the cross-entropy); set parallelism.loss_parallel = false"
            )
        check_tp_divisibility({"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads}, dims.tp)
        QWEN3_MOE_TP_PLAN.apply(model, ctx.tp_mesh, ctx.sequence_parallel, loss_parallel=False)
        replicate_moe_over_tp(model, ctx.tp_mesh, ctx.sequence_parallel)
    parallelize_moe(model, ctx, args.num_experts)
    if dims.dp > 1:
        # Global-batch load balancing: the aux loss sees the router statistics of every data-parallel
        # rank, so it does not depend on how the batch is split (see Qwen3MoeModel.sum_router_stats).
        model.sum_router_stats = sum_over_mesh(ctx.dp_mesh)
    return model
