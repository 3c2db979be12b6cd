"""Layers shared by the decoder-only model families (Llama 3, Qwen 3, ...)."""

from models.common.attention import Attention
from models.common.feed_forward import FeedForward, llama_ffn_hidden_dim
from models.common.flops import decoder_training_flops_per_token
from models.common.init import trunc_normal_std_
from models.common.loss import IGNORE_INDEX, cross_entropy_loss
from models.common.norms import RMSNorm
from models.common.rope import RopeScaling, RotaryEmbedding, apply_rotary_emb, rope_inv_freq
from models.common.transformer import TransformerBlock, depth_scaled_init_std

__all__ = [
    "IGNORE_INDEX",
    "Attention",
    "FeedForward",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "TransformerBlock",
    "apply_rotary_emb",
    "cross_entropy_loss",
    "decoder_training_flops_per_token",
    "depth_scaled_init_std",
    "llama_ffn_hidden_dim",
    "rope_inv_freq",
    "trunc_normal_std_",
]
