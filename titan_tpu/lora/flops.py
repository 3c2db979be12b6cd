"""Model FLOPs of a LoRA step, for TFLOP/s and MFU.

The families count a training token as 6 N + the attention term (titan_tpu/models/common/flops.py):
per weight 2 FLOPs forward, 2 for the input's gradient and 2 for the weight's. With LoRA the frozen
weights' own gradients are never computed, while the input's still are (they carry the gradient down
to the adapters below), and each adapter factor costs what a trained weight costs (6 per parameter and
token). So a LoRA token is the family's count less 2 N plus 6 x the adapters' parameters; N is read from
the family's own count at no context (6 N, the attention term being 0 there).

Every token an item stands for is trained once in each task that counts tokens (language model, SFT,
GRPO's trained tokens; DPO adds the reference's forward, which LoRA leaves as it is), so the same
difference applies per item there.
"""

from __future__ import annotations

from titan_tpu.models.common.flops import TRAINING_PASSES


def lora_training_flops_per_token(full: float, full_at_no_context: float, adapter_params: int) -> float:
    """`full`: the family's training FLOPs per token of the run (6 N + attention); `full_at_no_context`:
    the same at context 0 (6 N); `adapter_params`: every adapter factor's elements (whole, not a shard)."""
    frozen_weight_gradients = full_at_no_context / TRAINING_PASSES  # 2 N
    return full - frozen_weight_gradients + 2 * TRAINING_PASSES * adapter_params
