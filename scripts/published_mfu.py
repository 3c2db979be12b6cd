"""Published training MFU of the models this project ships configs for, on Cloud TPUs, to set beside
the planner's estimates: the data of the second planner table in docs/planner.md (scripts/plan_tables.py),
kept beside that script rather than in the installed package.

Every figure is a bf16 pretraining run of MaxText (JAX) published by Google, read on 2026-11-30 from:

- MaxText's "Optimized models tiering" page, which prints MFU per model and slice;
- the AI-Hypercomputer/tpu-recipes READMEs, which print MaxText's model TFLOP/s per device (v5p,
  v6e) or per chip (Ironwood) but no MFU. For those, MFU is that rate over the chip's peak dense
  bf16 FLOP/s (459 v5p, 918 v6e, 2307 Ironwood TFLOP/s: the Cloud TPU documentation's figures, the
  ones `titan_tpu/device/peak.py` holds and `titan_tpu.plan.chips` serves), which is how MaxText's
  own performance-metrics guide says to compute it: such a record keeps the printed rate
  (`tflops_per_chip`) and `mfu_percent` divides it.

Each record links the file at the commit that was read. Runs in int8 or fp8 (Ironwood's `fp8_full`
rows) are left out: the planner estimates bf16 compute. MaxText keeps float32 master weights unless
a comment says otherwise.

Chips, not TensorCores: `chips` is always "<generation>-<chip count>". Google names v4 and v5p slices
by TensorCores (two per chip: "v5p-1024" is 512 chips, as its recipe says) and v5e / v6e slices by
chips; the Ironwood recipes name a slice by its chip topology ("tpu7x-4x8x8", 256 chips) and state
the chip count. `published_name` keeps the source's own name. An Ironwood chip runs as two JAX
devices, one per TensorCore, so MaxText's FSDP degree there counts TensorCores.

How MaxText counts: model FLOPs are the matmuls of one forward and backward pass, without
rematerialisation; current MaxText counts attention causal (half the square), and its guide warns
that older TFLOP/s figures count the full square. At 8k tokens attention is a small share of the
FLOPs, at 128k most of it, so long-context rows compare only with a planner that counts the same way.

Not found in any first-party source: Qwen 3 8B or 32B on any TPU; Qwen3-235B-A22B on v5p or v6e;
Llama 3 8B or 70B on v5p; FLUX.1-dev training on any TPU (MaxDiffusion publishes inference only).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.plan.chips import parse_chips

TIERING = (
    "https://github.com/AI-Hypercomputer/maxtext/blob/20a91e12a17cbaa7b786ac388b192b63392cd855/"
    "docs/reference/models/tiering.md"
)
_RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob/"
IRONWOOD_TABLE = _RECIPES + "0797d9cebfdde7ef9c54666369be5864ca081613/training/ironwood/README.md"


@dataclass(frozen=True)
class PublishedResult:
    model: str  # the config name in titan_tpu/train_configs/, e.g. "llama3_70b"
    chips: str  # "<generation>-<chip count>", e.g. "v5p-512" for the slice Google names v5p-1024
    published_name: str  # the slice as the source names it
    seq_len: int
    global_batch_tokens: int | None  # None where the source gives no batch
    parallelism: str  # as the source configures it
    source: str  # URL of the file at the commit read
    printed_mfu_percent: float | None = None  # the MFU the source prints, where it prints one
    tflops_per_chip: float | None = None  # otherwise the model TFLOP/s per chip it prints

    @property
    def mfu_percent(self) -> float:
        """The printed MFU, or the printed TFLOP/s per chip over the chip's peak."""
        if self.printed_mfu_percent is not None:
            return self.printed_mfu_percent
        if self.tflops_per_chip is None:
            raise ValueError(f"{self.model} on {self.chips}: a record needs the printed MFU or TFLOP/s per chip")
        return 100 * self.tflops_per_chip * 1e12 / parse_chips(self.chips).chip.peak_flops_per_chip()


PUBLISHED: tuple[PublishedResult, ...] = (
    # ---- MaxText tiering page: MFU as printed. ----
    # Row "Llama 3.1 8B | 256 Chips, BF16, SL=8192 | 45.46% | 7,207 tokens/s/device". It links the
    # v6e-256 recipe: per-device batch 4, ici_fsdp_parallelism -1; 4 x 256 x 8192 tokens.
    PublishedResult(
        model="llama3_8b",
        chips="v6e-256",
        published_name="256 Chips",
        seq_len=8192,
        global_batch_tokens=8_388_608,
        parallelism="FSDP 256",
        source=TIERING,
        printed_mfu_percent=45.46,
    ),
    # Row "Llama 3.1 70B | 256 Chips, BF16, SL=8192 | 50.33% | 960". It links a MaxText benchmark
    # config that was not readable here, so batch and parallelism stay unstated. (The v6e-256
    # recipe, 960.248 tokens/s/device, runs per-device batch 5 with FSDP 256.)
    PublishedResult(
        model="llama3_70b",
        chips="v6e-256",
        published_name="256 Chips",
        seq_len=8192,
        global_batch_tokens=None,
        parallelism="not stated",
        source=TIERING,
        printed_mfu_percent=50.33,
    ),
    # Row "Llama 3.1 405B | 256 Chips, BF16, SL=8192 | 38.55% | 123"; links an unreadable config.
    PublishedResult(
        model="llama3_405b",
        chips="v6e-256",
        published_name="256 Chips",
        seq_len=8192,
        global_batch_tokens=None,
        parallelism="not stated",
        source=TIERING,
        printed_mfu_percent=38.55,
    ),
    # ---- tpu-recipes, Trillium (v6e): "TFLOP/s/device" from the README's sample log line; one
    # device per chip. Configs from MaxText tag tpu-recipes-v0.1.4 unless noted. ----
    # "seconds: 3.443, TFLOP/s/device: 413.433, Tokens/s/device: 7138.890, total_weights: 196608";
    # per-device batch 3, ici_fsdp -1: 3 x 8 x 8192 = 196,608.
    PublishedResult(
        model="llama3_8b",
        chips="v6e-8",
        published_name="v6e-8",
        seq_len=8192,
        global_batch_tokens=196_608,
        parallelism="FSDP 8",
        source=_RECIPES
        + "10ca5b92b479825ce36305c06e05aefdcb90541f/training/trillium/Llama3.1-8B-MaxText/v6e-8/README.md",
        tflops_per_chip=413.433,
    ),
    # "seconds: 3.393, TFLOP/s/device: 419.485, total_weights: 393216" (3 x 16 x 8192).
    PublishedResult(
        model="llama3_8b",
        chips="v6e-16",
        published_name="v6e-16",
        seq_len=8192,
        global_batch_tokens=393_216,
        parallelism="FSDP 16",
        source=_RECIPES
        + "43e52ff572cdb3c71be1c4bae4494aa64f12f5b7/training/trillium/Llama3.1-8B-MaxText/v6e-16/README.md",
        tflops_per_chip=419.485,
    ),
    # "seconds: 3.495, TFLOP/s/device: 407.225, total_weights: 786432" (3 x 32 x 8192).
    PublishedResult(
        model="llama3_8b",
        chips="v6e-32",
        published_name="v6e-32",
        seq_len=8192,
        global_batch_tokens=786_432,
        parallelism="FSDP 32",
        source=_RECIPES
        + "43e52ff572cdb3c71be1c4bae4494aa64f12f5b7/training/trillium/Llama3.1-8B-MaxText/v6e-32/README.md",
        tflops_per_chip=407.225,
    ),
    # "seconds: 17.790, TFLOP/s/device: 443.385, total_weights: 524288" (2 x 32 x 8192); this config
    # keeps its weights in bf16 (weight_dtype bfloat16).
    PublishedResult(
        model="llama3_70b",
        chips="v6e-32",
        published_name="v6e-32",
        seq_len=8192,
        global_batch_tokens=524_288,
        parallelism="FSDP 32",
        source=_RECIPES
        + "3596002ad03c04ae20d5f04c711e8a1d2557b7f8/training/trillium/Llama3.1-70B-MaxText/v6e-32/README.md",
        tflops_per_chip=443.385,
    ),
    # "seconds: 18.688, TFLOP/s/device: 422.091, total_weights: 1048576" (2 x 64 x 8192).
    PublishedResult(
        model="llama3_70b",
        chips="v6e-64",
        published_name="v6e-64",
        seq_len=8192,
        global_batch_tokens=1_048_576,
        parallelism="FSDP 64",
        source=_RECIPES
        + "3596002ad03c04ae20d5f04c711e8a1d2557b7f8/training/trillium/Llama3.1-70B-MaxText/v6e-64/README.md",
        tflops_per_chip=422.091,
    ),
    # "seconds: 34.786, TFLOP/s/device: 453.500, total_weights: 4194304" (4 x 128 x 8192).
    PublishedResult(
        model="llama3_70b",
        chips="v6e-128",
        published_name="v6e-128",
        seq_len=8192,
        global_batch_tokens=4_194_304,
        parallelism="FSDP 128",
        source=_RECIPES
        + "3596002ad03c04ae20d5f04c711e8a1d2557b7f8/training/trillium/Llama3.1-70B-MaxText/v6e-128/README.md",
        tflops_per_chip=453.500,
    ),
    # Two v6e-256 slices over the data-center network (MaxText tag tpu-recipes-v0.1.2):
    # "seconds: 54.803, TFLOP/s/device: 392.454, total_weights: 4194304"; per-device batch 1,
    # ici_fsdp 256 x dcn_fsdp 2: 1 x 512 x 8192.
    PublishedResult(
        model="llama3_405b",
        chips="v6e-512",
        published_name="2 x v6e-256",
        seq_len=8192,
        global_batch_tokens=4_194_304,
        parallelism="FSDP 256 (ICI) x FSDP 2 (DCN)",
        source=_RECIPES + "21efcc212df0744372b3bbba53d016b2cc01bf2a/training/trillium/Llama3.1-405B-MaxText/README.md",
        tflops_per_chip=392.454,
    ),
    # ---- tpu-recipes, v5p: one device per chip (megacore). ----
    # "v5p-1024 for 512 v5p chips"; "seconds: 131.474, TFLOP/s/device: 314.530, total_weights:
    # 8388608". The recipe's run_recipe.sh (cluster_toolkit, commit 1dee47db) gives per-device batch
    # 2, ici_fsdp_parallelism -1: 2 x 512 x 8192.
    PublishedResult(
        model="llama3_405b",
        chips="v5p-512",
        published_name="v5p-1024",
        seq_len=8192,
        global_batch_tokens=8_388_608,
        parallelism="FSDP 512",
        source=_RECIPES + "85bce68474c8e1d98b9c22fb3f93c11ed9e960dc/training/v5p/Llama3.1-405B-MaxText/README.md",
        tflops_per_chip=314.530,
    ),
    # ---- tpu-recipes, Ironwood summary table: "Number of chips | GBS | Sequence length |
    # Precision | Step time | TFLOPs/sec/chip | Tokens/sec/chip", bf16 rows. GBS counts sequences.
    # Parallelism from each recipe's run_recipe.sh (ici_fsdp_parallelism -1 over every TensorCore
    # device unless noted), which may postdate the table's run. ----
    # "llama3.1-70b | 64 | 256 | 8192 | bf16 | 12.20 | 1,207.05 | 2,686.98"; per-device batch 2 x
    # 128 devices = 256 sequences.
    PublishedResult(
        model="llama3_70b",
        chips="v7x-64",
        published_name="tpu7x-4x4x4 (64 chips)",
        seq_len=8192,
        global_batch_tokens=2_097_152,
        parallelism="FSDP 128 TensorCores",
        source=IRONWOOD_TABLE,
        tflops_per_chip=1207.05,
    ),
    # "llama3.1-70b | 256 | 1024 | 8192 | bf16 | 12.27 | 1,199.67 | 2,670.55".
    PublishedResult(
        model="llama3_70b",
        chips="v7x-256",
        published_name="tpu7x-4x8x8 (256 chips)",
        seq_len=8192,
        global_batch_tokens=8_388_608,
        parallelism="FSDP 512 TensorCores",
        source=IRONWOOD_TABLE,
        tflops_per_chip=1199.67,
    ),
    # "llama3.1-70b | 256 | 64 | 131072 | bf16 | 34.02 | 897.94 | 963.03"; per-device batch 0.125,
    # ici_context_parallelism 8 and FSDP over the rest.
    PublishedResult(
        model="llama3_70b",
        chips="v7x-256",
        published_name="tpu7x-4x8x8 (256 chips)",
        seq_len=131072,
        global_batch_tokens=8_388_608,
        parallelism="FSDP 64 x CP 8 TensorCores",
        source=IRONWOOD_TABLE,
        tflops_per_chip=897.94,
    ),
    # "llama3.1-405b | 256 | 1536 | 8192 | bf16 | 98.34 | 1,261.40 | 499.77"; per-device batch 3 x
    # 512 devices.
    PublishedResult(
        model="llama3_405b",
        chips="v7x-256",
        published_name="tpu7x-4x8x8 (256 chips)",
        seq_len=8192,
        global_batch_tokens=12_582_912,
        parallelism="FSDP 512 TensorCores",
        source=IRONWOOD_TABLE,
        tflops_per_chip=1261.40,
    ),
    # "qwen3-235b-a22b | 256 | 8192 | 4096 | bf16 | 30.87 | 629.79 | 4,245.89"; per-device batch
    # 16 x 512 devices, experts not sharded over FSDP (shard_exp_on_fsdp False), no expert
    # parallelism. MaxText counts the router and the top-k experts each token is sent to.
    PublishedResult(
        model="qwen3_moe_235b_a22b",
        chips="v7x-256",
        published_name="tpu7x-4x8x8 (256 chips)",
        seq_len=4096,
        global_batch_tokens=33_554_432,
        parallelism="FSDP 512 TensorCores, no EP",
        source=IRONWOOD_TABLE,
        tflops_per_chip=629.79,
    ),
)
