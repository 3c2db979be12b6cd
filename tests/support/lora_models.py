"""Small adapted models for the LoRA export tests: the linears of a model's blocks swapped for
LoRALinear as a LoRA run swaps them (everything else frozen), then a few optimizer steps on the
adapters, so that B is far from its zero start and every mapping mistake shows in the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.config.sections import LoRAConfig
from titan_tpu.distributed.parallelize import block_containers
from titan_tpu.lora.apply import apply_lora
from titan_tpu.lora.placement import FACTORS, reset_adapters
from titan_tpu.models.common.lora import lora_layers

RANK, ALPHA = 4, 8.0  # scaling 2: an export that leaves the scaling out is off by the whole update


def adapt_block_linears(model: nn.Module, rank: int = RANK, alpha: float = ALPHA) -> list[str]:
    """The run's LoRA step on a built model (every linear of its repeated blocks but a router, the rest
    frozen; `titan_tpu.lora.apply`), with PEFT's start (A random, B = 0). Returns the adapted names."""
    config = LoRAConfig(enable=True, rank=rank, alpha=alpha)
    names = apply_lora(model, config, block_containers(model), "the test model")
    reset_adapters(model)
    return names


def adapter_parameter_names(model: nn.Module) -> list[str]:
    """The adapters' parameter names, as the model names them (`layers.0.attention.wq.lora_A`): the keys
    a LoRA checkpoint's model entry holds."""
    return [f"{name}.{factor}" for name, _ in lora_layers(model) for factor in FACTORS]


def train_adapters(model: nn.Module, vocab_size: int, steps: int = 3, seed: int = 0) -> None:
    """`steps` Adam steps of next-token loss on random tokens; only the adapters move."""
    generator = torch.Generator().manual_seed(seed)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=0.05)
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, vocab_size, (2, 16), generator=generator)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    for name, layer in lora_layers(model):
        assert layer.lora_B.abs().min() > 0, f"{name}: B still zero after training"
