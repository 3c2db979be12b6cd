"""Tensor (+ sequence) parallel plan for Llama 3, reusable by every decoder built from
`models.common` (Qwen 3 dense uses it as is; its per-head q/k norms are handled below).

Megatron layout: q/k/v and gate/up are split column-wise (each rank owns whole heads / a slice of
the hidden units), out and down row-wise, so a block needs one reduction per sub-layer. With sequence
parallelism the residual stream between sub-layers is sharded along the sequence (dim 1): the norms
run on 1/tp of the tokens, the row-wise layers reduce-scatter instead of all-reducing, and the inputs
of attention / feed-forward are all-gathered back to the full sequence.

Applied on the `meta` model before activation checkpointing, compile and FSDP
(`titan_tpu.distributed.parallelize`). Attention infers the local head count from the weight shapes,
so the model code runs unchanged on the shards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.distributed.tensor_parallel import ReplicateParallel, install_logits_layout, to_replicated_dtensor


def check_tp_divisibility(n_heads: int, n_kv_heads: int, hidden: int, tp: int) -> None:
    for what, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("the ffn hidden size", hidden)):
        if value % tp != 0:
            raise ConfigError(
                f"parallelism.tp = {tp} must divide the model's {what} ({value}); pick a tp that does"
            )


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for one `TransformerBlock` (attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
    feed_forward.{w1,w2,w3})."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        "feed_forward.w3": ColwiseParallel(),
    }
    if not sequence_parallel:
        # Norms run on the full, replicated sequence; their weights still become (Replicate)
        # DTensors on the tp mesh so that every parameter lives on one mesh (FSDP, clipping and the
        # optimizer's foreach kernels do not mix meshes).
        plan["attention_norm"] = ReplicateParallel()
        plan["ffn_norm"] = ReplicateParallel()
    else:
        plan.update(
            {
                "attention_norm": SequenceParallel(),
                # x arrives sequence-sharded; cos/sin (None: untouched) cover the full sequence.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    attention = block.get_submodule("attention")
    if getattr(attention, "q_norm", None) is not None:
        # Per-head norms see only this rank's heads (dim 2 of [B, S, H, D]); as Replicate DTensors
        # their weight gradients are summed over the tp group.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_decoder_tp(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shard a decoder with `tok_embeddings`, `layers`, `norm` and an optional `output` head."""
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
    }
    top["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top)
    # The embedding's local output is a view into a DTensor's storage; a compiled first block
    # (AOTAutograd) would route its input gradient to that base with the wrong type. A copy of one
    # activation breaks the alias.
    model.get_submodule("tok_embeddings").register_forward_hook(lambda module, args, output: output.clone())
    if getattr(model, "output", None) is None:
        # Tied head: forward computes F.linear(norm(h), tok_embeddings.weight) with the weight
        # vocab-sharded; hand it the normed hidden states replicated, so the logits come out
        # vocab-sharded without gathering the embedding table.
        model.get_submodule("norm").register_forward_hook(
            lambda module, args, output: to_replicated_dtensor(output, tp_mesh)
        )
    for block in model.get_submodule("layers").children():
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
    install_logits_layout(model, tp_mesh, loss_parallel)


def parallelize_llama3(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """The Llama 3 ModelSpec's `parallelize`: tensor parallelism when tp > 1 (nothing else here;
    activation checkpointing, compile and FSDP are applied by the generic pipeline)."""
    if not ctx.dims.tp_enabled:
        return model
    args = model.args  # type: ignore[attr-defined]
    check_tp_divisibility(args.n_heads, args.n_kv_heads, args.ffn_hidden_dim, ctx.dims.tp)
    apply_decoder_tp(model, ctx.tp_mesh, ctx.sequence_parallel, ctx.loss_parallel_enabled)
    return model
