"""Parameter count and training FLOPs per token of Llama 3, computed from the args alone (no model)."""

from models.common.flops import decoder_training_flops_per_token
from models.llama3.args import Llama3Args


def llama3_param_count(args: Llama3Args, include_embedding: bool = True) -> int:
    """Trainable parameters, each tensor counted once (a tied head adds nothing)."""
    head_dim = args.attn_head_dim
    attention = args.dim * head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    feed_forward = 3 * args.dim * args.ffn_hidden_dim
    block = attention + feed_forward + 2 * args.dim
    embedding = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = args.n_layers * block + args.dim + head
    return total + embedding if include_embedding else total


def llama3_flops_per_token(args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token; convention in `decoder_training_flops_per_token`.

    The output head's vocab_size * dim weights count even when tied (the matmul happens either way).
    """
    non_embedding = llama3_param_count(args, include_embedding=False)
    if args.tie_embeddings:
        non_embedding += args.vocab_size * args.dim
    return decoder_training_flops_per_token(
        non_embedding, args.n_layers, args.n_heads, args.attn_head_dim, seq_len
    )
