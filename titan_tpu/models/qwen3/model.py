"""Qwen 3, dense and mixture-of-experts, single-device; parallelism is applied from outside.

Qwen 3 is the shared decoder (`titan_tpu.models.common.decoder`, module names listed there) with a per-head
RMSNorm on q and k before the rotation (QK-norm, `Qwen3Args.qk_norm`), an explicit head_dim of 128,
rope theta 1e6 without frequency scaling, and tied embeddings at the small sizes. The MoE variant
swaps each block's SwiGLU for `MoEFeedForward`: feed_forward is {router.gate, experts.{w1, w2, w3}}
with the experts' weights stacked [E, out, in].
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from titan_tpu.models.common.chunked_cross_entropy import CHUNK_ELEMENTS
from titan_tpu.models.common.decoder import DecoderLM, decoder_block
from titan_tpu.models.common.feed_forward import FeedForward
from titan_tpu.models.common.kv_cache import KVCache
from titan_tpu.models.common.loss import cross_entropy_loss
from titan_tpu.models.common.transformer import TransformerBlock
from titan_tpu.models.qwen3.args import Qwen3Args, Qwen3MoeArgs
from titan_tpu.models.qwen3.moe import MoEFeedForward, RouterStats, load_balancing_loss


class MoETransformerBlock(TransformerBlock):
    """The shared pre-norm block whose feed-forward also returns router statistics, passed out so the
    model can form the load-balancing loss over all layers (no state is stashed on modules)."""

    def forward(  # type: ignore[override]  # also returns the router statistics
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **attention_args: Any
    ) -> tuple[torch.Tensor, RouterStats]:
        """`attention_args`: the shared block's cache, mask and documents (TransformerBlock.forward)."""
        h = self.attention_residual(x, cos, sin, **attention_args)
        out, stats = self.feed_forward(self.ffn_norm(h))
        return h + out, stats


def build_qwen3_block(args: Qwen3Args, layer_id: int) -> TransformerBlock:
    if isinstance(args, Qwen3MoeArgs):
        moe = MoEFeedForward(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            top_k=args.top_k,
            norm_topk_prob=args.norm_topk_prob,
            impl=args.expert_impl,
            ragged_dot_op=args.ragged_dot_op,
        )
        return decoder_block(args, layer_id, moe, MoETransformerBlock)
    return decoder_block(args, layer_id, FeedForward(args.dim, args.ffn_hidden_dim))


class Qwen3Model(DecoderLM):
    """Dense Qwen 3: tokens [B, S] -> logits [B, S, vocab_size]; how to build it: `DecoderLM`."""

    args: Qwen3Args

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, [build_qwen3_block(args, i) for i in range(args.n_layers)])


class _AuxLossGradient:
    """Hands each layer the gradient of the load-balancing loss w.r.t. its router-probability sums.

    aux = E * sum_e (C_e / R) * (P_e / R) with C and P summed over all layers, so d aux / d P_l =
    E * C / R^2 needs the counts of *every* layer: it is known only after the forward. Letting autograd
    reach each layer through `aux_loss` would send gradient into every block the moment backward
    starts, which makes FSDP gather all blocks at once (and fire its backward hooks out of order).
    Instead, the loss's gradient is caught where `aux_loss` is formed (`_AuxLossValue`) and injected
    at each block's output (`_InjectAuxGradient`) when the main gradient stream reaches that block;
    the autograd graph orders the two (the catch consumes the last block's output).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None
        self.rows = 0
        self.upstream: torch.Tensor | None = None
        # With the statistics summed over `replicas` data-parallel ranks (global-batch balancing),
        # every rank's loss holds the same aux term, so d(sum of the ranks' losses) / d(local P) is
        # `replicas` times the local derivative; data parallelism then averages it back.
        self.replicas = 1
        # In a pipeline stage before the last: d loss / d (prob sums) as the next stage sent it back
        # (the same vector for every layer, see `_StageRouterTotals`).
        self.from_next_stage: torch.Tensor | None = None

    def prob_sums_grad(self) -> torch.Tensor | None:
        if self.from_next_stage is not None:
            return self.from_next_stage
        if self.upstream is None or self.counts is None:
            return None  # aux_loss took no part in the loss
        scale = self.upstream * (self.replicas * self.num_experts) / (self.rows * self.rows)
        return scale * self.counts


class _InjectAuxGradient(torch.autograd.Function):
    """Identity on the block output h; in backward also returns the aux gradient for prob_sums."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, prob_sums: torch.Tensor, tracker: _AuxLossGradient) -> torch.Tensor:
        ctx.tracker = tracker
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        return grad_h, ctx.tracker.prob_sums_grad(), None


class _AuxLossValue(torch.autograd.Function):
    """Returns the (gradient-free) aux loss value; in backward records d loss / d aux_loss."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, tracker: _AuxLossGradient) -> torch.Tensor:
        ctx.tracker = tracker
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.tracker.upstream = grad.detach()
        return None, None, None


class _StageRouterTotals(torch.autograd.Function):
    """A pipeline stage's router totals for the next stage (the value, gradient-free); in backward
    records the gradient the next stage sent for their prob-sums row, which `_InjectAuxGradient`
    then hands to this stage's layers and, at the stage's input, to the previous stage. Anchored on
    the stage's output hidden states like `_AuxLossValue`, so it runs before any block's backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, totals: torch.Tensor, tracker: _AuxLossGradient) -> torch.Tensor:
        ctx.tracker = tracker
        return totals.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.tracker.from_next_stage = grad[1].detach()
        return None, None, None


class MoEOutput(NamedTuple):
    """What the MoE model returns: the logits, the load-balancing loss (unweighted, as transformers
    reports `aux_loss`) and the weight the training loss gives it."""

    logits: torch.Tensor
    aux_loss: torch.Tensor
    aux_loss_coef: float


class Qwen3MoeModel(Qwen3Model):
    """Qwen 3 MoE: tokens [B, S] -> MoEOutput(logits [B, S, V], aux_loss, aux_loss_coef).

    The trainer's loss is `moe_loss`: cross-entropy + aux_loss_coef * aux_loss.
    """

    args: Qwen3MoeArgs

    def __init__(self, args: Qwen3MoeArgs) -> None:
        if not isinstance(args, Qwen3MoeArgs):
            raise TypeError(f"Qwen3MoeModel needs Qwen3MoeArgs, got {type(args).__name__}")
        super().__init__(args)
        # Global-batch load balancing: a data-parallel wrapper may set this to a function that sums a
        # tensor over the data-parallel ranks and returns (sum, number of ranks). The aux loss is then
        # computed from the whole step's router statistics, identical on every rank and equal to a
        # single process's on the same global batch (the Qwen 3 recipe). None: this batch only.
        self.sum_router_stats: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None

    def forward(  # type: ignore[override]  # takes a stage's router totals, returns the aux loss too
        self,
        tokens: torch.Tensor,
        router_totals: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        start_pos: int = 0,
        key_padding_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> MoEOutput | tuple[torch.Tensor, ...]:
        """`document_ids` [B, S] keeps packed documents apart (titan_tpu/models/common/documents.py). Generation
        and padded batches pass a `KVCache` / `key_padding_mask` as for the dense model (kv_cache.py);
        there the router statistics are not gathered and the aux loss is 0.

        A pipeline stage (cut by `keep_pipeline_stage`) runs `_stage_forward` instead: `tokens` is the
        previous stage's hidden states unless it is the first, `router_totals` that stage's totals."""
        if self.tok_embeddings is None or self.norm is None:
            return self._stage_forward(tokens, router_totals)
        if cache is not None or key_padding_mask is not None:
            return self._generation_forward(tokens, cache, start_pos, key_padding_mask)
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(tokens.shape[1])
        cos, sin, extra = self.document_rotary(cos, sin, document_ids)
        stats: list[RouterStats] = []
        tracker = _AuxLossGradient(self.args.num_experts)
        for layer in self.layers.values():
            h, layer_stats = layer(h, cos, sin, **extra)
            stats.append(layer_stats)
            if torch.is_grad_enabled() and layer_stats.prob_sums.requires_grad:
                h = _InjectAuxGradient.apply(h, layer_stats.prob_sums, tracker)
        with torch.no_grad():
            totals = torch.stack(
                [torch.stack([s.counts for s in stats]).sum(0), torch.stack([s.prob_sums for s in stats]).sum(0)]
            )
            rows = sum(s.n_tokens for s in stats)
            if self.sum_router_stats is not None:
                totals, tracker.replicas = self.sum_router_stats(totals)
                rows *= tracker.replicas
            value = load_balancing_loss([RouterStats(totals[0], totals[1], rows)], self.args.num_experts)
            tracker.counts, tracker.rows = totals[0], rows
        aux_loss = _AuxLossValue.apply(h, value, tracker) if torch.is_grad_enabled() else value
        return MoEOutput(self.logits(h), aux_loss, self.args.router_aux_loss_coef)

    def _stage_forward(self, inputs: torch.Tensor, router_totals: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """One pipeline stage of the training forward. The load-balancing loss needs every layer's
        router statistics, so each stage adds its layers' (counts, prob sums) to the totals the
        previous stage passed on ([2, E], float32) and hands them to the next with its hidden
        states; the last stage forms the aux loss from them exactly as `forward` does, per
        micro-batch (as gradient accumulation does without pp). The aux gradient, one [E] vector
        for every layer, travels back the same way: caught where the totals leave the stage (or
        where the aux loss is formed) and injected at each block's output and the stage's input.
        Returns (hidden states, totals), or on the last stage the MoEOutput's fields as a tuple."""
        h = self.tok_embeddings(inputs) if self.tok_embeddings is not None else inputs
        # Every layer routes every token of the micro-batch (the full sequence also under tp).
        rows = self.args.n_layers * inputs.shape[0] * inputs.shape[1]
        cos, sin = self.rope(inputs.shape[1])
        tracker = _AuxLossGradient(self.args.num_experts)
        grad_enabled = torch.is_grad_enabled()
        if router_totals is None:
            router_totals = torch.zeros(2, self.args.num_experts, device=h.device, dtype=torch.float32)
        elif grad_enabled and router_totals.requires_grad:
            # The earlier stages' prob sums take the same gradient as this stage's layers'.
            h = _InjectAuxGradient.apply(h, router_totals[1], tracker)
        stats: list[RouterStats] = []
        for layer in self.layers.values():
            h, layer_stats = layer(h, cos, sin)
            stats.append(layer_stats)
            if grad_enabled and layer_stats.prob_sums.requires_grad:
                h = _InjectAuxGradient.apply(h, layer_stats.prob_sums, tracker)
        with torch.no_grad():
            totals = router_totals.detach() + torch.stack(
                [torch.stack([s.counts for s in stats]).sum(0), torch.stack([s.prob_sums for s in stats]).sum(0)]
            )
        if self.norm is None:
            # A copy of the injection's view: the zero-bubble schedule detaches stage outputs in place.
            return h.clone(), (_StageRouterTotals.apply(h, totals, tracker) if grad_enabled else totals)
        with torch.no_grad():
            if self.sum_router_stats is not None:
                totals, tracker.replicas = self.sum_router_stats(totals)
                rows *= tracker.replicas
            value = load_balancing_loss([RouterStats(totals[0], totals[1], rows)], self.args.num_experts)
            tracker.counts, tracker.rows = totals[0], rows
        aux_loss = _AuxLossValue.apply(h, value, tracker) if grad_enabled else value
        coef = torch.tensor(self.args.router_aux_loss_coef, device=h.device)
        # A plain tuple: torch.distributed.pipelining takes only a list or tuple as a stage's outputs. The
        # MoEOutput's fields, with the coefficient as a tensor.
        return (self.logits(h), aux_loss, coef)

    def _generation_forward(
        self, tokens: torch.Tensor, cache: KVCache | None, start_pos: int, key_padding_mask: torch.Tensor | None
    ) -> MoEOutput:
        if self.tok_embeddings is None:  # forward sends a pipeline stage without it to _stage_forward
            raise RuntimeError("generation needs the embedding, which this pipeline stage does not hold")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(start_pos + tokens.shape[1])
        cos, sin = cos[start_pos:], sin[start_pos:]
        attn_mask = self.generation_mask(tokens, cache, start_pos, key_padding_mask)
        for name, layer in self.layers.items():
            layer_cache = cache.layer(name) if cache is not None else None
            h, _ = layer(h, cos, sin, kv_cache=layer_cache, start_pos=start_pos, attn_mask=attn_mask)
        no_aux = torch.zeros((), device=h.device, dtype=torch.float32)
        return MoEOutput(self.logits(h), no_aux, self.args.router_aux_loss_coef)


def moe_loss(
    output: MoEOutput | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    labels: torch.Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Training loss of the MoE model, as transformers' Qwen3MoeForCausalLM forms it with labels:
    mean next-token cross-entropy + router_aux_loss_coef * load-balancing loss. `output` may be the
    MoEOutput's fields as a plain tuple: what a pipeline's last stage returns (see `_stage_forward`)."""
    logits, aux_loss, aux_loss_coef = output
    return cross_entropy_loss(logits, labels, chunk_elements) + aux_loss_coef * aux_loss
