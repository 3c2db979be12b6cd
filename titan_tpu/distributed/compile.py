"""torch.compile per transformer block, with the backend resolved in one place."""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from typing import cast

import torch
from torch import nn

from titan_tpu.config.errors import ConfigError

# compile.backend = "auto" -> the device's backend. On TPU it is "tpu", which the torch_tpu package
# registers with torch._dynamo when it loads; torch_tpu refuses inductor on TPU tensors.
AUTO_BACKENDS: dict[str, str] = {"cpu": "inductor", "cuda": "inductor", "tpu": "tpu"}
REFUSED_BACKENDS: dict[str, tuple[str, ...]] = {"tpu": ("inductor",)}


def available_backends() -> list[str]:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def resolve_backend(requested: str, device_type: str) -> str:
    """The dynamo backend name for `requested` ("auto" or a name) on `device_type`."""
    backend = AUTO_BACKENDS.get(device_type, "inductor") if requested == "auto" else requested
    if backend in REFUSED_BACKENDS.get(device_type, ()):
        raise ConfigError(
            f"compile.backend = '{backend}' does not run on {device_type}; use 'auto' (= "
            f"'{AUTO_BACKENDS[device_type]}') or compile.enable = false"
        )
    known = available_backends()
    if backend not in known:
        if requested == "auto":
            what = f"compile.backend = 'auto' on {device_type} needs '{backend}', which"
        else:
            what = f"compile.backend: '{backend}'"
        raise ConfigError(f"{what} is not a torch.compile backend; known: {', '.join(known)}")
    return backend


def apply_compile(containers: list[nn.ModuleDict | nn.ModuleList], backend: str) -> None:
    """Compile each block separately (identical blocks share one compiled graph) and put the compiled
    module back in place. Done before FSDP, whose hooks then stay outside the compiled region.

    A block is compiled whole (fullgraph) unless something inside it cannot be traced; see
    `compile_parts`."""
    for container in containers:
        if isinstance(container, nn.ModuleDict):
            for name in list(container.keys()):
                container[name] = compile_parts(container[name], backend)
        else:
            for position in range(len(container)):
                container[position] = compile_parts(container[position], backend)


def compile_parts(module: nn.Module, backend: str) -> nn.Module:
    """`module` compiled whole with fullgraph=True, or, when it cannot be traced whole, its parts.

    A module whose forward cannot be traced (data-dependent shapes, host syncs: MoE routing and the
    expert-parallel all-to-alls) says so by naming, in a class attribute `compile_children`, its
    direct children that can be (possibly none): the model decides, the engine asks nothing else. A
    module with such a descendant is split into its children, each handled the same way, so an MoE
    block compiles its norms and attention whole and, inside the MoE layer, what the layer names (an
    activation-checkpoint wrapper is split alike: its one child is the block). The uncompiled glue
    runs eagerly, hooks included. Returns the module to put in the parent's place; compiled parts
    are swapped in inside it.
    """
    names = _compile_children(module)
    if names is None:
        if not any(_compile_children(m) is not None for m in module.modules()):
            if backend == "inductor":
                separate_inductor_cache_per_cpu_capability()
            # Compiling a module returns an OptimizedModule (an nn.Module); the stub only says callable.
            return cast(nn.Module, torch.compile(module, backend=backend, fullgraph=True))
        names = tuple(name for name, _ in module.named_children())
    for name in names:
        setattr(module, name, compile_parts(module.get_submodule(name), backend))
    return module


def _compile_children(module: nn.Module) -> tuple[str, ...] | None:
    # A class attribute, looked up on the class: wrappers (activation checkpointing) forward unknown
    # instance attributes to the module they wrap, which would answer for it.
    return getattr(type(module), "compile_children", None)


def separate_inductor_cache_per_cpu_capability() -> None:
    """Unless TORCHINDUCTOR_CACHE_DIR is set, point inductor's on-disk caches at a folder of their
    own per CPU capability (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY
    lowers). torch 2.13's FX graph cache leaves that capability out of its key, while inductor
    generates its CPU kernels for it: code generated for AVX2 (8 floats a vector) was reused by a
    later AVX-512 process on the same machine, whose 16-float stores then ran past their buffers
    (measured: a compiled masked SDPA at batch 128 off by 2.5, then `malloc(): unaligned tcache chunk
    detected`; the same process with the FX graph cache off, or its own folder, matched eager). The
    README holds PyTorch to AVX2 with that variable, as an AVX2-only CPU runs. torch's own default
    folder counts as unset: torch writes it into the variable the first time it looks."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    torch_default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", torch_default) not in ("", torch_default):
        return
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{torch_default}_{capability}"
