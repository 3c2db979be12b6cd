"""FLOP accounting shared by the decoder-only families."""


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
    """
    return 6.0 * non_embedding_params + 12.0 * n_layers * n_heads * head_dim * seq_len
