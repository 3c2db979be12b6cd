"""The run's "auto" kernels decided once, before the model is built, the same on every rank.

Rank 0 decides each tunable field (from the cache, else by measuring) and broadcasts the names, so
no two ranks run different kernels because their timings differed. Deterministic runs skip the
measurement and take each tunable's fallback: a timing may differ between two runs, a fallback not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from titan_tpu.autotune.cache import KernelCache
from titan_tpu.autotune.measure import measure
from titan_tpu.protocols.tunable import KernelShape, Tunable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelChoice:
    field: str
    pick: str
    source: str  # "measured in N s", "cached", "only candidate", "deterministic", "forced by the config"
    times_ms: dict[str, float | None]  # empty unless measured or cached

    def describe(self) -> str:
        times = ", ".join(f"{name} {'refused' if ms is None else f'{ms:.1f} ms'}" for name, ms in self.times_ms.items())
        return f"kernels: {self.field} -> {self.pick} ({self.source}{': ' + times if times else ''})"


def machine_key(device_name: str, device_type: str) -> dict[str, Any]:
    """What a timing depends on besides the shapes."""
    flags = sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True) if device_type == "cpu" else []
    return {"device": device_name, "flags": flags, "threads": torch.get_num_threads(), "torch": torch.__version__}


def _decide(
    tunable: Tunable,
    args: Any,
    shape: KernelShape,
    machine: dict[str, Any],
    cache: KernelCache | None,
    synchronize: Callable[[], None],
    timer: Callable[[], float],
) -> KernelChoice:
    candidates = tunable.candidates(args, shape)
    if len(candidates) == 1:
        return KernelChoice(tunable.field, next(iter(candidates)), "only candidate", {})
    key = json.dumps(
        {
            **machine,
            "field": tunable.field,
            "dtype": str(shape.dtype),
            "autocast": shape.autocast,
            "shape": tunable.key(args, shape),
        },
        sort_keys=True,
    )
    entry = cache.get(key) if cache is not None else None
    if entry is not None and entry["pick"] in candidates and set(entry["times_ms"]) == set(candidates):
        times = {name: entry["times_ms"][name] for name in candidates}  # the file keeps them sorted
        return KernelChoice(tunable.field, entry["pick"], "cached", times)
    start = time.perf_counter()
    measured = measure(tunable, args, shape, candidates, synchronize, timer)
    for name, why in measured.refused.items():
        logger.warning("kernels: %s candidate %s refused (%s)", tunable.field, name, why)
    if cache is not None:
        cache.put(key, {"pick": measured.pick, "times_ms": measured.times_ms})
    source = f"measured in {time.perf_counter() - start:.1f} s"
    return KernelChoice(tunable.field, measured.pick, source, measured.times_ms)


def fallback_kernels(tunables: Sequence[Tunable], args: Any, shape: KernelShape) -> tuple[Any, list[KernelChoice]]:
    """`args` with every auto field at its tunable's fallback, and the choices: no measurement and no
    collective, since every rank derives the same picks by rule (the dry run, titan_tpu/dryrun, whose
    simulated ranks share no process group that carries data)."""
    auto = [t for t in tunables if t.is_auto(args)]
    forced = [
        KernelChoice(t.field, t.name_of(args), "forced by the config", {}) for t in tunables if not t.is_auto(args)
    ]
    picked = [KernelChoice(t.field, t.fallback, "fallback, not measured", {}) for t in auto]
    values = {c.field: t.candidates(args, shape)[c.pick] for t, c in zip(auto, picked)}
    return dataclasses.replace(args, **values), forced + picked


def choose_kernels(
    tunables: Sequence[Tunable],
    args: Any,
    shape: KernelShape,
    device_name: str,
    *,
    deterministic: bool,
    cache: KernelCache | None,
    synchronize: Callable[[], None] = lambda: None,
    timer: Callable[[], float] = time.perf_counter,
) -> tuple[Any, list[KernelChoice]]:
    """`args` with every auto tunable field set to its pick, and the choices (for the log).
    Collective when a process group is up: every rank calls it at the same point."""
    auto = [t for t in tunables if t.is_auto(args)]
    forced = [
        KernelChoice(t.field, t.name_of(args), "forced by the config", {}) for t in tunables if not t.is_auto(args)
    ]
    if not auto:
        return args, forced
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    choices: list[Any] = [None]
    if not distributed or dist.get_rank() == 0:
        machine = machine_key(device_name, shape.device.type)
        choices[0] = [
            KernelChoice(t.field, t.fallback, "deterministic", {})
            if deterministic
            else _decide(t, args, shape, machine, cache, synchronize, timer)
            for t in auto
        ]
    if distributed:
        dist.broadcast_object_list(choices, src=0)
    picked: list[KernelChoice] = choices[0]
    values = {c.field: t.candidates(args, shape)[c.pick] for t, c in zip(auto, picked)}
    return dataclasses.replace(args, **values), forced + picked
