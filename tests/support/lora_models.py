"""Small adapted models for the LoRA export tests: the linears of a model's blocks swapped for
LoRALinear (everything else frozen), then a few optimizer steps on the adapters, so that B is far
from its zero start and every mapping mistake shows in the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.models.common.lora import LoRALinear, lora_layers

RANK, ALPHA = 4, 8.0  # scaling 2: an export that leaves the scaling out is off by the whole update


def adapt_block_linears(model: nn.Module, blocks: str, rank: int = RANK, alpha: float = ALPHA) -> list[str]:
    """Every nn.Linear under the module path `blocks` (e.g. "layers") becomes a LoRALinear with PEFT's
    start (A random, B = 0); the rest of the model is frozen. Returns the adapted names."""
    model.requires_grad_(False)
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith(blocks + ".")]
    for name in names:
        layer = LoRALinear.wrapping(model.get_submodule(name), rank=rank, alpha=alpha, dropout=0.0)
        layer.reset_adapter()
        model.set_submodule(name, layer)
    return names


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
