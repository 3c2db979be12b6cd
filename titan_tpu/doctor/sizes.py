"""How big the doctor's measurements are: the defaults mean something on an accelerator, `--quick`
fits a CPU test (each check in seconds on a 2-core machine)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.device.peak import PROBE_SIZE


@dataclass(frozen=True)
class AttentionShape:
    """What the attention tunable reads from a model's arguments."""

    n_heads: int
    n_kv_heads: int
    attn_head_dim: int


@dataclass(frozen=True)
class ExpertsShape:
    """What the experts tunable reads from a model's arguments."""

    dim: int
    moe_hidden_dim: int
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class Sizes:
    name: str
    # Square matmul side on an accelerator; a CPU always uses the peak probe's (device/peak.py), the
    # size MFU's CPU peak is measured at.
    matmul: int
    matmul_seconds: float  # per timing window (best of three)
    attention: AttentionShape
    attention_seq_lens: tuple[int, ...]
    experts: ExpertsShape
    expert_tokens: int  # tokens routed through one MoE layer (each to top_k experts)
    collective_bytes: int  # per rank
    collective_iterations: int
    training_overrides: tuple[str, ...]  # on llama3_debug, for the device run and its reference
    compile_run: bool  # compile a small module and compare it with eager (seconds of compile on a CPU)

    def matmul_size(self, device_type: str) -> int:
        return PROBE_SIZE if device_type == "cpu" else self.matmul


# Llama 3 8B's attention heads (32 query, 8 kv, 128 wide) at 2k and 8k tokens; Qwen3-30B-A3B's MoE
# layer (128 experts of width 768 on dim 2048, top 8) on 4k tokens; 64 MiB collectives, where ring
# collectives reach their bandwidth plateau on ICI and NVLink.
DEFAULT = Sizes(
    name="default",
    matmul=8192,
    matmul_seconds=0.5,
    attention=AttentionShape(32, 8, 128),
    attention_seq_lens=(2048, 8192),
    experts=ExpertsShape(2048, 768, 128, 8),
    expert_tokens=4096,
    collective_bytes=64 * 2**20,
    collective_iterations=10,
    training_overrides=(),
    compile_run=True,
)

QUICK = Sizes(
    name="quick",
    matmul=1024,
    matmul_seconds=0.1,
    attention=AttentionShape(4, 2, 32),
    attention_seq_lens=(128, 256),
    experts=ExpertsShape(64, 32, 8, 2),
    expert_tokens=256,
    collective_bytes=2**20,
    collective_iterations=5,
    training_overrides=("--training.seq_len=32", "--training.global_batch_size=4"),
    compile_run=False,
)
