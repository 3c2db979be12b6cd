"""The arguments every decoder-only family built from `titan_tpu.models.common` shares, and their checks."""

from dataclasses import dataclass
from typing import ClassVar

from titan_tpu.models.common.attention_kernels import SdpaAttention
from titan_tpu.models.common.chunked_cross_entropy import CHUNK_ELEMENTS
from titan_tpu.models.common.rope import RopeScaling
from titan_tpu.protocols.attention import AttentionKernel


@dataclass(frozen=True)
class DecoderArgs:
    """Shape of a decoder: embedding, `n_layers` pre-norm blocks of grouped-query attention and a
    feed-forward, final norm, head. Frozen: flavors are shared, derive variants with
    dataclasses.replace. The defaults are Llama 3 8B's; a family redeclares the ones it changes.

    head_dim None means dim // n_heads. max_seq_len sizes the rotary tables; the trainer replaces it
    with its sequence length rather than allocate a published 128k context. The feed-forward is the
    family's own (a SwiGLU width, experts), so its fields are too.
    """

    # A per-head RMSNorm on q and k before the rotation (Qwen 3). A class constant, not a field: it
    # is what the family is, so model.overrides cannot switch it and orphan a checkpoint's norms.
    qk_norm: ClassVar[bool] = False

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    head_dim: int | None = None
    # The causal attention kernel (titan_tpu/models/common/attention_kernels.py); the run picks it for its device.
    attention: AttentionKernel = SdpaAttention()
    # Float32 elements per chunk of the cross-entropy (titan_tpu/models/common/chunked_cross_entropy.py), at most
    # its memory budget; -1 is "auto": the trainer measures it (loss_tunable.py), and a model used
    # outside a run takes the budget.
    loss_chunk_elements: int = -1

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None and self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) unless head_dim is given")
        if not (self.loss_chunk_elements == -1 or 0 < self.loss_chunk_elements <= CHUNK_ELEMENTS):
            raise ValueError(
                f"loss_chunk_elements must be -1 (auto) or 1..{CHUNK_ELEMENTS} (the loss's memory budget), "
                f"got {self.loss_chunk_elements}"
            )
        if self.attn_head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.attn_head_dim}")

    @property
    def attn_head_dim(self) -> int:
        """The per-head width actually used (explicit head_dim, else dim // n_heads)."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads
