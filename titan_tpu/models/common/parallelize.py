"""Tensor (+ sequence) parallel plan of the decoders built from `titan_tpu.models.common`, in two parts: the
top-level plan (embedding, final norm, head) and a per-block plan, which a family picks or filters
(a dense block splits its SwiGLU; Qwen 3 MoE's experts are not tensor-parallel).

Megatron layout: q/k/v and gate/up are split column-wise (each rank owns whole heads / a slice of
the hidden units), out and down row-wise, so a block needs one reduction per sub-layer. With sequence
parallelism the residual stream between sub-layers is sharded along the sequence (dim 1): the norms
run on 1/tp of the tokens, the row-wise layers reduce-scatter instead of all-reducing, and the inputs
of attention / feed-forward are all-gathered back to the full sequence.

Applied on the `meta` model before activation checkpointing, compile and FSDP
(`titan_tpu.distributed.parallelize`). Attention infers the local head count from the weight shapes,
so the model code runs unchanged on the shards. The same plan, as data (`DecoderTPPlan.styles`), is
what the planner reads to know which weights are split (titan_tpu/plan/census.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.context_parallel import apply_context_parallel
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.distributed.tensor_parallel import ReplicateParallel, install_logits_layout, to_replicated_dtensor
from titan_tpu.models.common.decoder import DecoderLM
from titan_tpu.models.common.transformer import TransformerBlock


class DenseDecoderArgs(Protocol):
    """What the dense plan splits: heads, and the SwiGLU's width (a field or a derived property)."""

    n_heads: int
    n_kv_heads: int

    @property
    def ffn_hidden_dim(self) -> int: ...


# Styles of one block's submodules, by their path in the block; the bool is sequence parallelism.
BlockPlan = Callable[[TransformerBlock, bool], dict[str, ParallelStyle]]


def check_tp_divisibility(sizes: dict[str, int], tp: int) -> None:
    """Every size the plan splits (head counts, widths) must divide over tp."""
    for what, value in sizes.items():
        if value % tp != 0:
            raise ConfigError(f"parallelism.tp = {tp} must divide the model's {what} ({value}); pick a tp that does")


def attention_block_plan(block: TransformerBlock, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for a `TransformerBlock`'s norms and attention (attention.{wq,wk,wv,wo}, q/k norms when
    it has them), with the feed-forward left as it is."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if not sequence_parallel:
        # Norms run on the full, replicated sequence; their weights still become (Replicate)
        # DTensors on the tp mesh so that every parameter lives on one mesh (FSDP, clipping and the
        # optimizer's foreach kernels do not mix meshes).
        plan["attention_norm"] = ReplicateParallel()
        plan["ffn_norm"] = ReplicateParallel()
    else:
        plan["attention_norm"] = SequenceParallel()
        # x arrives sequence-sharded; cos/sin (None: untouched) cover the full sequence.
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan["ffn_norm"] = SequenceParallel()
    if block.attention.q_norm is not None:
        # Per-head norms see only this rank's heads (dim 2 of [B, S, H, D]); as Replicate DTensors
        # their weight gradients are summed over the tp group.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def decoder_block_plan(block: TransformerBlock, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for a `TransformerBlock` with a dense SwiGLU (feed_forward.{w1,w2,w3})."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = attention_block_plan(block, sequence_parallel)
    plan["feed_forward.w1"] = ColwiseParallel()
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=residual)
    plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def decoder_top_plan(model: DecoderLM, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for a decoder's `tok_embeddings`, `norm` and optional `output` head, those of them the
    model has (a pipeline stage holds the embedding, or the norm and head, or neither)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None:
        top["norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return top


def _blocks(model: DecoderLM) -> list[tuple[str, TransformerBlock]]:
    """(name, block) of `model.layers`, each a TransformerBlock: the plan is applied before activation
    checkpointing and compile wrap them."""
    blocks: list[tuple[str, TransformerBlock]] = []
    for name, block in model.layers.items():
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"layers.{name}: the decoder plan splits TransformerBlocks, not {type(block).__name__}")
        blocks.append((name, block))
    return blocks


@dataclass(frozen=True)
class DecoderTPPlan:
    """A decoder's whole tensor-parallel plan: the top-level plan and `block_plan` for every block
    of `model.layers`. `apply` shards a model by it; `styles` is the same plan as data."""

    block_plan: BlockPlan = decoder_block_plan

    def styles(
        self, model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool
    ) -> dict[str, ParallelStyle]:
        """Module path in `model` (a DecoderLM) -> its style, for every module the plan touches (the
        same for every tp; the sizes it splits are checked by the caller)."""
        if not isinstance(model, DecoderLM):
            raise TypeError(f"a decoder's tensor-parallel plan applies to a DecoderLM, not {type(model).__name__}")
        styles = decoder_top_plan(model, sequence_parallel, loss_parallel)
        for name, block in _blocks(model):
            plan = self.block_plan(block, sequence_parallel)
            styles.update({f"layers.{name}.{path}": style for path, style in plan.items()})
        return styles

    def apply(self, model: DecoderLM, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
        parallelize_module(model, tp_mesh, decoder_top_plan(model, sequence_parallel, loss_parallel))
        # The embedding's local output is a view into a DTensor's storage; a compiled first block
        # (AOTAutograd) would route its input gradient to that base with the wrong type. A copy of
        # one activation breaks the alias.
        if model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())
        if model.output is None and model.norm is not None:
            # Tied head: forward computes F.linear(norm(h), tok_embeddings.weight) with the weight
            # vocab-sharded; hand it the normed hidden states replicated, so the logits come out
            # vocab-sharded without gathering the embedding table.
            model.norm.register_forward_hook(lambda module, args, output: to_replicated_dtensor(output, tp_mesh))
        for _, block in _blocks(model):
            parallelize_module(block, tp_mesh, self.block_plan(block, sequence_parallel))
        if sequence_parallel:
            whole_sequence_between_stages(model, tp_mesh)
        install_logits_layout(model, tp_mesh, loss_parallel)


def whole_sequence_between_stages(model: DecoderLM, tp_mesh: DeviceMesh) -> None:
    """A pipeline stage (titan_tpu/models/common/decoder.py) hands the next one the whole sequence: the rotary
    tables of a stage are sized from its input's length. So a stage without the embedding takes the
    replicated hidden states and shards them along the sequence for its first block, and a stage
    without the head gathers its last block's sequence-sharded output. A whole model has neither."""
    blocks = list(model.layers.values())
    if model.tok_embeddings is None:
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            ),
        )
    if model.norm is None:
        parallelize_module(
            blocks[-1], tp_mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        )


DENSE_DECODER_TP = DecoderTPPlan()


def apply_decoder_tp(model: DecoderLM, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shard a dense decoder (`tok_embeddings`, `layers` of SwiGLU blocks, `norm`, optional `output`)."""
    DENSE_DECODER_TP.apply(model, tp_mesh, sequence_parallel, loss_parallel)


def apply_decoder_cp(model: DecoderLM, cp_mesh: DeviceMesh) -> None:
    """Context parallelism for a decoder built from `titan_tpu.models.common`: every block's attention
    gathers keys and values over cp, and the rotary tables follow the rank's true positions."""
    attention = [block.attention for _, block in _blocks(model)]
    apply_context_parallel(attention, model.rope, cp_mesh)


def parallelize_dense_decoder(model: DecoderLM, ctx: ParallelContext) -> nn.Module:
    """A dense decoder family's `ModelSpec.parallelize`: tensor parallelism when tp > 1 and context
    parallelism when cp > 1 (nothing else here; activation checkpointing, compile and FSDP are
    applied by the generic pipeline)."""
    if ctx.dims.cp_enabled:
        apply_decoder_cp(model, ctx.cp_mesh)
    if not ctx.dims.tp_enabled:
        return model
    args: DenseDecoderArgs = model.args  # type: ignore[assignment]  # a dense family's args add ffn_hidden_dim
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "the ffn hidden size": args.ffn_hidden_dim}
    check_tp_divisibility(sizes, ctx.dims.tp)
    apply_decoder_tp(model, ctx.tp_mesh, ctx.sequence_parallel, ctx.loss_parallel_enabled)
    return model
