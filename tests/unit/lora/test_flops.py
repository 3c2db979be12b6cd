"""LoRA's FLOPs per token by hand: a family count of 6 N + attention becomes 4 N + attention + 6 x the
adapters' parameters. Catches the frozen weights' input gradients dropped too (2 N instead of 4 N) or
the adapters' own work left out."""

from __future__ import annotations

from titan_tpu.lora.flops import lora_training_flops_per_token


def test_a_lora_token_skips_only_the_frozen_weight_gradients() -> None:
    n, attention, adapters = 1_000_000, 12_345.0, 1_000
    full = 6 * n + attention
    assert lora_training_flops_per_token(full, 6 * n, adapters) == 4 * n + attention + 6 * adapters
