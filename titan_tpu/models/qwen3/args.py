"""Qwen 3 hyperparameters and the published sizes (flavors), dense and mixture-of-experts.

Published values are those of the Qwen/Qwen3-* configs on the Hugging Face hub: vocab 151936,
head_dim 128 at every size, rope theta 1e6, RMSNorm eps 1e-6, QK-norm, no attention bias, tied
embeddings for 0.6B / 1.7B / 4B. The MoE sizes route every token to `top_k` of `num_experts` experts in
every layer (no dense-only layers), with the top-k weights renormalised (`norm_topk_prob`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from titan_tpu.models.common.decoder_args import DecoderArgs

# How the experts' matmuls run; see `titan_tpu.models.qwen3.moe.GroupedExperts`.
ExpertImpl = Literal["auto", "grouped_mm", "padded_bmm", "loop", "ragged_dot"]


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs):
    """Shape of a dense Qwen 3 (the shared decoder fields and checks are `DecoderArgs`'): QK-norm,
    and the published defaults that differ from Llama 3's (those of Qwen3-8B)."""

    qk_norm: ClassVar[bool] = True

    n_layers: int = 36
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    head_dim: int = 128
    ffn_hidden_dim: int = 12288


@dataclass(frozen=True)
class Qwen3MoeArgs(Qwen3Args):
    """A Qwen 3 whose every feed-forward is a mixture of `num_experts` SwiGLU experts of width
    `moe_hidden_dim`, `top_k` of them per token. `ffn_hidden_dim` is unused (kept for the published
    config's `intermediate_size`).

    router_aux_loss_coef weights the load-balancing loss in the training loss (transformers' default
    and the published value is 0.001). expert_impl (set from `model.moe_impl`) picks how expert
    matmuls run; every choice computes the same function ("loop" is the simple reference).
    ragged_dot_op is the device's grouped matmul that expert_impl "ragged_dot" runs (TorchTPU's
    `torch.tpu.ops.ragged_dot`), handed in by the run on TPU, never set in a config.
    """

    num_experts: int = 128
    top_k: int = 8
    moe_hidden_dim: int = 768
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    expert_impl: ExpertImpl = "auto"
    ragged_dot_op: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # Tiny enough to train in minutes on a 2-core CPU; the vocab covers the byte tokenizer (258 ids).
    "debug": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=512,
        ffn_hidden_dim=768,
        max_seq_len=2048,
    ),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072, tie_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144, tie_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728, tie_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600),
}

QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    # 8 experts so that ep 2, 4 and 8 all divide them; widths are multiples of 16 so every expert
    # implementation (grouped_mm needs 16-byte aligned strides) runs on it.
    "debug_moe": Qwen3MoeArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=512,
        ffn_hidden_dim=768,
        max_seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
    ),
    "30B-A3B": Qwen3MoeArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_hidden_dim=6144,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=768,
    ),
    "235B-A22B": Qwen3MoeArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        ffn_hidden_dim=12288,
        num_experts=128,
        top_k=8,
        moe_hidden_dim=1536,
    ),
}
