"""Llama 3 hyperparameters and the published sizes (flavors)."""

from dataclasses import dataclass

from titan_tpu.models.common.decoder_args import DecoderArgs
from titan_tpu.models.common.feed_forward import llama_ffn_hidden_dim
from titan_tpu.models.common.rope import RopeScaling


@dataclass(frozen=True)
class Llama3Args(DecoderArgs):
    """Shape of a Llama 3 model (the shared decoder fields and checks are `DecoderArgs`'): Llama 3.1
    rope scaling by default, and a SwiGLU width derived from `multiple_of` and `ffn_dim_multiplier`
    as Meta's code derives it."""

    multiple_of: int = 1024
    ffn_dim_multiplier: float | None = 1.3
    rope_scaling: RopeScaling | None = RopeScaling()

    @property
    def ffn_hidden_dim(self) -> int:
        return llama_ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


# Llama 3.2 1B/3B ship with factor 32 (their published configs); the 3.1 models use 8.
_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    # Tiny enough to train dozens of steps in seconds on a 2-core CPU; the vocab covers byte-level
    # tokenizers (< 512 tokens).
    "debug": Llama3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        multiple_of=256,
        ffn_dim_multiplier=None,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=2048,
    ),
    # A ~100M-parameter model for measuring training throughput on a CPU or a single small chip:
    # head_dim 128 as in every Llama 3 size, and a 32K vocab so the head's share of FLOPs is realistic.
    "100M": Llama3Args(
        dim=768,
        n_layers=12,
        n_heads=6,
        n_kv_heads=2,
        vocab_size=32768,
        multiple_of=256,
        ffn_dim_multiplier=None,
        rope_scaling=_LLAMA31_ROPE,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA32_ROPE,
        tie_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA32_ROPE,
        tie_embeddings=True,
    ),
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA31_ROPE,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA31_ROPE,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_scaling=_LLAMA31_ROPE,
    ),
}
