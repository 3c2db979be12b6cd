"""FLOP accounting shared by the decoder-only families."""

from titan_tpu.models.common.decoder_args import DecoderArgs

# A training step costs three forward passes: for every matmul the convention counts, the backward
# computes two products the size of the forward's (the gradient of the input and of the weight).
TRAINING_PASSES = 3


def decoder_forward_flops_per_token(
    non_embedding_params: int, n_layers: int, n_heads: int, head_dim: int, context_len: int
) -> float:
    """Forward-only FLOPs of one token of a decoder-only transformer that attends to `context_len`
    keys (a KV-cached decode step: the cache length with the token's own key; a whole sequence: its
    length, every token charged the full square):

        2 * N  +  4 * n_layers * n_heads * head_dim * context_len

    N as in `decoder_training_flops_per_token`; 2 FLOPs (multiply + add) per weight, and attention's
    two matmuls, q k^T and p v, 2 * head_dim * context_len each per head. Linear in `context_len`.
    """
    return 2.0 * non_embedding_params + 4.0 * n_layers * n_heads * head_dim * context_len


def decoder_training_flops_per_token(
    non_embedding_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int
) -> float:
    """Training (forward + backward) FLOPs per token of a decoder-only transformer.

    Convention (the one MFU figures in TorchTitan and the PaLM paper use):

        6 * N  +  12 * n_layers * n_heads * head_dim * seq_len

    - N = every parameter except the input embedding table, *including the output head* (counted even
      when it is tied to the embedding, because the output matmul is computed either way); for a
      mixture of experts, only the parameters a token is routed through (active parameters). Each such
      weight costs 2 FLOPs per token forward (multiply + add) and 4 backward (grads of input and weight).
    - The second term is attention's two matmuls, q k^T and p v: 2 * 2 * head_dim * seq_len per head and
      token forward, times 3 for training. The causal mask is not discounted (the kernels compute, or
      are charged for, the full square), and rematerialisation from activation checkpointing is not
      counted: it is overhead, not useful work.
    - Elementwise work (norms, softmax, SiLU, rotary) is ignored; it is well under 1% at these shapes.

    So it is TRAINING_PASSES times `decoder_forward_flops_per_token` at context_len = seq_len: a
    family's training count divided by TRAINING_PASSES is its forward count (what a rollout runs).
    """
    forward = decoder_forward_flops_per_token(non_embedding_params, n_layers, n_heads, head_dim, seq_len)
    return TRAINING_PASSES * forward


def decoder_param_count(args: DecoderArgs, feed_forward_params: int, include_embedding: bool = True) -> int:
    """Trainable parameters of a `DecoderLM`, each tensor counted once (a tied head adds nothing),
    given one block's feed-forward parameters (the family's)."""
    head_dim = args.attn_head_dim
    attention = args.dim * head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    if args.qk_norm:
        attention += 2 * head_dim
    block = attention + feed_forward_params + 2 * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    total = args.n_layers * block + args.dim + head
    return total + args.vocab_size * args.dim if include_embedding else total


def decoder_flops_per_token(args: DecoderArgs, feed_forward_params: int, seq_len: int) -> float:
    """Training FLOPs per token of a `DecoderLM` whose tokens each pass `feed_forward_params`
    feed-forward weights per block; convention in `decoder_training_flops_per_token`. The output
    head's vocab_size * dim weights count even when tied (the matmul happens either way)."""
    non_embedding = decoder_param_count(args, feed_forward_params, include_embedding=False)
    if args.tie_embeddings:
        non_embedding += args.vocab_size * args.dim
    return decoder_training_flops_per_token(non_embedding, args.n_layers, args.n_heads, args.attn_head_dim, seq_len)
