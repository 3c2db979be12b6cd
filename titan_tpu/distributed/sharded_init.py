"""Random weight init that does not depend on the parallel layout.

The model's `init_weights()` draws with `nn.init.*` on parameters that
are by then DTensor shards. The draws are intercepted (the in-place `uniform_` / `normal_` ops through
a TorchDispatchMode, `nn.init.trunc_normal_` by patching it for the duration, because torch's
rejection loop would run per shard) and filled so that element [i, ...] of the *full* parameter gets
the same value on every layout: each row i (index along dim 0; 1-D tensors in blocks of 1024
elements) is drawn on the CPU from its own generator, seeded by (training seed, parameter name, how
many draws that parameter had before, row index). A rank generates only the rows its shard touches
(at full row width, then keeps its columns), so the cost and memory are those of the local shard
times at most the tp degree, never the whole model. Deterministic element-wise init (ones_, fill,
arithmetic) runs on the shards as usual. One process, FSDP, HSDP and TP therefore start from
bit-identical weights, on any device type (the draws are on the CPU, then copied to the shard).
A LoRA run's adapters (titan_tpu/lora/placement.py `reset_adapters`) are drawn the same way, after the
model's own init: lora_A Kaiming-uniform by its name, lora_B zero.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode

from titan_tpu.lora.placement import reset_adapters

# Wrappers that insert a path component without changing what a parameter is.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_BLOCK_1D = 1024


def canonical_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# Parameters up to this many elements are initialised whole on every rank, then cut to the rank's
# shard: a model's own init may index, slice or fill them in ways DTensor has no rule for (HunYuan
# V4's transformers init fills a slice of a `zeros_like` copy), and a whole one costs a rank at most
# this much, briefly. Larger ones are initialised as shards.
WHOLE_INIT_ELEMENTS = 2**20


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, buffer_device: torch.device) -> None:
    """`model.init_weights(buffer_device=...)` with sharding-invariant random draws."""
    with small_parameters_whole(model):
        names: dict[int, str] = {}
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            names.setdefault(id(tensor), canonical_name(name))
        with ShardingInvariantInit(names, seed):
            model.init_weights(buffer_device=buffer_device)  # type: ignore[operator]  # every family's model has it
            # LoRA's factors (a family's init knows nothing of them), drawn like every weight.
            reset_adapters(model)


@contextlib.contextmanager
def small_parameters_whole(model: nn.Module) -> Iterator[None]:
    """While inside, every DTensor parameter of at most WHOLE_INIT_ELEMENTS is a whole plain tensor
    on each rank (one per DTensor, so a tied pair stays tied); on the way out each rank keeps its
    shard of it. The draws fill the whole tensor row by row as they fill shards, so the values are
    the same either way."""
    whole: dict[int, tuple[DTensor, nn.Parameter]] = {}
    owners: list[tuple[nn.Module, str, nn.Parameter]] = []  # the DTensor parameters to put back
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor) or param.numel() > WHOLE_INIT_ELEMENTS:
                continue
            if id(param) not in whole:
                local = param.to_local()
                tensor = torch.empty(param.shape, dtype=param.dtype, device=local.device)
                whole[id(param)] = (param, nn.Parameter(tensor, requires_grad=param.requires_grad))
            owners.append((module, name, param))
            module._parameters[name] = whole[id(param)][1]
    try:
        yield
    finally:
        for module, name, sharded in owners:
            module._parameters[name] = sharded
        for dtensor, tensor in whole.values():
            shard = distribute_tensor(tensor.detach(), dtensor.device_mesh, dtensor.placements, src_data_rank=None)
            dtensor.to_local().copy_(shard.to_local())


_aten = torch.ops.aten


@dataclass(frozen=True)
class Sampler:
    """One distribution: "uniform" (a, b), "normal" (mean, std) or "trunc_normal" (mean, std, a, b)."""

    kind: str
    params: tuple[float, ...]

    def fill(self, out: torch.Tensor, generator: torch.Generator) -> None:
        if self.kind == "uniform":
            out.uniform_(*self.params, generator=generator)
            return
        mean, std = self.params[:2]
        out.normal_(mean, std, generator=generator)
        if self.kind == "trunc_normal":
            # Rejection inside one row, from that row's own generator: the result does not
            # depend on which other rows this rank holds (torch's version loops over the shard).
            low, high = self.params[2:]
            while True:
                mask = (out < low) | (out > high)
                count = int(mask.sum())
                if count == 0:
                    break
                out[mask] = torch.empty(count).normal_(mean, std, generator=generator)


class ShardingInvariantInit(TorchDispatchMode):
    """Fills `uniform_` / `normal_` (dispatch level) and `nn.init.trunc_normal_` (patched for the
    duration, since torch's rejection loop runs per shard) so that the full tensor's values do not
    depend on its sharding."""

    def __init__(self, names: dict[int, str], seed: int) -> None:
        super().__init__()
        self.names = names
        self.seed = seed
        self.draws: dict[str, int] = {}
        self.last_name = "<start>"
        self._saved_trunc_normal: Any = None

    def __enter__(self) -> ShardingInvariantInit:
        self._saved_trunc_normal = nn.init.trunc_normal_
        original = self._saved_trunc_normal

        def trunc_normal_(
            tensor: torch.Tensor,
            mean: float = 0.0,
            std: float = 1.0,
            a: float = -2.0,
            b: float = 2.0,
            generator: torch.Generator | None = None,
        ) -> torch.Tensor:
            if generator is not None or tensor.is_meta:
                return original(tensor, mean, std, a, b, generator=generator)
            # Off the mode stack while drawing: else each of the few ops per row (a model has
            # thousands of rows) would come back through __torch_dispatch__ in Python, which made
            # this init 3-4x slower. (Within __torch_dispatch__, torch takes the mode off itself.)
            TorchDispatchMode.__exit__(self, None, None, None)
            try:
                self._fill(tensor, Sampler("trunc_normal", (mean, std, a, b)))
            finally:
                TorchDispatchMode.__enter__(self)
            return tensor

        nn.init.trunc_normal_ = trunc_normal_
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        nn.init.trunc_normal_ = self._saved_trunc_normal

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in (_aten.uniform_.default, _aten.normal_.default) or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        keys = ("from", "to") if func is _aten.uniform_.default else ("mean", "std")
        params = tuple(
            float(args[1 + i] if len(args) > 1 + i else kwargs.get(keys[i], (0.0, 1.0)[i])) for i in range(2)
        )
        self._fill(args[0], Sampler("uniform" if keys[0] == "from" else "normal", params))
        return args[0]

    def _key(self, tensor: torch.Tensor) -> str:
        # A tensor that is not a parameter or buffer (a temporary of some init function) counts as
        # one more draw of the parameter initialised just before.
        name = self.names.get(id(tensor), self.last_name)
        self.last_name = name
        draw = self.draws.get(name, 0)
        self.draws[name] = draw + 1
        return f"{self.seed}/{name}/{draw}"

    def _fill(self, tensor: torch.Tensor, sampler: Sampler) -> None:
        key = self._key(tensor)
        if isinstance(tensor, DTensor):
            local = tensor._local_tensor
            local_shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            if tuple(local_shape) != tuple(local.shape):
                raise RuntimeError(f"unexpected local shard {tuple(local.shape)} vs {tuple(local_shape)} for {key}")
        else:
            local, offset = tensor, (0,) * tensor.ndim
        if local.numel() == 0 or local.is_meta:  # a model on `meta` (the dry run) has nothing to fill
            return
        values = _draw(sampler, tuple(tensor.shape), tuple(offset), tuple(local.shape), _base_seed(key))
        local.copy_(values)


def _base_seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _unit_seed(base: int, unit: int) -> int:
    """splitmix64 of (base + unit): well-spread seeds for neighbouring rows."""
    z = (base + (unit + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _units(sampler: Sampler, base: int, first: int, last: int, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
    generator = torch.Generator(device="cpu")
    for unit in range(first, last):
        generator.manual_seed(_unit_seed(base, unit))
        out = torch.empty(shape, dtype=torch.float32)
        sampler.fill(out, generator)
        yield out


def _draw(
    sampler: Sampler, shape: tuple[int, ...], offset: tuple[int, ...], local: tuple[int, ...], base: int
) -> torch.Tensor:
    """The float32 CPU values of the region [offset, offset + local) of a `shape` tensor."""
    if len(shape) == 0:
        return next(_units(sampler, base, 0, 1, ()))
    if len(shape) == 1:
        start, stop = offset[0], offset[0] + local[0]
        first, last = start // _BLOCK_1D, (stop - 1) // _BLOCK_1D + 1
        flat = torch.cat(list(_units(sampler, base, first, last, (_BLOCK_1D,))))
        return flat[start - first * _BLOCK_1D : stop - first * _BLOCK_1D]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local[1:]))
    rows = [row[inner] for row in _units(sampler, base, offset[0], offset[0] + local[0], shape[1:])]
    return torch.stack(rows)
