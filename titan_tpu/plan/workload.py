"""What one training step computes: items (tokens or samples), FLOPs per item from the model family's
own function (the one the trainer's MFU uses), and the tokens one sample puts through the model.

The task decides (`training.task`, or the family's `ModelSpec.default_task` under "auto"), as it
does for the trainer's MFU. Language-model tasks (pretraining, GRPO) count tokens with
`ModelSpec.flops_per_token(args, seq_len)`; a mixture of experts adds what every tp rank repeats
(`ModelSpec.planning.expert_routing`). The rectified-flow task counts samples with `flux_training_flops_per_sample`, as its
`flops_per_item` does; the image side comes from `flux.image_size`, the autoencoder's 8x
downsampling (a FLUX.1 autoencoder folder; 2x for the built-in random one, 1x for "identity") and
2x2 patches, the text side from `flux.t5_max_length`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_tpu.models.registry import get_model_spec
from titan_tpu.models.flux.flops import flux_training_flops_per_sample
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.config import TrainConfig

# Spatial downsampling of the latent autoencoders the rectified-flow task can load.
AUTOENCODER_DOWNSAMPLE = {"identity": 1, "random": 2}
FLUX1_AUTOENCODER_DOWNSAMPLE = 8
PATCH = 2


@dataclass(frozen=True)
class Workload:
    unit: str  # "tokens" or "samples", as the trainer reports throughput
    items_per_sample: int
    tokens_per_sample: int  # sequence length the activations scale with
    flops_per_item: float  # training (forward + backward) FLOPs
    # Forward FLOPs of the repeated blocks per item: what recomputing every block costs.
    block_forward_flops_per_item: float
    # Training FLOPs per item that every tensor-parallel rank repeats: a mixture-of-experts layer is
    # not tensor-parallel, so each of the tp ranks routes and runs the same tokens through it.
    tp_replicated_flops_per_item: float = 0.0


def task_name(config: TrainConfig, spec: ModelSpec) -> str:
    return spec.default_task if config.training.task == "auto" else config.training.task


def workload(config: TrainConfig, args: Any) -> Workload:
    spec = get_model_spec(config.model.name)
    if task_name(config, spec) == "rectified_flow":
        flux = config.flux
        downsample = AUTOENCODER_DOWNSAMPLE.get(flux.autoencoder, FLUX1_AUTOENCODER_DOWNSAMPLE)
        image_tokens = (flux.image_size // downsample // PATCH) ** 2
        flops = flux_training_flops_per_sample(args, image_tokens, flux.t5_max_length)
        return Workload("samples", 1, image_tokens + flux.t5_max_length, flops, flops / 3)
    seq_len = config.training.seq_len
    flops = spec.flops_per_token(args, seq_len)
    # The output head (6 V d per token) runs once; only the blocks are recomputed.
    head = 6.0 * args.vocab_size * args.dim
    moe = spec.planning.expert_routing(args).training_flops_per_token if spec.planning.expert_routing is not None else 0.0
    return Workload("tokens", seq_len, seq_len, flops, (flops - head) / 3, moe)
