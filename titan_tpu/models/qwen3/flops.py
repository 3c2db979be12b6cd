"""Parameter counts and training FLOPs per token of Qwen 3 (dense and MoE), from the args alone."""

from titan_tpu.models.common.flops import decoder_flops_per_token, decoder_param_count
from titan_tpu.models.qwen3.args import Qwen3Args, Qwen3MoeArgs
from titan_tpu.protocols.planning import ExpertRouting


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
    return decoder_param_count(args, _feed_forward_params(args, active), include_embedding)


def qwen3_flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """Training FLOPs per token; convention in `decoder_training_flops_per_token`.

    N is the active non-embedding parameters: for the MoE model the router (every token is scored
    against every expert) plus top_k experts per layer, never all experts. Expert-parallel
    all-to-alls, and the padding the padded-bmm expert implementation computes, are overhead and not
    counted.
    """
    return decoder_flops_per_token(args, _feed_forward_params(args, active=True), seq_len)


def qwen3_moe_routing(args: Qwen3MoeArgs) -> ExpertRouting:
    """top_k, and the MoE layers' training FLOPs per token: router + top_k SwiGLU experts per layer,
    6 FLOPs per weight."""
    flops = 6.0 * args.n_layers * args.dim * (args.num_experts + 3 * args.top_k * args.moe_hidden_dim)
    return ExpertRouting(args.top_k, flops)
