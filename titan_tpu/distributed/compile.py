"""torch.compile per transformer block, with the backend resolved in one place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titan_tpu.config.errors import ConfigError

# compile.backend = "auto" -> the first of these that torch._dynamo knows. On TPU it is the backend
# the torch_tpu package registers when imported (name candidates, newest first).
AUTO_BACKENDS: dict[str, tuple[str, ...]] = {
    "cpu": ("inductor",),
    "cuda": ("inductor",),
    "tpu": ("torch_tpu", "tpu", "openxla"),
}


def available_backends() -> list[str]:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def resolve_backend(requested: str, device_type: str) -> str:
    """The dynamo backend name for `requested` ("auto" or a name) on `device_type`."""
    known = available_backends()
    if requested != "auto":
        if requested not in known:
            raise ConfigError(f"compile.backend: '{requested}' is not a torch.compile backend; known: {', '.join(known)}")
        return requested
    for candidate in AUTO_BACKENDS.get(device_type, ("inductor",)):
        if candidate in known:
            return candidate
    raise ConfigError(
        f"compile.backend = 'auto' found no torch.compile backend for {device_type} (looked for "
        f"{', '.join(AUTO_BACKENDS.get(device_type, ()))}); known: {', '.join(known)}. Set compile.backend "
        "or compile.enable = false"
    )


def apply_compile(containers: list[nn.ModuleDict | nn.ModuleList], backend: str) -> None:
    """Compile each block separately (identical blocks share one compiled graph) and put the compiled
    module back in place. Done before FSDP, whose hooks then stay outside the compiled region."""
    for container in containers:
        keys = list(container.keys()) if isinstance(container, nn.ModuleDict) else list(range(len(container)))
        for key in keys:
            block = container[key]  # type: ignore[index]
            container[key] = torch.compile(block, backend=backend, fullgraph=True)  # type: ignore[index]


def compile_loss(loss_fn: Callable[..., torch.Tensor], backend: str) -> Callable[..., torch.Tensor]:
    """The loss upcasts the logits ([tokens, vocab]) to float32 and normalises them: memory-bound
    element-wise work that fusion shrinks to one pass. Vocab-sharded (loss-parallel) logits are
    DTensors handled by their own kernels, so the caller compiles only the plain case."""
    return torch.compile(loss_fn, backend=backend)
