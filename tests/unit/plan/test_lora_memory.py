"""The planner with `lora.enable` on Qwen 3 8B (meta model, no weights): the frozen base is stored
without gradients or optimizer state (its adapted weights in the compute dtype), the adapters with both, each factor split over tp as the
trainer places it; the report puts the same layout's full fine-tuning beside it.

Worked by hand: rank 16 on all seven projections of 36 blocks (dim 4096, 32 query and 8 key-value
heads of 128, SwiGLU width 12288) is 36 x 16 x (in + out) summed over q (4096 -> 4096), k and v
(4096 -> 1024), o (4096 -> 4096), gate and up (4096 -> 12288), down (12288 -> 4096) = 43,646,976
trained parameters in 504 tensors."""

from __future__ import annotations

import pytest

from titan_tpu.config import load_config
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.plan.__main__ import main
from titan_tpu.plan.census import census
from titan_tpu.plan.chips import parse_chips
from titan_tpu.plan.planner import full_finetuning_memory, make_plan

ADAPTERS = 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))
# The adapted projections' frozen weights (no biases in Qwen 3), stored in bf16 on an H100 (4 bytes
# each in full fine-tuning's float32 master copy, 2 with LoRA).
ADAPTED_WEIGHTS = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288)
LORA = ["--lora.enable=true"]


def test_adapters_have_state_and_the_frozen_base_has_none() -> None:
    """FSDP over 8 devices: every factor's first dimension divides by 8 (16 rows of A, the output rows
    of B). Catches gradients or AdamW moments counted for the base, or adapters not counted at all."""
    config = load_config("sft_qwen3_8b", LORA)
    plan = make_plan(config, parse_chips("h100-8"))
    memory, shares = plan.detail.memory, plan.detail.census
    assert sum(p.numel for p in shares.trained) == ADAPTERS == 43_646_976
    assert all(p.name.endswith(("lora_A", "lora_B")) for p in shares.trained) and len(shares.trained) == 504
    assert memory.gradients == 4 * ADAPTERS // 8
    assert memory.optimizer == 2 * 4 * ADAPTERS // 8 + 4 * 504
    full = full_finetuning_memory(config, 8)
    base = load_config("sft_qwen3_8b", [])
    assert full == make_plan(base, parse_chips("h100-8")).detail.memory
    # The base is stored either way, its adapted weights in bf16 with LoRA; LoRA adds its adapters and
    # saves the base's gradients and moments.
    assert memory.parameters == full.parameters - 2 * ADAPTED_WEIGHTS // 8 + 4 * ADAPTERS // 8
    assert full.gradients == full.parameters and full.optimizer > 100 * memory.optimizer
    assert full.total - memory.total > 3 * full.parameters


def test_each_factor_is_split_over_tp_like_the_trainer_places_it() -> None:
    """Column-split q: lora_A whole, lora_B by rows; row-split o: lora_A by columns, lora_B whole."""
    shares = {
        p.name: p
        for p in census(
            load_config("sft_qwen3_8b", LORA), ParallelDims(dp_replicate=1, dp_shard=1, tp=2, ep=1, world_size=2)
        ).params
    }
    attention = "layers.0.attention"
    assert shares[f"{attention}.wq.lora_A"].tp_numel == 16 * 4096
    assert shares[f"{attention}.wq.lora_B"].tp_numel == 4096 * 16 // 2
    assert shares[f"{attention}.wo.lora_A"].tp_numel == 16 * 4096 // 2
    assert shares[f"{attention}.wo.lora_B"].tp_numel == 4096 * 16
    assert not shares[f"{attention}.wq.weight"].trainable and shares[f"{attention}.wq.lora_A"].trainable


def test_the_report_prints_lora_beside_full_fine_tuning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "sft_qwen3_8b", "--chips", "h100-8", *LORA]) == 0
    out = capsys.readouterr().out
    assert "lora       rank 16, alpha 32, all-linear: 43.6M of 8.23B parameters trained (0.53%)" in out
    assert "  gradients     0.02 GiB   (float32, sharded; the adapters only)" in out
    assert "  full fine-tuning on this layout: parameters 3.81 GiB, gradients 3.81 GiB, optimizer 7.63 GiB" in out
