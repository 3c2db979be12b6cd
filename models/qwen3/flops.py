"""Parameter counts and training FLOPs per token of Qwen 3 (dense and MoE), from the args alone."""

from models.common.flops import decoder_training_flops_per_token
from models.qwen3.args import Qwen3Args, Qwen3MoeArgs


def _feed_forward_params(args: Qwen3Args, active: bool) -> int:
    if isinstance(args, Qwen3MoeArgs):
        experts = args.top_k if active else args.num_experts
        router = args.num_experts * args.dim
        return router + experts * 3 * args.dim * args.moe_hidden_dim
    return 3 * args.dim * args.ffn_hidden_dim


def qwen3_param_count(args: Qwen3Args, include_embedding: bool = True, active: bool = False) -> int:
    """Trainable parameters, each tensor counted once (a tied head adds nothing).

    active=True counts what one token is routed through: the router and top_k experts per layer
    instead of all experts (the same as the total for a dense model).
    """
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads) + 2 * args.head_dim
    block = attention + _feed_forward_params(args, active) + 2 * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = args.n_layers * block + args.dim + head
    return total + args.vocab_size * args.dim if include_embedding else total


def qwen3_flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """Training FLOPs per token; convention in `decoder_training_flops_per_token`.

    N is the active non-embedding parameters: for the MoE model the router (every token is scored
    against every expert) plus top_k experts per layer, never all experts; the output head counts even
    when tied. Expert-parallel all-to-alls, and the padding the padded-bmm expert implementation
    computes, are overhead and not counted.
    """
    non_embedding = qwen3_param_count(args, include_embedding=False, active=True)
    if args.tie_embeddings:
        non_embedding += args.vocab_size * args.dim
    return decoder_training_flops_per_token(
        non_embedding, args.n_layers, args.n_heads, args.head_dim, seq_len
    )
