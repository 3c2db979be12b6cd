"""Llama 3 (3.1 / 3.2 shapes), single-device; parallelism is applied from outside.

The shared decoder (`titan_tpu.models.common.decoder`) with a dense SwiGLU in every block; module names are
listed there.
"""

from titan_tpu.models.common.decoder import DecoderLM, decoder_block
from titan_tpu.models.common.feed_forward import FeedForward
from titan_tpu.models.common.transformer import TransformerBlock
from titan_tpu.models.llama3.args import Llama3Args


def build_llama3_block(args: Llama3Args, layer_id: int) -> TransformerBlock:
    return decoder_block(args, layer_id, FeedForward(args.dim, args.ffn_hidden_dim))


class Llama3Model(DecoderLM):
    """tokens [B, S] -> logits [B, S, vocab_size]; how to build it: `DecoderLM`."""

    args: Llama3Args

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args, [build_llama3_block(args, i) for i in range(args.n_layers)])
