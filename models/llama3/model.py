"""Llama 3 (3.1 / 3.2 shapes), single-device; parallelism is applied from outside.

Module names follow TorchTitan so that tensor-parallel plans and the Hugging Face adapter can address
them: tok_embeddings, layers["i"].{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm,
feed_forward.{w1,w2,w3}}, norm, output.
"""

from models.common.attention import Attention
from models.common.decoder import DecoderLM
from models.common.feed_forward import FeedForward
from models.common.transformer import TransformerBlock, depth_scaled_init_std
from models.llama3.args import Llama3Args


def build_llama3_block(args: Llama3Args, layer_id: int) -> TransformerBlock:
    attention = Attention(
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.attn_head_dim,
        qk_norm=False,
        norm_eps=args.norm_eps,
        kernel=args.attention,
    )
    return TransformerBlock(
        attention=attention,
        feed_forward=FeedForward(args.dim, args.ffn_hidden_dim),
        dim=args.dim,
        norm_eps=args.norm_eps,
        out_init_std=depth_scaled_init_std(layer_id),
    )


class Llama3Model(DecoderLM):
    """tokens [B, S] -> logits [B, S, vocab_size] in the parameters' dtype (the loss upcasts).

    Build under `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()`; the result is a
    fully valid model, the rotary tables included.
    """

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(
            blocks=[build_llama3_block(args, i) for i in range(args.n_layers)],
            vocab_size=args.vocab_size,
            dim=args.dim,
            head_dim=args.attn_head_dim,
            max_seq_len=args.max_seq_len,
            rope_theta=args.rope_theta,
            rope_scaling=args.rope_scaling,
            norm_eps=args.norm_eps,
            tie_embeddings=args.tie_embeddings,
        )
        self.args = args
