"""Parameter count and training FLOPs per token of Llama 3, computed from the args alone (no model)."""

from titan_tpu.models.common.flops import decoder_flops_per_token, decoder_param_count
from titan_tpu.models.llama3.args import Llama3Args


def llama3_param_count(args: Llama3Args, include_embedding: bool = True) -> int:
    """Trainable parameters, each tensor counted once (a tied head adds nothing)."""
    return decoder_param_count(args, 3 * args.dim * args.ffn_hidden_dim, include_embedding)


def llama3_flops_per_token(args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token; convention in `decoder_training_flops_per_token`."""
    return decoder_flops_per_token(args, 3 * args.dim * args.ffn_hidden_dim, seq_len)
